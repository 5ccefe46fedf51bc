"""The qwen4_exp MTP draft head (``mtp.*``), sharing ``embed_tokens`` and ``lm_head``.

Row t pairs the target's pre-mixer streams at t (``[hc*H]``) with token t+1 and predicts t+2::

    e  = pre_fc_norm_embedding(embed(x[t+1]))                [H]
    hn = pre_fc_norm_hidden(streams[t])                      [hc*H], one RMSNorm over all streams
    u_s = fc_embedding(e) + fc_hidden(hn_s)  for each stream  [hc*H]  (fc_hidden shared by streams)
    y  = layer(u)      QSA + MoE decoder layer with its two hyper-connections, over the draft KV
    z  = mtp.hyper_connection_mixer(y);  logits = lm_head(z)     (no mtp.norm)

A chained draft step relays ``y`` (the MTP's own pre-mixer streams) as the next hidden, with the
drafted token, at position t+1. Rows use the hidden's position t. Sources: MODEL_FACTS.md
("MTP head" of Qwen3.8-Flash-Next), shared/real_configs/README.md section 3.
"""

from __future__ import annotations

import jax
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch, PagedKV
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.basic import Embed, Linear, RMSNorm
from mtp_jax.models.qwen4_exp.decoder import DecoderLayer
from mtp_jax.models.qwen4_exp.hyper_connection import GatedResidual
from mtp_jax.models.qwen4_exp.pools import QSAPaged


class MTPDraft(nnx.Module):
    def __init__(self, cfg, dtype):
        h = cfg.hidden_size
        self.hc, self.hidden = cfg.hc_count, h
        self.fc_embedding = Linear(h, h, dtype)
        self.fc_hidden = Linear(h, h, dtype)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = RMSNorm(cfg.hc_hidden, cfg.rms_norm_eps, dtype)
        self.layers = nnx.List([DecoderLayer(cfg, "full_attention", dtype, i,
                                             rope_theta=cfg.mtp_rope_theta)
                                for i in range(cfg.mtp_num_hidden_layers)])
        self.hyper_connection_mixer = GatedResidual(cfg.hc_count, h, cfg.hc_lowrank,
                                                    cfg.rms_norm_eps, dtype, inject=False,
                                                    backend=kernels_of(cfg).norm)

    def __call__(self, embed: Embed, streams: jax.Array, next_ids: jax.Array,
                 batch: AttentionBatch, draft: QSAPaged, step: int = 0):
        """Draft rows ``streams [B, T, hc*H]`` paired with ``next_ids [B, T]`` at ``batch``'s
        positions over the draft's paged K/V and raw index keys (``draft``, keyed by the
        target's pages; every valid row's index key is written by position, so the draft keeps
        no open group: :mod:`~mtp_jax.models.qwen4_exp.pools`). Returns ``(y [B, T, hc*H]``
        the draft's pre-mixer streams (relayed by a chained step; ``draft_logits`` mixes them),
        new draft)``."""
        u = self._fc(embed, streams, next_ids)
        i = step % len(self.layers)
        y, (k, v, ix, _), _, _ = self.layers[i](
            u, batch, qsa=(draft.kv.k[i], draft.kv.v[i], draft.idx[i], None))
        return y, _replace_layer(draft, i, k, v, ix)

    def write_kv(self, embed: Embed, streams: jax.Array, next_ids: jax.Array,
                 batch: AttentionBatch, draft: QSAPaged) -> QSAPaged:
        """The draft pages that :meth:`__call__` (step 0) writes for these rows, and nothing
        else: ``fc``'s streams through layer 0's attention hyper-connection to its K/V and raw
        index keys (no index queries, attention, MoE or mixer)::

            x = attn_hyper_connection(u).x;  k, v = project(x);  rk = index_qk_proj(x)[-d_idx:]

        A plain round of adaptive speculation keeps the draft's pages whole with it
        (:mod:`mtp_jax.engine.programs`). Arguments as :meth:`__call__`'s; returns the new
        ``draft``."""
        u = self._fc(embed, streams, next_ids)
        layer = self.layers[0]
        x, _ = layer.attn_hyper_connection(u)
        (k, v), ix = layer.self_attn.write_draft(x, batch, (draft.kv.k[0], draft.kv.v[0]),
                                                 draft.idx[0])
        return _replace_layer(draft, 0, k, v, ix)

    def _fc(self, embed: Embed, streams: jax.Array, next_ids: jax.Array) -> jax.Array:
        """The layer's input ``u [B, T, hc*H]`` from ``streams [B, T, hc*H]`` and ``next_ids
        [B, T]`` int32: ``fc_embedding(e) + fc_hidden(hn_s)`` on every stream s."""
        b, t, _ = streams.shape
        e = self.pre_fc_norm_embedding(embed(next_ids))
        hn = self.pre_fc_norm_hidden(streams.astype(e.dtype))
        u = (self.fc_embedding(e)[:, :, None, :]
             + self.fc_hidden(hn.reshape(b, t, self.hc, self.hidden)))
        return u.reshape(b, t, self.hc * self.hidden)


def _replace_layer(draft: QSAPaged, i: int, k: jax.Array, v: jax.Array,
                   ix: jax.Array) -> QSAPaged:
    """``draft`` with MTP layer ``i``'s K, V and index pages replaced."""
    ks, vs, ixs = list(draft.kv.k), list(draft.kv.v), list(draft.idx)
    ks[i], vs[i], ixs[i] = k, v, ix
    return QSAPaged(PagedKV(tuple(ks), tuple(vs)), tuple(ixs))
