from pallas_kernels.paged_attention.api import BACKENDS, paged_attention
from pallas_kernels.paged_attention.pallas import paged_attention_pallas
from pallas_kernels.paged_attention.reference import paged_attention_reference

__all__ = ["BACKENDS", "paged_attention", "paged_attention_pallas", "paged_attention_reference"]
