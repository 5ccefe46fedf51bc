"""Gated full attention of the Qwen3.5 family over the paged KV pool.

    q, gate = split_per_head(q_proj x)        # per head [query(D) | gate(D)]
    q = rope(q_norm(q)); k = rope(k_norm(k_proj x)); v = v_proj x
    out = o_proj(attention(q, k, v) * sigmoid(gate))

Partial NeoX rotary on the first ``head_dim * partial_rotary_factor`` dims, with the config's
RoPE scaling (``cfg.rope_scaling``: default, linear or YaRN; :mod:`mtp_jax.models.layers.rotary`)
on both paths; GQA. Source: HF transformers ``qwen3_5`` (``Qwen3_5Attention``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch, write_kv
from mtp_jax.config import ModelConfig
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.basic import Linear, RMSNorm, as_data, merge_linears, mergeable, project
from mtp_jax.models.layers.rotary import apply_rotary, rope_inv_freq
from pallas_kernels.common import interpret_mode
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention.api import uses_kernel
from pallas_kernels.paged_attention.merge import merge_gate
from pallas_kernels.paged_attention.pallas import padded_query_rows, paged_attention_partials
from pallas_kernels.paged_attention.prep import qk_norm_rope_write


class GatedAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                            cfg.num_key_value_heads, d)
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling  # static (frozen): one RoPE for every path
        self.backend = kernels_of(cfg).attention
        self.q_proj = Linear(h, 2 * self.num_heads * d, dtype)
        self.k_proj = Linear(h, self.num_kv_heads * d, dtype)
        self.v_proj = Linear(h, self.num_kv_heads * d, dtype)
        self.o_proj = Linear(self.num_heads * d, h, dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.qkv_proj = None  # MergedLinear of (q, k, v) after merge_projections()

    def merge_projections(self) -> None:
        """Merge ``q_proj, k_proj, v_proj`` into one ``qkv_proj``
        (:class:`mtp_jax.models.layers.basic.MergedLinear`; the three are removed)."""
        if self.qkv_proj is None and mergeable([self.q_proj, self.k_proj, self.v_proj]):
            self.qkv_proj = as_data(merge_linears([self.q_proj, self.k_proj, self.v_proj]))
            self.q_proj = self.k_proj = self.v_proj = None

    def __call__(self, x: jax.Array, batch: AttentionBatch, kv: tuple[jax.Array, jax.Array]):
        """``x [B, T, H]``; ``kv`` = this layer's ``(k_pages, v_pages)``.

        Writes the rows' K/V at their positions, then attends causally over the pages.
        Returns ``(out [B, T, H], (k_pages, v_pages))``.
        """
        if self._fused_prep(x.shape[1]):
            return self._call_fused(x, batch, kv)
        q, gate, k, v = self.project(x, batch.positions)
        k_pages, v_pages = write_kv(kv[0], k, batch), write_kv(kv[1], v, batch)
        o = paged_attention(q, k_pages, v_pages, batch.page_table, batch.positions,
                            scale=self.head_dim ** -0.5, backend=self.backend)
        return self.gated_output(o, gate), (k_pages, v_pages)

    def _fused_prep(self, t: int) -> bool:
        """Whether ``T = t`` rows take the Pallas path from the merged projection on: q/k
        norms, RoPE and the pool writes in one kernel
        (:func:`pallas_kernels.paged_attention.prep.qk_norm_rope_write`), then the attention
        kernel on its query rows, then the split merge and the output gate in one kernel
        (:func:`pallas_kernels.paged_attention.merge.merge_gate`). Needs the ``pallas``
        backend, merged projections, a call the attention kernel takes (decode, verify, the
        16-row prefill bucket), a power-of-two ``rotary_dim`` and one epsilon for both norms
        (as every released config has)."""
        r = self.rotary_dim
        return (self.backend == "pallas" and self.qkv_proj is not None and r >= 2
                and r & (r - 1) == 0 and self.q_norm.eps == self.k_norm.eps
                and uses_kernel(t, self.num_heads, self.num_kv_heads))

    def _call_fused(self, x: jax.Array, batch: AttentionBatch, kv):
        b, t, _ = x.shape
        d, hq = self.head_dim, self.num_heads
        y = self.qkv_proj.stacked(x)
        interpret = interpret_mode(None)
        q_rows, k_pages, v_pages = qk_norm_rope_write(
            y, self.q_norm.weight[...], self.k_norm.weight[...], batch.positions, batch.valid,
            batch.page_table, kv[0], kv[1], num_heads=hq, rotary_dim=self.rotary_dim,
            rope_theta=self.rope_theta, eps=self.q_norm.eps,
            inv_freq=rope_inv_freq(self.rotary_dim, self.rope_theta, self.rope_scaling),
            attention_factor=self.rope_scaling.attention_factor,
            rows=padded_query_rows(t, hq // self.num_kv_heads), interpret=interpret)
        o, m, l = paged_attention_partials(q_rows, k_pages, v_pages, batch.page_table,
                                           batch.positions, num_q_heads=hq, scale=d ** -0.5,
                                           interpret=interpret)
        gated = merge_gate(o, m, l, y, t=t, num_q_heads=hq, interpret=interpret)
        return self.o_proj(gated), (k_pages, v_pages)

    def project(self, x: jax.Array, positions: jax.Array):
        """``x [B, T, H]``, ``positions [B, T]`` -> roped ``q [B, T, Hq, D]``, the output
        ``gate [B, T, Hq, D]``, roped ``k`` and ``v [B, T, Hkv, D]``."""
        b, t, _ = x.shape
        d = self.head_dim
        qg, k, v = project(x, self.qkv_proj, (self.q_proj, self.k_proj, self.v_proj))
        qg = qg.reshape(b, t, self.num_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:]
        q = apply_rotary(self.q_norm(q), positions, self.rotary_dim, self.rope_theta,
                         self.rope_scaling)
        k = self.k_norm(k.reshape(b, t, self.num_kv_heads, d))
        k = apply_rotary(k, positions, self.rotary_dim, self.rope_theta, self.rope_scaling)
        v = v.reshape(b, t, self.num_kv_heads, d)
        return q, gate, k, v

    def gated_output(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """``o_proj(o * sigmoid(gate))`` for ``o, gate [B, T, Hq, D]`` -> ``[B, T, H]``."""
        b, t = o.shape[:2]
        o = o.reshape(b, t, -1) * jax.nn.sigmoid(
            gate.reshape(b, t, -1).astype(jnp.float32)).astype(o.dtype)
        return self.o_proj(o)
