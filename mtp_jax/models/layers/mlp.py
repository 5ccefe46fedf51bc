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
from mtp_jax.models.layers.basic import Linear


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, dtype):
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nnx.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int, dtype):
        self.gate_up_proj = nnx.Param(jnp.zeros((num_experts, 2 * intermediate, hidden), dtype))
        self.down_proj = nnx.Param(jnp.zeros((num_experts, hidden, intermediate), dtype))

    def __call__(self, x: jax.Array, expert_ids: jax.Array, weights: jax.Array) -> jax.Array:
        """``x [N, H]``, ``expert_ids / weights [N, top_k]`` -> ``[N, H]`` weighted sum."""
        n, top_k = expert_ids.shape
        num_experts = self.gate_up_proj.shape[0]
        if n * top_k < num_experts:
            y = self._gathered(x, expert_ids)
        else:
            y = self._grouped(x, expert_ids)
        return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights).astype(x.dtype)

    def _swiglu(self, gu: jax.Array) -> jax.Array:
        i = gu.shape[-1] // 2
        return jax.nn.silu(gu[..., :i]) * gu[..., i:]

    def _gathered(self, x, expert_ids):
        """Few tokens: read only the chosen experts' weights. Returns ``[N, top_k, H]``."""
        wgu = self.gate_up_proj[...][expert_ids]  # [N, k, 2I, H]
        wd = self.down_proj[...][expert_ids]  # [N, k, H, I]
        h = self._swiglu(jnp.einsum("nh,nkih->nki", x.astype(wgu.dtype), wgu))
        return jnp.einsum("nki,nkhi->nkh", h, wd)

    def _grouped(self, x, expert_ids):
        """Many tokens: sort the (token, expert) pairs by expert and run grouped matmuls."""
        n, top_k = expert_ids.shape
        wgu, wd = self.gate_up_proj[...], self.down_proj[...]
        flat = expert_ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        tokens = order // top_k
        sizes = jnp.bincount(flat, length=wgu.shape[0]).astype(jnp.int32)
        xs = x.astype(wgu.dtype)[tokens]
        h = self._swiglu(jax.lax.ragged_dot(xs, jnp.swapaxes(wgu, 1, 2), sizes))
        y = jax.lax.ragged_dot(h, jnp.swapaxes(wd, 1, 2), sizes)  # [N*k, H] sorted
        out = jnp.zeros_like(y).at[order].set(y)
        return out.reshape(n, top_k, -1)


class SparseMoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        h = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(h, cfg.num_experts, dtype)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, dtype)
        self.shared_expert = MLP(h, cfg.shared_expert_intermediate_size, dtype)
        self.shared_expert_gate = Linear(h, 1, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        probs = jax.nn.softmax(self.gate(x2).astype(jnp.float32), axis=-1)
        weights, ids = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        routed = self.experts(x2, ids, weights)
        shared = self.shared_expert(x2) * jax.nn.sigmoid(
            self.shared_expert_gate(x2).astype(jnp.float32)).astype(x2.dtype)
        return (routed + shared).reshape(shape)
