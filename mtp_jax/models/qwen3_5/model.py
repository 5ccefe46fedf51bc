"""The Qwen3.5-family target model as Flax (nnx) modules.

Parameter paths equal the canonical tensor names of :mod:`mtp_jax.weights.names`
(``layers.3.self_attn.q_proj.weight`` ...), so a checkpoint fills the model name for name.

The model is pure over explicit state: a forward takes the paged KV of its attention layers and
the batch view of its GDN states and returns their new values; nothing is stored on the module.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.linear_state import LinearState
from mtp_jax.cache.paged import AttentionBatch, PagedKV
from mtp_jax.config import ModelConfig
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.attention import GatedAttention
from mtp_jax.models.layers.basic import Embed, Linear, RMSNorm
from mtp_jax.models.layers.gdn import GatedDeltaNet
from mtp_jax.models.layers.mlp import MLP, SparseMoE
from pallas_kernels.gemv.norm_gemv import norm_gemv, supports


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

    def mix(self, hn, batch: AttentionBatch, kv, gdn, gdn_mode: str, slots=None):
        """Run the token mixer on ``hn`` (the input after ``input_layernorm``). ``kv``: this
        layer's ``(k_pages, v_pages)`` (attention layers); ``gdn``: its ``(recurrent, conv)``
        batch view, or its pools with ``slots`` (GDN layers). Returns ``(out, new kv or None,
        new gdn state or verify rows or None)``."""
        if self.layer_type == "full_attention":
            out, kv = self.self_attn(hn, batch, kv)
            return out, kv, None
        start = batch.positions[:, 0]  # the conv ring's position of row 0
        if gdn_mode == "prefill":
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

    def forward(self, x, delta, batch, kv=None, gdn=None, gdn_mode="prefill", slots=None):
        """The layer on the residual stream ``x + delta`` (``delta``: the previous layer's MLP
        output, not yet added, or ``None``). Returns ``(h, mlp_out, new kv, new gdn)``; the
        layer's output is ``h + mlp_out``, left for the next :meth:`RMSNorm.add_norm`."""
        x, hn = self.input_layernorm.add_norm(x, delta)
        out, kv, gdn = self.mix(hn, batch, kv, gdn, gdn_mode, slots)
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


class Qwen35Model(nnx.Module):
    """Embedding, decoder layers, final norm, LM head and (optionally) the ``mtp`` draft."""

    # The ``gdn_mode`` values of :meth:`__call__` (a capability read by the round program:
    # ``"decode"`` lets a plain decode round skip :meth:`commit`).
    gdn_modes = ("prefill", "verify", "decode")

    def __init__(self, cfg: ModelConfig, dtype, with_mtp: bool = False):
        from mtp_jax.models.qwen3_5.mtp import MTPDraft

        self.cfg = cfg
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype)
        layers, n_attn, n_gdn = [], 0, 0
        for t in cfg.layer_types:
            idx = n_attn if t == "full_attention" else n_gdn
            layers.append(DecoderLayer(cfg, t, dtype, idx))
            n_attn += t == "full_attention"
            n_gdn += t != "full_attention"
        self.layers = nnx.List(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                            backend=kernels_of(cfg).norm)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size,
                                                                    cfg.vocab_size, dtype)
        self.mtp = MTPDraft(cfg, dtype) if with_mtp else None
        # The draft's own LM head (hot token ids and/or int8 rows), set after load by
        # mtp_jax.models.draft_head.with_draft_head; None: the draft uses the target's head.
        self.draft_head = None

    def merge_projections(self) -> None:
        """Merge, in every decoder layer (and the MTP draft's), the projections that read one
        input into one matrix each (:meth:`DecoderLayer.merge_projections`). ``load_model``
        does this after loading: parameters then live under the merged names
        (``linear_attn.in_proj``, ``self_attn.qkv_proj``, ``mlp.gate_up_proj``,
        ``mlp.in_proj``). Idempotent."""
        layers = list(self.layers) + (list(self.mtp.layers) if self.mtp is not None else [])
        for layer in layers:
            layer.merge_projections()

    def logits(self, hidden: jax.Array) -> jax.Array:
        """``hidden [..., H]`` (after the final norm) -> ``logits [..., V]`` float32."""
        if self.lm_head is None:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def draft_logits(self, z: jax.Array):
        """The MTP draft's logits: ``z [..., H]`` (after ``mtp.norm``) -> ``(logits [..., N]
        float32, ids [N] int32)`` over the hot token ids of :attr:`draft_head`, or
        ``(logits [..., V], None)`` over the whole vocabulary (column i is token id i): the
        target's head without a draft head, else the draft head's (int8 rows,
        :mod:`mtp_jax.models.draft_head`)."""
        head = self.draft_head
        if head is None:
            return self.logits(z), None
        return head(z, self._head_table()), None if head.ids is None else head.ids[...]

    def draft_greedy(self, z: jax.Array) -> jax.Array:
        """The MTP draft's greedy tokens: ``z [..., H]`` -> ``[...]`` int32 token ids, the
        argmax of :meth:`draft_logits` mapped to token ids (an int8 draft head takes it over
        its re-scored candidates only: :meth:`~mtp_jax.models.draft_head.DraftHead.greedy`)."""
        head = self.draft_head
        if head is not None and head.scale is not None:
            return head.greedy(z, self._head_table())
        logits, hot = self.draft_logits(z)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return tok if hot is None else jnp.take(hot, tok)

    def _head_table(self) -> jax.Array:
        """The LM head's ``[V, H]`` rows (the embedding when tied)."""
        return (self.lm_head if self.lm_head is not None else self.embed_tokens).weight[...]

    def __call__(self, input_ids: jax.Array, batch: AttentionBatch, kv: PagedKV,
                 gdn: LinearState, gdn_mode: str = "prefill", slots: jax.Array | None = None):
        """Target forward.

        Args:
          input_ids: ``[B, T]`` int32.
          batch: row positions / validity / page tables.
          kv: the target's paged KV (all attention layers).
          gdn: GDN state batch view ``[B, ...]`` per layer, or (with ``slots``) the pools.
          gdn_mode: ``"prefill"`` (chunked form, returns the new states), ``"verify"``
            (step form, states untouched, returns per GDN layer the rows :meth:`commit` takes:
            ``GDNRows``, or ``GDNConvRows`` on the fused Pallas path)
            or ``"decode"`` (``T = 1``: step form, returns the new states, equal to a verify
            plus a commit of the valid rows).
          slots: ``[B]`` int32 (``"verify"``, ``"decode"``): ``gdn`` is the state pool and row b
            reads (and a decode writes) slot ``slots[b]`` in place; the returned state is then
            the new pool. ``None``: ``gdn`` is a batch view.
        Returns:
          ``(hidden [B, T, H] after the final norm, new kv, new LinearState | tuple of verify
          rows)``.
        Raises:
          ValueError: an unknown ``gdn_mode``, ``"decode"`` with ``T != 1``, or ``slots`` with
            ``"prefill"``.
        """
        if gdn_mode not in self.gdn_modes:
            raise ValueError(f"gdn_mode {gdn_mode!r} is unknown; use one of {self.gdn_modes}.")
        if slots is not None and gdn_mode == "prefill":
            raise ValueError("slots: prefill takes a batch view of the GDN states (gather them "
                             "first); slots are for 'verify' and 'decode'.")
        writes_state = gdn_mode != "verify"
        x, delta = self.embed_tokens(input_ids), None
        ks, vs = list(kv.k), list(kv.v)
        rec, conv = list(gdn.recurrent), list(gdn.conv)
        rows: list = [None] * len(rec)  # GDNRows, or GDNConvRows (fused Pallas path)
        # One zeroed scratch for every GDN layer's one-kernel decode or verify with the output
        # norm folded in (GatedDeltaNet.decode / verify), which leave it zero.
        sync = (jnp.zeros((input_ids.shape[0], self.cfg.linear_num_value_heads), jnp.int32)
                if gdn_mode != "prefill" and kernels_of(self.cfg).gdn == "pallas" else None)
        for layer in self.layers:
            i = layer.cache_index
            if layer.layer_type == "full_attention":
                x, delta, (ks[i], vs[i]), _ = layer.forward(x, delta, batch, kv=(ks[i], vs[i]))
                continue
            state = (rec[i], conv[i]) if sync is None else (rec[i], conv[i], sync)
            x, delta, _, out = layer.forward(x, delta, batch, gdn=state, gdn_mode=gdn_mode,
                                             slots=slots)
            if not writes_state:
                rows[i], sync = (out, None) if sync is None else out
            elif sync is None:
                rec[i], conv[i] = out
            else:
                rec[i], conv[i], sync = out
        new_kv = PagedKV(tuple(ks), tuple(vs))
        new_gdn = LinearState(tuple(rec), tuple(conv)) if writes_state else tuple(rows)
        return self.norm.add_norm(x, delta)[1], new_kv, new_gdn

    def commit(self, gdn: LinearState, rows: tuple, length: jax.Array,
               slots: jax.Array | None = None) -> LinearState:
        """Apply the first ``length [B]`` verify rows of every GDN layer to the batch view, or
        (with ``slots [B]``) to the pools at those slots in place."""
        mixers = [layer.linear_attn for layer in self.layers
                  if layer.layer_type != "full_attention"]
        out = [m.commit((r, c), w, length, slots)
               for m, r, c, w in zip(mixers, gdn.recurrent, gdn.conv, rows)]
        return LinearState(tuple(o[0] for o in out), tuple(o[1] for o in out))
