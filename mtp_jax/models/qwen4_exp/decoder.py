"""The qwen4_exp decoder layer: PLE (on PLE layers), a token mixer (QSA attention or a Gated
DeltaNet with a configurable output gate) and a sparse MoE, each around hyper-connections.
Shared by the target model (:mod:`mtp_jax.models.qwen4_exp.model`) and the MTP draft
(:mod:`mtp_jax.models.qwen4_exp.mtp`)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.gdn import GatedDeltaNet
from mtp_jax.models.layers.mlp import SparseMoE
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.hyper_connection import GatedResidual, inject
from mtp_jax.models.qwen4_exp.ple import PLE
from mtp_jax.models.qwen4_exp.qsa import QSAAttention
from mtp_jax.models.qwen4_exp.slot_states import by_name

__all__ = ["STEP_FORM_ROWS", "GatedDeltaNetGate", "DecoderLayer"]


STEP_FORM_ROWS = 8  # calls of at most this many rows use the GDN step form (decode)


class GatedDeltaNetGate(GatedDeltaNet):
    """Gated DeltaNet with a configurable output gate: ``norm(o) * w * act(z)``, act = sigmoid
    (Qwen3.8-Flash-Next) or silu."""

    def __init__(self, cfg, dtype):
        super().__init__(cfg, dtype)
        self.output_gate = cfg.output_gate_type  # read by GatedDeltaNet._output_gate

    def decode(self, x, state, valid, slots=None, start=None):
        """Step form over ``x [B, T, H]``: a verify of the rows (the decode recurrence row by
        row) committed in full through the ``gdn_recurrent`` slot-state hooks, instead of the
        chunked prefill form, which pads every call to a 64-row chunk. With the ``pallas``
        backend the fused kernels' decode mode (conv window, then gates and recurrence, the
        ``valid`` rows applied: two kernels). Same arguments and results as :meth:`prefill`
        (a batch view of the states: ``slots`` must be None; the shift-register conv state
        needs no ``start``). Raises ValueError with ``slots``."""
        if slots is not None:
            raise ValueError("GatedDeltaNetGate.decode takes a batch view of the states; "
                             "gather the slots first (slots=None).")
        if self.backend == "pallas":
            state = tuple(state[:2])
            start = self._start(state[1], start, x.shape[0])
            rows = jnp.arange(x.shape[0], dtype=jnp.int32)  # batch view: row b is state b
            out, new, _ = self._decode_fused(x, state, valid, rows, start, None)
            return out, new
        out, rows = self.verify(x, state, valid, start=start)
        accepted = jnp.sum(valid, axis=1).astype(jnp.int32)
        return out, by_name("gdn_recurrent").commit(state, rows, None, accepted)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen4ExpConfig, layer_type: str, dtype, cache_index: int,
                 ple_index: int | None = None, rope_theta: float | None = None):
        self.layer_type, self.cache_index, self.ple_index = layer_type, cache_index, ple_index
        mk = lambda inj=True: GatedResidual(cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank,
                                            cfg.rms_norm_eps, dtype, inject=inj,
                                            backend=kernels_of(cfg).norm)
        self.attn_hyper_connection = mk()
        self.mlp_hyper_connection = mk()
        if layer_type == "full_attention":
            self.self_attn = QSAAttention(cfg, dtype, rope_theta)
        else:
            self.linear_attn = GatedDeltaNetGate(cfg, dtype)
        self.mlp = SparseMoE(cfg, dtype, backend=kernels_of(cfg).moe)
        self.ple = PLE(cfg, dtype) if ple_index is not None else None

    def merge_projections(self) -> None:
        """Merge the projections that read one input into one matrix each: the mixer's
        in-projections (GDN ``in_proj_qkv/z/b/a``, QSA ``q/k/v_proj``), the MoE block's router,
        shared gate and shared gate/up, and each hyper-connection's down and inject
        projections (:meth:`GatedResidual.merge_projections`). Idempotent."""
        (self.self_attn if self.layer_type == "full_attention" else
         self.linear_attn).merge_projections()
        self.mlp.merge_projections()
        self.attn_hyper_connection.merge_projections()
        self.mlp_hyper_connection.merge_projections()

    def __call__(self, h, batch: AttentionBatch, *, qsa=None, gdn=None, ple_emb=None,
                 ple_conv=None, verify: bool = False):
        """``qsa = (k_pages, v_pages, idx_pages, open_group or None)`` for a QSA layer, ``gdn =
        (recurrent, conv)`` (a batch view) for a GDN layer. Returns ``(h, qsa, gdn, ple_conv)``
        (the states this layer does not own pass through as given). ``verify``: the slot states
        are not advanced; in their place come what their commit takes (the QSA ring, the GDN
        verify rows, the PLE conv inputs; :mod:`~mtp_jax.models.qwen4_exp.slot_states`)."""
        if self.ple is not None:
            p, ple_conv = self.ple(h, ple_emb, ple_conv, batch.valid, verify=verify)
            h = h + p
        x, inj = self.attn_hyper_connection(h)
        if self.layer_type == "full_attention":
            k, v, idx, group = qsa
            y, (k, v), idx, group = self.self_attn(x, batch, (k, v), idx, group, verify=verify)
            qsa = (k, v, idx, group)
        elif verify:
            y, gdn = self.linear_attn.verify(x, gdn, batch.valid)
        else:
            gdn_form = (self.linear_attn.decode if x.shape[1] <= STEP_FORM_ROWS
                        else self.linear_attn.prefill)
            y, gdn = gdn_form(x, gdn, batch.valid)
        h, x, inj = self.mlp_hyper_connection.mix(h, (inj, y))  # h + inj * y first
        h = inject(h, inj, self.mlp(x))
        return h, qsa, gdn, ple_conv
