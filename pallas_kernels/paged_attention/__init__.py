from pallas_kernels.paged_attention.api import paged_attention

__all__ = ["paged_attention"]
