"""The qwen4_exp target model (Flax nnx), pure over explicit state.

Parameter paths equal the canonical names of :mod:`mtp_jax.models.qwen4_exp.names`. A forward
takes the token ids, the host-looked-up PLE n-gram rows and a :class:`Qwen4State` batch view, and
returns the pre-mixer residual streams ``[B, T, hc*H]`` (the hidden states of this family; the MTP
head reads them) with the new state. ``logits(streams)`` applies ``hyper_connection_mixer`` and
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
from mtp_jax.models.layers.basic import Embed, Linear
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.decoder import DecoderLayer
from mtp_jax.models.qwen4_exp.hyper_connection import GatedResidual
from mtp_jax.models.qwen4_exp.mtp import MTPDraft


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen4State:
    """Batch view (or pool) of the decode state.

    kv: paged K/V per QSA layer ``[P, ps, Hkv, D]``; idx: raw index keys of complete blocks per
    QSA layer ``[P, ps, 1, d_idx]`` (same page ids); open_idx: open index group per QSA layer
    ``[B, r, d_idx]`` (raw index keys of the incomplete block, slot state, group ring); gdn: GDN
    recurrent/conv per GDN layer ``[B, ...]``; ple_conv: PLE conv window per PLE layer
    ``[B, hc*H, (K-1)*ngram_size]``.
    """

    kv: PagedKV
    idx: tuple[jax.Array, ...]
    open_idx: tuple[jax.Array, ...]
    gdn: LinearState
    ple_conv: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, cfg: Qwen4ExpConfig, *, num_pages: int, page_size: int, slots: int,
              dtype, num_qsa: int | None = None) -> "Qwen4State":
        n_qsa = len(cfg.full_layer_ids) if num_qsa is None else num_qsa
        kv = PagedKV.zeros(n_qsa, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim,
                           dtype)
        idx = tuple(jnp.zeros((num_pages, page_size, 1, cfg.indexer_head_dim), dtype)
                    for _ in range(n_qsa))
        open_idx = tuple(jnp.zeros((slots, cfg.indexer_compress_ratio, cfg.indexer_head_dim),
                                   dtype) for _ in range(n_qsa))
        gdn = LinearState.zeros(len(cfg.linear_layer_ids), slots, cfg.linear_num_value_heads,
                                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, dtype, ring=False)
        ple = tuple(jnp.zeros((slots, cfg.hc_hidden, cfg.ple_conv_state_len), dtype)
                    for _ in cfg.ple_layers)
        return cls(kv, idx, open_idx, gdn, ple)


def _state_slices(cfg: Qwen4ExpConfig, start: int, stop: int):
    """Index ranges (QSA, GDN, PLE) of the states owned by layers ``[start, stop)``."""
    count = lambda ids, a: sum(1 for i in ids if i < a)
    return tuple(slice(count(ids, start), count(ids, stop)) for ids in
                 (cfg.full_layer_ids, cfg.linear_layer_ids, cfg.ple_layers))


def state_part(state: Qwen4State, cfg: Qwen4ExpConfig, start: int, stop: int) -> Qwen4State:
    """The states of layers ``[start, stop)`` only (a program over those layers takes and
    donates just these arrays)."""
    q, g, p = _state_slices(cfg, start, stop)
    return Qwen4State(PagedKV(state.kv.k[q], state.kv.v[q]), state.idx[q], state.open_idx[q],
                      LinearState(state.gdn.recurrent[g], state.gdn.conv[g]), state.ple_conv[p])


def state_merge(state: Qwen4State, part: Qwen4State, cfg: Qwen4ExpConfig, start: int,
                stop: int) -> Qwen4State:
    """``state`` with the states of layers ``[start, stop)`` replaced by ``part``."""
    q, g, p = _state_slices(cfg, start, stop)

    def put(whole, sl, new):
        out = list(whole)
        out[sl] = new
        return tuple(out)

    return Qwen4State(PagedKV(put(state.kv.k, q, part.kv.k), put(state.kv.v, q, part.kv.v)),
                      put(state.idx, q, part.idx), put(state.open_idx, q, part.open_idx),
                      LinearState(put(state.gdn.recurrent, g, part.gdn.recurrent),
                                  put(state.gdn.conv, g, part.gdn.conv)),
                      put(state.ple_conv, p, part.ple_conv))


class Qwen4ExpModel(nnx.Module):
    def __init__(self, cfg: Qwen4ExpConfig, dtype, with_mtp: bool = False):
        self.cfg = cfg
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
                                                    cfg.rms_norm_eps, dtype, inject=False)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size,
                                                                    cfg.vocab_size, dtype)
        self.mtp = MTPDraft(cfg, dtype) if with_mtp else None

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

    def run_layers(self, h, ple_emb: tuple, batch: AttentionBatch, part: Qwen4State,
                   start: int, stop: int):
        """Decoder layers ``[start, stop)`` (static) on streams ``h [B, T, hc*H]``.

        ``part``: the states of those layers (:func:`state_part`); ``ple_emb``: per PLE layer of
        the model ``[B, T, ple_embed_dim]`` (may be empty when the range has no PLE layer).
        Returns ``(h, new part)``.
        """
        q0, g0, p0 = (s.start for s in _state_slices(self.cfg, start, stop))
        ks, vs, ix, op = (list(part.kv.k), list(part.kv.v), list(part.idx),
                          list(part.open_idx))
        rec, conv, pc = list(part.gdn.recurrent), list(part.gdn.conv), list(part.ple_conv)
        for li in range(start, stop):
            layer = self.layers[li]
            j = layer.ple_index
            pe = ple_emb[j] if j is not None else None
            pcs = pc[j - p0] if j is not None else None
            if layer.layer_type == "full_attention":
                i = layer.cache_index - q0
                h, (ks[i], vs[i], ix[i], op[i]), _, pcs = layer(
                    h, batch, qsa=(ks[i], vs[i], ix[i], op[i]), ple_emb=pe, ple_conv=pcs)
            else:
                i = layer.cache_index - g0
                h, _, (rec[i], conv[i]), pcs = layer(h, batch, gdn=(rec[i], conv[i]),
                                                     ple_emb=pe, ple_conv=pcs)
            if j is not None:
                pc[j - p0] = pcs
        new = Qwen4State(PagedKV(tuple(ks), tuple(vs)), tuple(ix), tuple(op),
                         LinearState(tuple(rec), tuple(conv)), tuple(pc))
        return h, new

    def __call__(self, input_ids, ple_emb: tuple, batch: AttentionBatch, state: Qwen4State):
        """``input_ids [B, T]``; ``ple_emb``: per PLE layer ``[B, T, ple_embed_dim]``.
        Returns ``(streams [B, T, hc*H] before the mixer, new state)``."""
        return self.run_layers(self.embed(input_ids), ple_emb, batch, state, 0,
                               self.cfg.num_hidden_layers)
