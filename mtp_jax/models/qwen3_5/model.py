"""The Qwen3.5-family target model as Flax (nnx) modules.

Parameter paths equal the canonical tensor names of :mod:`mtp_jax.weights.names`
(``layers.3.self_attn.q_proj.weight`` ...), so a checkpoint fills the model name for name.

The model is pure over explicit state: a forward takes the paged KV of its attention layers and
the batch view of its GDN states and returns their new values; nothing is stored on the module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.linear_state import LinearState
from mtp_jax.cache.paged import AttentionBatch, PagedKV
from mtp_jax.config import ModelConfig
from mtp_jax.kernels import kernels_of
from mtp_jax.models.draft_head import head_greedy, head_logits
from mtp_jax.models.layers.basic import Embed, Linear, RMSNorm
from mtp_jax.models.qwen3_5.decoder import DecoderLayer
from mtp_jax.models.qwen3_5.mtp import MTPDraft


class Qwen35Model(nnx.Module):
    """Embedding, decoder layers, final norm, LM head and (optionally) the ``mtp`` draft."""

    # The ``gdn_mode`` values of :meth:`__call__` (a capability read by the round program:
    # ``"decode"`` lets a plain decode round skip :meth:`commit`).
    gdn_modes = ("prefill", "verify", "decode")

    def __init__(self, cfg: ModelConfig, dtype, with_mtp: bool = False):
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
        return head_logits(self.draft_head, self._head_table(), z, self.logits)

    def draft_greedy(self, z: jax.Array) -> jax.Array:
        """The MTP draft's greedy tokens: ``z [..., H]`` -> ``[...]`` int32 token ids, the
        argmax of :meth:`draft_logits` mapped to token ids (an int8 draft head takes it over
        its re-scored candidates only: :meth:`~mtp_jax.models.draft_head.DraftHead.greedy`)."""
        return head_greedy(self.draft_head, self._head_table(), z, self.logits)

    def _head_table(self) -> jax.Array:
        """The LM head's ``[V, H]`` rows (the embedding when tied)."""
        return (self.lm_head if self.lm_head is not None else self.embed_tokens).weight[...]

    def __call__(self, input_ids: jax.Array, batch: AttentionBatch, kv: PagedKV,
                 gdn: LinearState, gdn_mode: str = "prefill", slots: jax.Array | None = None,
                 state_rows: jax.Array | None = None):
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
          state_rows: ``[B, S]`` int32 row counts (``0..T``; ``"prefill"`` only): also return
            the GDN states after the first ``state_rows[b, s]`` rows of each request (the
            prefix-cache snapshots at boundaries inside a prefill chunk).
        Returns:
          ``(hidden [B, T, H] after the final norm, new kv, new LinearState | tuple of verify
          rows)``, plus with ``state_rows`` a ``LinearState`` of ``[B, S, ...]`` leaves.
        Raises:
          ValueError: an unknown ``gdn_mode``, ``"decode"`` with ``T != 1``, or ``slots`` or
            ``state_rows`` with a mode they do not go with.
        """
        if gdn_mode not in self.gdn_modes:
            raise ValueError(f"gdn_mode {gdn_mode!r} is unknown; use one of {self.gdn_modes}.")
        if slots is not None and gdn_mode == "prefill":
            raise ValueError("slots: prefill takes a batch view of the GDN states (gather them "
                             "first); slots are for 'verify' and 'decode'.")
        if state_rows is not None and gdn_mode != "prefill":
            raise ValueError(f"state_rows: states after given rows come from 'prefill' only "
                             f"(got gdn_mode {gdn_mode!r}).")
        writes_state = gdn_mode != "verify"
        x, delta = self.embed_tokens(input_ids), None
        ks, vs = list(kv.k), list(kv.v)
        rec, conv = list(gdn.recurrent), list(gdn.conv)
        rows: list = [None] * len(rec)  # GDNRows, or GDNConvRows (fused Pallas path)
        rec_at, conv_at = list(rec), list(conv)  # states after state_rows (prefill)
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
                                             slots=slots, state_rows=state_rows)
            if state_rows is not None:
                (rec[i], conv[i]), (rec_at[i], conv_at[i]) = out
            elif not writes_state:
                rows[i], sync = (out, None) if sync is None else out
            elif sync is None:
                rec[i], conv[i] = out
            else:
                rec[i], conv[i], sync = out
        new_kv = PagedKV(tuple(ks), tuple(vs))
        new_gdn = LinearState(tuple(rec), tuple(conv)) if writes_state else tuple(rows)
        hidden = self.norm.add_norm(x, delta)[1]
        if state_rows is not None:
            return hidden, new_kv, new_gdn, LinearState(tuple(rec_at), tuple(conv_at))
        return hidden, new_kv, new_gdn

    def commit(self, gdn: LinearState, rows: tuple, length: jax.Array,
               slots: jax.Array | None = None) -> LinearState:
        """Apply the first ``length [B]`` verify rows of every GDN layer to the batch view, or
        (with ``slots [B]``) to the pools at those slots in place."""
        mixers = [layer.linear_attn for layer in self.layers
                  if layer.layer_type != "full_attention"]
        out = [m.commit((r, c), w, length, slots)
               for m, r, c, w in zip(mixers, gdn.recurrent, gdn.conv, rows)]
        return LinearState(tuple(o[0] for o in out), tuple(o[1] for o in out))
