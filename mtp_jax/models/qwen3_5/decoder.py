"""The Qwen3.5-family decoder layer: a token mixer (gated attention or Gated DeltaNet) and an MLP
(dense or sparse MoE), each after an RMSNorm, with residual adds. Shared by the target model
(:mod:`mtp_jax.models.qwen3_5.model`) and the MTP draft (:mod:`mtp_jax.models.qwen3_5.mtp`)."""

from __future__ import annotations

import math

import jax
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.config import ModelConfig
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.attention import GatedAttention
from mtp_jax.models.layers.basic import RMSNorm
from mtp_jax.models.layers.gdn import GatedDeltaNet
from mtp_jax.models.layers.mlp import MLP, SparseMoE
from pallas_kernels.gemv.norm_gemv import norm_gemv, supports

__all__ = ["DecoderLayer"]


class DecoderLayer(nnx.Module):
    """``h = x + mixer(input_layernorm(x)); y = h + mlp(post_attention_layernorm(h))``.

    :meth:`forward` leaves the last add to the next layer (or the final norm), so that each
    residual add runs with the norm after it (one kernel with the ``pallas`` norm backend).
    """

    def __init__(self, cfg: ModelConfig, layer_type: str, dtype, cache_index: int):
        h = cfg.hidden_size
        norm = kernels_of(cfg).norm
        self.layer_type = layer_type
        self.cache_index = cache_index  # index into the KV tuple or the GDN tuple
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, backend=norm)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype, backend=norm)
        if layer_type == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        self.mlp = (SparseMoE(cfg, dtype, backend=kernels_of(cfg).moe) if cfg.is_moe
                    else MLP(h, cfg.intermediate_size, dtype))

    def merge_projections(self) -> None:
        """Merge the projections that read one input (the mixer's in-projections, the MLP's
        gate/up, or the MoE block's router, shared gate and shared gate/up) into one matrix
        each; see :class:`mtp_jax.models.layers.basic.MergedLinear`."""
        (self.self_attn if self.layer_type == "full_attention" else
         self.linear_attn).merge_projections()
        self.mlp.merge_projections()

    def mix(self, hn, batch: AttentionBatch, kv, gdn, gdn_mode: str, slots=None,
            state_rows=None):
        """Run the token mixer on ``hn`` (the input after ``input_layernorm``). ``kv``: this
        layer's ``(k_pages, v_pages)`` (attention layers); ``gdn``: its ``(recurrent, conv)``
        batch view, or its pools with ``slots`` (GDN layers). Returns ``(out, new kv or None,
        new gdn state or verify rows or None)``; a GDN prefill with ``state_rows [B, S]``
        int32 returns ``(new state, states after those rows)`` as its state
        (:meth:`GatedDeltaNet.prefill` ``at``)."""
        if self.layer_type == "full_attention":
            out, kv = self.self_attn(hn, batch, kv)
            return out, kv, None
        start = batch.positions[:, 0]  # the conv ring's position of row 0
        if gdn_mode == "prefill" and state_rows is not None:
            out, *gdn = self.linear_attn.prefill(hn, gdn, batch.valid, start, at=state_rows)
        elif gdn_mode == "prefill":
            out, gdn = self.linear_attn.prefill(hn, gdn, batch.valid, start)
        elif gdn_mode == "decode":
            out, gdn = self.linear_attn.decode(hn, gdn, batch.valid, slots, start)
        else:
            out, gdn = self.linear_attn.verify(hn, gdn, batch.valid, slots, start)
        return out, None, gdn

    def __call__(self, x, batch, kv=None, gdn=None, gdn_mode="prefill", slots=None):
        """``x [B, T, H]`` -> ``(y [B, T, H], new kv, new gdn)``; see :meth:`mix`."""
        h, delta, kv, gdn = self.forward(x, None, batch, kv, gdn, gdn_mode, slots)
        return h + delta, kv, gdn

    def forward(self, x, delta, batch, kv=None, gdn=None, gdn_mode="prefill", slots=None,
                state_rows=None):
        """The layer on the residual stream ``x + delta`` (``delta``: the previous layer's MLP
        output, not yet added, or ``None``). Returns ``(h, mlp_out, new kv, new gdn)``; the
        layer's output is ``h + mlp_out``, left for the next :meth:`RMSNorm.add_norm`.
        ``state_rows``: see :meth:`mix`."""
        x, hn = self.input_layernorm.add_norm(x, delta)
        out, kv, gdn = self.mix(hn, batch, kv, gdn, gdn_mode, slots, state_rows)
        if self._fuses_mlp(x):
            norm, mlp = self.post_attention_layernorm, self.mlp
            h, act = norm_gemv(x, out, norm.weight[...], mlp.gate_up_proj.weight[...],
                               norm.eps, act="silu_mul")
            return h, mlp.down_proj(act), kv, gdn
        h, hn = self.post_attention_layernorm.add_norm(x, out)
        return h, self.mlp(hn), kv, gdn

    def _fuses_mlp(self, x: jax.Array) -> bool:
        """Whether the residual add, ``post_attention_layernorm``, the gate/up projection and
        SwiGLU run as one kernel (:func:`pallas_kernels.gemv.norm_gemv.norm_gemv`): one row,
        a dense MLP with merged gate/up in the model dtype whose backend is ``"fused"``, of a
        shape the kernel takes (:func:`pallas_kernels.gemv.norm_gemv.supports`)."""
        gate_up = getattr(self.mlp, "gate_up_proj", None)
        return (gate_up is not None and gate_up.backend == "fused" and gate_up.scale is None
                and math.prod(x.shape[:-1]) == 1
                and supports(gate_up.weight.shape, "silu_mul"))
