from pallas_kernels.moe.api import BACKENDS, moe_experts, moe_experts_weighted
from pallas_kernels.moe.reference import moe_experts_reference

__all__ = ["BACKENDS", "moe_experts", "moe_experts_reference", "moe_experts_weighted"]
