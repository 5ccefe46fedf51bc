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
from mtp_jax.models.layers.basic import Embed, Linear, rms_normalize
from mtp_jax.models.layers.gdn import GatedDeltaNet
from mtp_jax.models.layers.mlp import SparseMoE
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.hyper_connection import GatedResidual, inject
from mtp_jax.models.qwen4_exp.ple import PLE
from mtp_jax.models.qwen4_exp.qsa import QSAAttention


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Qwen4State:
    """Batch view (or pool) of the decode state.

    kv: paged K/V per QSA layer ``[P, ps, Hkv, D]``; idx: raw index keys per QSA layer
    ``[P, ps, 1, d_idx]`` (same page ids); gdn: GDN recurrent/conv per GDN layer ``[B, ...]``;
    ple_conv: PLE conv window per PLE layer ``[B, hc*H, (K-1)*ngram_size]``.
    """

    kv: PagedKV
    idx: tuple[jax.Array, ...]
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
        gdn = LinearState.zeros(len(cfg.linear_layer_ids), slots, cfg.linear_num_value_heads,
                                cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, dtype)
        ple = tuple(jnp.zeros((slots, cfg.hc_hidden, cfg.ple_conv_state_len), dtype)
                    for _ in cfg.ple_layers)
        return cls(kv, idx, gdn, ple)


class GatedDeltaNetGate(GatedDeltaNet):
    """Gated DeltaNet with a configurable output gate: ``norm(o) * w * act(z)``, act = sigmoid
    (Qwen3.8-Flash-Next) or silu."""

    def __init__(self, cfg, dtype):
        super().__init__(cfg, dtype)
        self.gate_act = cfg.output_gate_type

    def _output(self, o, x):
        b, t, _ = x.shape
        z = self.in_proj_z(x).reshape(b, t, self.hv, self.dv).astype(jnp.float32)
        act = jax.nn.sigmoid if self.gate_act == "sigmoid" else jax.nn.silu
        y = rms_normalize(o, self.eps).astype(x.dtype) * self.norm.weight[...]
        y = (y.astype(jnp.float32) * act(z)).astype(x.dtype)
        return self.out_proj(y.reshape(b, t, self.hv * self.dv))


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen4ExpConfig, layer_type: str, dtype, cache_index: int,
                 ple_index: int | None = None, rope_theta: float | None = None):
        self.layer_type, self.cache_index, self.ple_index = layer_type, cache_index, ple_index
        mk = lambda inj=True: GatedResidual(cfg.hc_count, cfg.hidden_size, cfg.hc_lowrank,
                                            cfg.rms_norm_eps, dtype, inject=inj)
        self.attn_hyper_connection = mk()
        self.mlp_hyper_connection = mk()
        if layer_type == "full_attention":
            self.self_attn = QSAAttention(cfg, dtype, rope_theta)
        else:
            self.linear_attn = GatedDeltaNetGate(cfg, dtype)
        self.mlp = SparseMoE(cfg, dtype)
        self.ple = PLE(cfg, dtype) if ple_index is not None else None

    def __call__(self, h, batch: AttentionBatch, *, kv=None, idx=None, gdn=None,
                 ple_emb=None, ple_conv=None):
        """Returns ``(h, kv, idx, gdn, ple_conv)`` (the states this layer does not own pass
        through as None)."""
        if self.ple is not None:
            p, ple_conv = self.ple(h, ple_emb, ple_conv, batch.valid)
            h = h + p
        x, inj = self.attn_hyper_connection(h)
        if self.layer_type == "full_attention":
            y, kv, idx = self.self_attn(x, batch, kv, idx)
        else:
            y, gdn = self.linear_attn.prefill(x, gdn, batch.valid)
        h = inject(h, inj, y)
        x, inj = self.mlp_hyper_connection(h)
        h = inject(h, inj, self.mlp(x))
        return h, kv, idx, gdn, ple_conv


class Qwen4ExpModel(nnx.Module):
    def __init__(self, cfg: Qwen4ExpConfig, dtype, with_mtp: bool = False):
        from mtp_jax.models.qwen4_exp.mtp import MTPDraft

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

    def __call__(self, input_ids, ple_emb: tuple, batch: AttentionBatch, state: Qwen4State):
        """``input_ids [B, T]``; ``ple_emb``: per PLE layer ``[B, T, ple_embed_dim]``.
        Returns ``(streams [B, T, hc*H] before the mixer, new state)``."""
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        h = jnp.tile(x, (1, 1, cfg.hc_count))
        ks, vs, ix = list(state.kv.k), list(state.kv.v), list(state.idx)
        rec, conv = list(state.gdn.recurrent), list(state.gdn.conv)
        pc = list(state.ple_conv)
        for layer in self.layers:
            i, j = layer.cache_index, layer.ple_index
            pe = ple_emb[j] if j is not None else None
            pcs = pc[j] if j is not None else None
            if layer.layer_type == "full_attention":
                h, (ks[i], vs[i]), ix[i], _, pcs = layer(h, batch, kv=(ks[i], vs[i]), idx=ix[i],
                                                         ple_emb=pe, ple_conv=pcs)
            else:
                h, _, _, (rec[i], conv[i]), pcs = layer(h, batch, gdn=(rec[i], conv[i]),
                                                        ple_emb=pe, ple_conv=pcs)
            if j is not None:
                pc[j] = pcs
        new = Qwen4State(PagedKV(tuple(ks), tuple(vs)), tuple(ix),
                         LinearState(tuple(rec), tuple(conv)), tuple(pc))
        return h, new
