"""The Qwen3.5 MTP draft head (``mtp.*``), sharing ``embed_tokens`` and ``lm_head``.

Row t pairs the target's hidden at t (after ``model.norm``) with token t+1 and predicts t+2:

    e = pre_fc_norm_embedding(embed(x[t+1]))
    h = pre_fc_norm_hidden(hidden[t])
    y = layer(fc(concat([e, h])))          # a full-attention decoder layer over the draft KV
    z = norm(y);  logits = lm_head(z)

A chained draft step feeds ``z`` back as the hidden, with the drafted token, at position t+1.
Every row uses the position of its hidden (t). With ``mtp_num_hidden_layers = n``, draft step i
uses layer ``i % n`` and that layer's draft KV. Source: vLLM / SGLang Qwen3.5 MTP code and
../shared/MODEL_FACTS.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch, PagedKV, write_kv
from mtp_jax.config import ModelConfig
from mtp_jax.kernels import kernels_of
from mtp_jax.models.layers.basic import Embed, Linear, RMSNorm
from mtp_jax.models.qwen3_5.decoder import DecoderLayer


class MTPDraft(nnx.Module):
    def __init__(self, cfg: ModelConfig, dtype):
        h = cfg.hidden_size
        self.fc = Linear(2 * h, h, dtype)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, backend=kernels_of(cfg).norm)
        self.layers = nnx.List([DecoderLayer(cfg, "full_attention", dtype, i)
                                for i in range(cfg.mtp_num_hidden_layers)])

    def __call__(self, embed: Embed, hidden: jax.Array, next_ids: jax.Array,
                 batch: AttentionBatch, kv: PagedKV, step: int = 0):
        """Draft rows.

        Args:
          embed: the target's embedding (shared).
          hidden: ``[B, T, H]`` target hidden after the final norm (or a previous ``z``).
          next_ids: ``[B, T]`` int32, the token after each row's position.
          batch: positions (those of the hiddens), validity and the target's page tables.
          kv: the draft's paged KV (one entry per MTP layer).
          step: draft step index (static); picks layer ``step % n``.
        Returns:
          ``(z [B, T, H] after mtp.norm, new draft kv)``.
        """
        e = self.pre_fc_norm_embedding(embed(next_ids))
        h = self.pre_fc_norm_hidden(hidden.astype(e.dtype))
        u = self.fc(jnp.concatenate([e, h], axis=-1))
        i = step % len(self.layers)
        y, delta, (k, v), _ = self.layers[i].forward(u, None, batch, kv=(kv.k[i], kv.v[i]))
        ks, vs = list(kv.k), list(kv.v)
        ks[i], vs[i] = k, v
        return self.norm.add_norm(y, delta)[1], PagedKV(tuple(ks), tuple(vs))

    def write_kv(self, embed: Embed, hidden: jax.Array, next_ids: jax.Array,
                 batch: AttentionBatch, kv: PagedKV) -> PagedKV:
        """The draft KV that :meth:`__call__` (step 0) writes for these rows, and nothing else:
        the projections of ``fc``'s output up to the layer's K/V (no attention, MLP or final
        norm). A plain round of adaptive speculation keeps the draft's KV whole with it
        (:mod:`mtp_jax.engine.programs`). Arguments as :meth:`__call__`'s; returns the new
        draft kv."""
        e = self.pre_fc_norm_embedding(embed(next_ids))
        h = self.pre_fc_norm_hidden(hidden.astype(e.dtype))
        u = self.fc(jnp.concatenate([e, h], axis=-1))
        layer = self.layers[0]
        _, hn = layer.input_layernorm.add_norm(u, None)
        _, _, k, v = layer.self_attn.project(hn, batch.positions)
        ks, vs = list(kv.k), list(kv.v)
        ks[0], vs[0] = write_kv(kv.k[0], k, batch), write_kv(kv.v[0], v, batch)
        return PagedKV(tuple(ks), tuple(vs))
