from pallas_kernels.paged_attention.api import BACKENDS, paged_attention
from pallas_kernels.paged_attention.pallas import paged_attention_pallas, paged_attention_rows
from pallas_kernels.paged_attention.prep import qk_norm_rope_write
from pallas_kernels.paged_attention.reference import paged_attention_reference

__all__ = ["BACKENDS", "paged_attention", "paged_attention_pallas", "paged_attention_reference",
           "paged_attention_rows", "qk_norm_rope_write"]
