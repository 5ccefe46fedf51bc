"""SwiGLU MLP and the sparse MoE block with a gated shared expert (Qwen3.5-MoE).

MoE routing (HF ``Qwen3_5MoeSparseMoeBlock``): ``p = softmax(x @ gate.T)`` in float32, the
top ``num_experts_per_tok`` experts, weights renormalised to sum 1 when ``norm_topk_prob``;
``y = sum_e w_e * expert_e(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)``.
Expert weights are fused: ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.config import ModelConfig
from mtp_jax.models.layers.basic import Linear, as_data, merge_linears, mergeable, project
from pallas_kernels.moe import moe_experts_weighted
from pallas_kernels.moe.router import MAX_EXPERTS, route_topk


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, dtype):
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)
        self.gate_up_proj = None  # MergedLinear of (gate, up) after merge_projections()

    def merge_projections(self) -> None:
        """Merge ``gate_proj, up_proj`` into one ``gate_up_proj``
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the two are removed)."""
        if (self.gate_up_proj is None and self.gate_proj is not None
                and mergeable([self.gate_proj, self.up_proj])):
            self.gate_up_proj = as_data(merge_linears([self.gate_proj, self.up_proj]))
            self.gate_proj = self.up_proj = None

    def __call__(self, x: jax.Array) -> jax.Array:
        gate, up = project(x, self.gate_up_proj, (self.gate_proj, self.up_proj))
        return self.activate(gate, up)

    def activate(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        """``down(silu(gate) * up)`` from the gate and up projections' outputs."""
        return self.down_proj(jax.nn.silu(gate) * up)


class Experts(nnx.Module):
    """Routed SwiGLU experts; the computation is
    :func:`pallas_kernels.moe.moe_experts_weighted` (the routing-weighted sum of each token's
    experts).

    ``backend`` (static): ``"xla"`` or ``"pallas"`` (Triton kernels, GPU only). With
    ``pallas``, calls with fewer (token, expert) pairs than experts (decode and verify rows)
    still take the XLA gather-reduce form: on the H200 (Qwen3.6-35B-A3B shape, batch 1) the
    decode step took 3.47 ms with it against 3.94 ms with the few-pairs kernels of
    :mod:`pallas_kernels.moe.few` (reachable through ``moe_experts_weighted(backend="pallas")``);
    larger calls (prefill) take the grouped matmuls (6.3x the XLA prefill rate on that shape).
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype,
                 backend: str = "xla"):
        self.gate_up_proj = nnx.Param(jnp.zeros((num_experts, 2 * intermediate, hidden), dtype))
        self.down_proj = nnx.Param(jnp.zeros((num_experts, hidden, intermediate), dtype))
        self.backend = backend

    def __call__(self, x: jax.Array, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
        """``x [N, H]``, ``expert_ids / weights [N, top_k]`` -> ``[N, H]`` weighted sum."""
        few = expert_ids.size < self.gate_up_proj.shape[0]
        backend = "xla" if few else self.backend
        return moe_experts_weighted(x, expert_ids, weights, self.gate_up_proj[...],
                                    self.down_proj[...], backend=backend)


class SparseMoE(nnx.Module):
    """Routed experts plus the gated shared expert. With the ``pallas`` MoE backend the routing
    (softmax, top-k, renormalisation) is one Triton kernel
    (:func:`pallas_kernels.moe.router.route_topk`) when the expert count is a power of two up
    to 1024 (every released shape), else XLA's softmax and top-k."""

    def __init__(self, cfg: ModelConfig, dtype, backend: str = "xla"):
        h = cfg.hidden_size
        self.backend = backend
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(h, cfg.num_experts, dtype)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, dtype,
                               backend=backend)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(h, 1, dtype)
        self.num_experts = cfg.num_experts
        # MergedLinear of (gate, shared_expert_gate, shared gate_proj, shared up_proj) after
        # merge_projections().
        self.in_proj = None

    def merge_projections(self) -> None:
        """Merge the router ``gate``, ``shared_expert_gate`` and the shared expert's
        ``gate_proj`` / ``up_proj`` (all read the layer input) into one ``in_proj``
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the four are removed)."""
        se = self.shared_expert
        parts = [self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj]
        if self.in_proj is None and mergeable(parts):
            self.in_proj = as_data(merge_linears(parts))
            self.gate = self.shared_expert_gate = se.gate_proj = se.up_proj = None

    def _router_backend(self) -> str:
        e = self.num_experts
        fits = e & (e - 1) == 0 and e <= MAX_EXPERTS
        return "pallas" if self.backend == "pallas" and fits else "xla"

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        se = self.shared_expert
        if self.in_proj is None:
            logits, shared_gate, gate, up = project(
                x2, None, (self.gate, self.shared_expert_gate, se.gate_proj, se.up_proj))
        else:
            proj = self.in_proj.stacked(x2)
            _, shared_gate, gate, up = jnp.split(proj, self.in_proj.offsets[1:], axis=-1)
            logits = proj  # the router reads its first E columns in place (no sliced copy)
        weights, ids = route_topk(logits, self.top_k, normalize=self.norm_topk_prob,
                                  backend=self._router_backend(), num_experts=self.num_experts)
        routed = self.experts(x2, ids, weights)
        shared = se.activate(gate, up) * jax.nn.sigmoid(
            shared_gate.astype(jnp.float32)).astype(x2.dtype)
        return (routed + shared).reshape(shape)
