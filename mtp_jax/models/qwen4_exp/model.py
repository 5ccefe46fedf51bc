"""The qwen4_exp target model (Flax nnx), pure over explicit state.

Parameter paths equal the canonical names of :mod:`mtp_jax.models.qwen4_exp.names` (the device
n-gram tables of ``ple_backend="device"``, ``ple_device.tables.*``, are not parameters). A forward
takes the token ids, the looked-up PLE n-gram rows (or looks them up itself: on the device,
or by a host callback), the paged QSA states and the slot states
(:mod:`mtp_jax.models.qwen4_exp.pools`), and returns the pre-mixer residual streams
``[B, T, hc*H]`` (the hidden states of this family; the MTP head reads them) with the new states,
or in verify mode what the commit of the accepted rows takes. ``logits(streams)`` applies ``hyper_connection_mixer`` and
``lm_head``. Decoder layer::

    h = h + PLE(h)                          (PLE layers only)
    x, inj = attn_hyper_connection(h);  h = h + inj * (GDN or QSA)(x)
    x, inj = mlp_hyper_connection(h);   h = h + inj * MoE(x)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.linear_state import LinearState
from mtp_jax.cache.paged import AttentionBatch, PagedKV
from mtp_jax.kernels import kernels_of
from mtp_jax.models.draft_head import head_greedy, head_logits
from mtp_jax.models.layers.gdn import GDNConvRows
from mtp_jax.models.layers.basic import Embed, Linear
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.decoder import DecoderLayer
from mtp_jax.models.qwen4_exp.hyper_connection import GatedResidual
from mtp_jax.models.qwen4_exp.mtp import MTPDraft
from mtp_jax.models.qwen4_exp.ple_callback import rows_on_host
from mtp_jax.models.qwen4_exp.pools import QSAPaged, Qwen4Slots
from mtp_jax.models.qwen4_exp.slot_states import by_name, context_at, token_register_commit


class Qwen4ExpModel(nnx.Module):
    def __init__(self, cfg: Qwen4ExpConfig, dtype, with_mtp: bool = False,
                 ple_source: int | None = None):
        self.cfg = cfg
        # The host lookup of PLE rows when a call is not given them (the engine's rounds:
        # mtp_jax.models.qwen4_exp.ple_callback); None: every call must pass host_rows, unless
        # the tables are on the device.
        self.ple_source = ple_source
        # The n-gram tables on the device and their lookup (ple_backend="device":
        # mtp_jax.models.qwen4_exp.ple_device.PLEDevice), attached by the loader after the
        # weights; None: the rows come from the host.
        self.ple_device = None
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype)
        layers, n_attn, n_gdn = [], 0, 0
        for i, t in enumerate(cfg.layer_types):
            idx = n_attn if t == "full_attention" else n_gdn
            ple = cfg.ple_layers.index(i) if i in cfg.ple_layers else None
            layers.append(DecoderLayer(cfg, t, dtype, idx, ple))
            n_attn += t == "full_attention"
            n_gdn += t != "full_attention"
        self.layers = nnx.List(layers)
        self.hyper_connection_mixer = GatedResidual(cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank,
                                                    cfg.rms_norm_eps, dtype, inject=False,
                                                    backend=kernels_of(cfg).norm)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size,
                                                                    cfg.vocab_size, dtype)
        self.mtp = MTPDraft(cfg, dtype) if with_mtp else None
        # The draft's own LM head (reduced vocabulary / int8 rows), set by
        # mtp_jax.models.draft_head.with_draft_head; None: the draft uses the target's head.
        self.draft_head = None

    def merge_projections(self) -> None:
        """Merge, in every decoder layer and the MTP draft's, the projections that read one
        input (:meth:`DecoderLayer.merge_projections`); the loader does this unless asked
        not to (``merge_projections=False``: one parameter per checkpoint tensor)."""
        layers = list(self.layers) + (list(self.mtp.layers) if self.mtp is not None else [])
        for layer in layers:
            layer.merge_projections()

    def head(self, x: jax.Array) -> jax.Array:
        """``x [..., H]`` (mixed) -> logits float32."""
        if self.lm_head is None:
            return self.embed_tokens.attend(x).astype(jnp.float32)
        return self.lm_head(x).astype(jnp.float32)

    def logits(self, streams: jax.Array) -> jax.Array:
        """Pre-mixer streams ``[..., hc*H]`` -> logits ``[..., V]`` float32."""
        x, _ = self.hyper_connection_mixer(streams)
        return self.head(x)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """``input_ids [B, T]`` -> the initial residual streams ``[B, T, hc*H]`` (the embedding
        repeated on every stream)."""
        return jnp.tile(self.embed_tokens(input_ids), (1, 1, self.cfg.hc_count))

    # "decode": a plain (k = 0) round advances every slot state by its one row as a prefill
    # does (the GDN step form, the fused decode kernel on a GPU), so no commit runs
    gdn_modes = ("prefill", "verify", "decode")

    def draft_logits(self, y: jax.Array):
        """MTP streams ``y [..., hc*H]`` -> the draft's own mixer, then ``(logits [..., N]
        float32, hot ids [N] int32)`` over its own head (a reduced vocabulary and/or int8
        rows: :mod:`mtp_jax.models.draft_head`), or ``(logits [..., V], None)`` from the
        target's LM head."""
        z, _ = self.mtp.hyper_connection_mixer(y)
        return head_logits(self.draft_head, self._head_table(), z, self.head)

    def draft_greedy(self, y: jax.Array) -> jax.Array:
        """``y [..., hc*H]`` -> the draft's greedy token ids ``[...]`` int32
        (:func:`~mtp_jax.models.draft_head.head_greedy`)."""
        z, _ = self.mtp.hyper_connection_mixer(y)
        return head_greedy(self.draft_head, self._head_table(), z, self.head)

    def _head_table(self) -> jax.Array:
        """The LM head's ``[V, H]`` rows (the embedding when tied)."""
        return (self.lm_head if self.lm_head is not None else self.embed_tokens).weight[...]

    def __call__(self, input_ids, batch: AttentionBatch, paged: QSAPaged, state: Qwen4Slots,
                 gdn_mode: str = "prefill", slots: jax.Array | None = None, host_rows=None):
        """Target forward (the engine's model protocol, :class:`~mtp_jax.models.entry.ModelEntry`).

        Args:
          input_ids: ``[B, T]`` int32.
          batch: row positions / validity / page tables.
          paged: the target's :class:`~mtp_jax.models.qwen4_exp.pools.QSAPaged` (K/V and raw
            index keys of every QSA layer).
          state: the :class:`~mtp_jax.models.qwen4_exp.pools.Qwen4Slots` batch view, or (with
            ``slots [B]``) the pool, gathered here.
          gdn_mode: ``"prefill"`` (the slot states advance by the valid rows; returns the new
            batch view), ``"decode"`` (the same, and with ``slots`` returns the pool with
            those slots' states replaced: a plain round's rows, equal to verify + commit of
            them) or ``"verify"`` (they do not advance; returns what :meth:`commit` takes).
          host_rows: ``[B, T, n_ple * ple_embed_dim]`` float, the looked-up PLE n-gram rows of
            every PLE layer, concatenated (:meth:`LoadedQwen4Exp.host_rows`); None: looked up
            from the slots' n-gram context, inside the program from the device tables
            (:attr:`ple_device`) when the model holds them, else on the host by a callback
            (:mod:`~mtp_jax.models.qwen4_exp.ple_callback`).
        Returns:
          ``(streams [B, T, hc*H] before the final mixer, new paged, new view | verify rows)``.
        Raises:
          ValueError: an unknown ``gdn_mode``; no ``host_rows`` for a model with PLE layers
            and neither device tables nor a ``ple_source``.
        """
        if gdn_mode not in self.gdn_modes:
            raise ValueError(f"gdn_mode {gdn_mode!r} is unknown; use one of {self.gdn_modes}.")
        verify = gdn_mode == "verify"
        view = state if slots is None else state.gather(slots)
        d = self.cfg.ple_embed_dim
        ctx = context_at(view.ngram_ctx, batch.positions[:, 0], self.context_eos)
        if host_rows is None and self.cfg.ple_layers and self.ple_device is not None:
            host_rows = self.ple_device(ctx, input_ids)
        elif host_rows is None and self.cfg.ple_layers:
            if self.ple_source is None:
                raise ValueError("this qwen4_exp model has no PLE source; pass host_rows "
                                 "(LoadedQwen4Exp.host_rows) to its calls.")
            host_rows = rows_on_host(self.ple_source, ctx, input_ids,
                                     len(self.cfg.ple_layers) * d)
        ple = () if host_rows is None else tuple(
            host_rows[..., j * d:(j + 1) * d] for j in range(len(self.cfg.ple_layers)))
        h = self.embed(input_ids)
        ks, vs, ix = list(paged.kv.k), list(paged.kv.v), list(paged.idx)
        op, pc = list(view.open_idx), list(view.ple_conv)
        rec, conv = list(view.gdn.recurrent), list(view.gdn.conv)
        gdn_out = [None] * len(rec)
        for layer in self.layers:
            j = layer.ple_index
            pe, pcs = (ple[j], pc[j]) if j is not None else (None, None)
            i = layer.cache_index
            if layer.layer_type == "full_attention":
                h, (ks[i], vs[i], ix[i], op[i]), _, pcs = layer(
                    h, batch, qsa=(ks[i], vs[i], ix[i], op[i]), ple_emb=pe, ple_conv=pcs,
                    verify=verify)
            else:
                h, _, gdn_out[i], pcs = layer(h, batch, gdn=(rec[i], conv[i]), ple_emb=pe,
                                              ple_conv=pcs, verify=verify)
            if j is not None:
                pc[j] = pcs
        new_paged = QSAPaged(PagedKV(tuple(ks), tuple(vs)), tuple(ix))
        if verify:
            return h, new_paged, Qwen4Rows(tuple(gdn_out), tuple(op), tuple(pc),
                                           batch.positions[:, 0], input_ids)
        length = jnp.sum(batch.valid, axis=1).astype(jnp.int32)
        new_view = Qwen4Slots(LinearState(tuple(g[0] for g in gdn_out),
                                          tuple(g[1] for g in gdn_out)), tuple(op), tuple(pc),
                              token_register_commit(ctx, input_ids, None, length))
        if gdn_mode == "decode" and slots is not None:
            return h, new_paged, state.scatter(slots, new_view)
        return h, new_paged, new_view

    @property
    def context_eos(self) -> int:
        """The id the n-gram context holds before a request's start (its first eos id, as
        :meth:`LoadedQwen4Exp.ngram_context` on the host)."""
        return self.cfg.eos_token_ids[0] if self.cfg.eos_token_ids else 0

    def commit(self, state: Qwen4Slots, rows: "Qwen4Rows", length: jax.Array,
               slots: jax.Array | None = None) -> Qwen4Slots:
        """The slot states after the first ``length [B]`` verify rows (every slot state's
        verify handler, :mod:`~mtp_jax.models.qwen4_exp.slot_states`): on the batch view, or
        (with ``slots [B]``) on the pool at those slots."""
        view = state if slots is None else state.gather(slots)
        length = jnp.asarray(length, jnp.int32)
        before = None
        gdn_hook, ring_hook = by_name("gdn_recurrent"), by_name("qsa_open_group")
        ple_hook = by_name("ple_conv")
        # The fused Pallas path's rows (GDNConvRows) are committed by their layer's kernels.
        layers = [la.linear_attn for la in self.layers if la.layer_type != "full_attention"]
        per_row = jnp.broadcast_to(length, rows.ids.shape[:1])  # the kernels take [B]
        gdn = [layer.commit((r, c), w, per_row) if isinstance(w, GDNConvRows)
               else gdn_hook.commit((r, c), w, before, length)
               for r, c, w, layer in zip(view.gdn.recurrent, view.gdn.conv, rows.gdn, layers)]
        # The ring was built at the rows' first position: the slot's length before them.
        groups = tuple(ring_hook.commit(g, ring, rows.start, length)
                       for g, ring in zip(view.open_idx, rows.rings))
        ple = tuple(ple_hook.commit(c, w, before, length)
                    for c, w in zip(view.ple_conv, rows.ple))
        ctx = by_name("ngram_context").commit(
            context_at(view.ngram_ctx, rows.start, self.context_eos), rows.ids, before, length)
        new = Qwen4Slots(LinearState(tuple(g[0] for g in gdn), tuple(g[1] for g in gdn)),
                         groups, ple, ctx)
        return new if slots is None else state.scatter(slots, new)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen4Rows:
    """What a verify keeps for the commit: per GDN layer its verify rows, per QSA layer the
    index-key ring ``[B, r + T, d_idx]``, per PLE layer the conv inputs ``[B, T, hc*H]``;
    ``start [B]`` int32, the slots' length before the rows; ``ids [B, T]`` int32, the rows'
    token ids (for the n-gram context)."""

    gdn: tuple
    rings: tuple
    ple: tuple
    start: jax.Array
    ids: jax.Array
