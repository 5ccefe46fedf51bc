"""QSA (Qwen sparse attention): gated full attention restricted to indexer-selected blocks.

Per QSA layer, besides K/V, every token stores a raw index key ``rk = index_k(x) [d_idx]`` (paged
like KV: ``[num_pages, page_size, 1, d_idx]``). For a query at position p:

* index query ``qi = rope(q_layernorm(index_q(x)))`` with ``n_idx`` heads of ``d_idx``;
* the complete blocks are the groups of ``r = compress_ratio`` consecutive positions
  ``[j*r, (j+1)*r)`` with ``(j+1)*r <= p+1``; block key ``kb_j = rope(k_layernorm(mean(rk)),
  at j*r)``;
* score ``s_j = sum_heads ReLU(qi . kb_j) / sqrt(d_idx)``; the top ``budget / r`` complete blocks
  (all of them if fewer) plus the open tail ``[n_complete*r, p]`` are the keys the query sees.

Rope is NeoX style on the first ``rotary_dim`` (of the attention heads) channels of the index
heads, with the attention's RoPE scaling (YaRN's factor multiplies the index heads' cos and sin
too: transformers hands the indexer the same position embeddings). The attention itself is the
Qwen3.5 gated attention (q/k norms, partial rope, GQA, sigmoid output gate). Source: HF
transformers ``qwen4_exp`` (``Qwen4ExpTextQSAIndexer``).

Decode state: the paged raw index keys hold the rows of COMPLETE blocks only; the rows of the
request's incomplete block live in the per-request open group ``[B, r, d_idx]`` (a slot state
with a group-ring verify handler, :mod:`mtp_jax.models.qwen4_exp.slot_states`). A call appending
rows at ``length .. length+T-1`` builds the ring ``[open group, new raw keys]``, writes the ring
rows of every block that completes to the pages, and keeps the rows of the new incomplete block
as the next open group. Queries only score complete blocks, so after the write the pages hold
every block any query of the call can score. Block keys are re-pooled from the pages each call
(an XLA reference, not a fast kernel).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax.cache.paged import AttentionBatch, write_kv
from mtp_jax.models.layers.attention import GatedAttention
from mtp_jax.models.layers.basic import Linear, RMSNorm
from mtp_jax.models.layers.rotary import apply_rotary
from mtp_jax.models.qwen4_exp.slot_states import (ring_commit, ring_flush, ring_positions,
                                                  ring_verify)
from mtp_jax.rope import DEFAULT_ROPE, RopeScaling

_MASKED = -1e30


class Indexer(nnx.Module):
    def __init__(self, cfg, dtype):
        self.n_heads, self.head_dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.block_topk = cfg.indexer_compress_ratio, cfg.block_topk
        self.index_qk_proj = Linear(cfg.hidden_size, (cfg.indexer_n_heads + 1)
                                    * cfg.indexer_head_dim, dtype)
        self.q_layernorm = RMSNorm(cfg.indexer_head_dim, cfg.rms_norm_eps, dtype)
        self.k_layernorm = RMSNorm(cfg.indexer_head_dim, cfg.rms_norm_eps, dtype)

    def split(self, qk: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``index_qk_proj``'s output ``[B, T, (n_idx+1)*d_idx]`` -> ``(index queries
        [B, T, n_idx, d_idx]`` before ``q_layernorm`` and RoPE, ``raw index keys
        [B, T, 1, d_idx])`` (the key is the last ``d_idx`` channels)."""
        b, t, _ = qk.shape
        n, d = self.n_heads, self.head_dim
        return qk[..., :n * d].reshape(b, t, n, d), qk[..., n * d:].reshape(b, t, 1, d)


def select_visible(qi, raw_keys, k_layernorm, positions, ratio: int, block_topk: int,
                   rotary_dim: int, theta: float, scaling: RopeScaling = DEFAULT_ROPE):
    """Which keys each query sees.

    Args:
      qi: ``[B, T, n_idx, d]`` roped index queries.
      raw_keys: ``[B, S, d]`` raw index keys at positions ``0..S-1``.
      positions: ``[B, T]`` query positions.
      rotary_dim, theta, scaling: the RoPE of the block keys (that of the queries).
    Returns ``(visible [B, T, S] bool, scores [B, T, nb] f32, n_complete [B, T])``.
    """
    b, s, d = raw_keys.shape
    nb = -(-s // ratio)
    pad = nb * ratio - s
    rk = jnp.pad(raw_keys, ((0, 0), (0, pad), (0, 0))) if pad else raw_keys
    pooled = jnp.mean(rk.reshape(b, nb, ratio, d).astype(jnp.float32), axis=2)
    pooled = k_layernorm(pooled.astype(raw_keys.dtype))
    starts = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32) * ratio, (b, nb))
    kb = apply_rotary(pooled[:, :, None, :], starts, rotary_dim, theta,
                      scaling)[:, :, 0]  # [B, nb, d]
    sc = jnp.einsum("btnd,bjd->btnj", qi.astype(jnp.float32), kb.astype(jnp.float32))
    scores = jnp.sum(jax.nn.relu(sc), axis=2) / jnp.sqrt(jnp.float32(d))  # [B, T, nb]
    n_complete = (positions + 1) // ratio  # [B, T]
    blk = jnp.arange(nb, dtype=jnp.int32)
    complete = blk[None, None, :] < n_complete[..., None]
    masked = jnp.where(complete, scores, -jnp.inf)
    k = min(block_topk, nb)
    _, top = jax.lax.top_k(masked, k)  # [B, T, k]
    top_ok = top < n_complete[..., None]
    chosen = jnp.any((top[..., None] == blk) & top_ok[..., None], axis=-2)  # [B, T, nb]
    key_pos = jnp.arange(s, dtype=jnp.int32)
    key_blk = key_pos // ratio
    in_chosen = jnp.take_along_axis(chosen, jnp.broadcast_to(key_blk, (b, chosen.shape[1], s)),
                                    axis=-1)
    tail = key_pos[None, None, :] >= (n_complete * ratio)[..., None]
    causal = key_pos[None, None, :] <= positions[..., None]
    return causal & (tail | in_chosen), scores, n_complete


class QSAAttention(GatedAttention):
    def __init__(self, cfg, dtype, rope_theta: float | None = None):
        super().__init__(cfg, dtype)
        if rope_theta is not None:
            self.rope_theta = rope_theta
        self.indexer = Indexer(cfg, dtype)

    def __call__(self, x: jax.Array, batch: AttentionBatch, kv, idx_pages: jax.Array,
                 open_group: jax.Array | None, verify: bool = False):
        """``x [B, T, H]``; ``kv = (k_pages, v_pages)``; ``idx_pages [P, ps, 1, d_idx]``;
        ``open_group [B, r, d_idx]`` (raw index keys of the request's incomplete block) or None.

        The rows of a request must be its next positions: ``batch.positions[:, 0]`` is its
        length before the call and the valid rows come first. Writes K and V at the rows'
        positions and the raw index keys of blocks that complete after all valid rows (group
        ring), then attends. ``verify``: the open group is not committed; the ring
        ``[B, r + T, d_idx]`` (:func:`~mtp_jax.models.qwen4_exp.slot_states.ring_verify`) is
        returned in its place for the commit of the accepted rows. ``open_group=None`` (the MTP
        draft): every valid row's raw index key is written to the pages by position, as K/V.
        Returns ``(out [B, T, H], (k_pages, v_pages), idx_pages, open group | ring | None)``.
        """
        b, t, _ = x.shape
        d, ix = self.head_dim, self.indexer
        pos = batch.positions
        q, gate, k, v = self.project(x, pos)
        di = ix.head_dim
        qi, rk = ix.split(ix.index_qk_proj(x))
        qi = apply_rotary(ix.q_layernorm(qi), pos, self.rotary_dim, self.rope_theta,
                          self.rope_scaling)
        k_pages, v_pages = write_kv(kv[0], k, batch), write_kv(kv[1], v, batch)
        if open_group is None:
            idx_pages = write_kv(idx_pages, rk.astype(idx_pages.dtype), batch)
        else:
            length = batch.positions[:, 0]
            accepted = jnp.sum(batch.valid, axis=1).astype(jnp.int32)
            ring = ring_verify(open_group, rk[:, :, 0])
            flush = AttentionBatch(ring_positions(length, ix.ratio, t),
                                   ring_flush(length, accepted, ix.ratio, t), batch.page_table)
            idx_pages = write_kv(idx_pages, ring[:, :, None, :], flush)
            open_group = ring if verify else ring_commit(ring, length, accepted, ix.ratio)

        hkv = self.num_kv_heads
        keys = k_pages[batch.page_table].reshape(b, -1, hkv, d)
        vals = v_pages[batch.page_table].reshape(b, -1, hkv, d)
        raw = idx_pages[batch.page_table].reshape(b, -1, di)
        visible, _, _ = select_visible(qi, raw, ix.k_layernorm, pos, ix.ratio, ix.block_topk,
                                       self.rotary_dim, self.rope_theta, self.rope_scaling)
        group = self.num_heads // hkv
        qr = q.reshape(b, t, hkv, group, d)
        s = jnp.einsum("btkgd,bskd->btkgs", qr, keys,
                       preferred_element_type=jnp.float32) * (d ** -0.5)
        s = jnp.where(visible[:, :, None, None, :], s, _MASKED)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("btkgs,bskd->btkgd", p.astype(vals.dtype), vals,
                       preferred_element_type=jnp.float32).astype(x.dtype)
        return self.gated_output(o, gate), (k_pages, v_pages), idx_pages, open_group

    def write_draft(self, x: jax.Array, batch: AttentionBatch, kv, idx_pages: jax.Array):
        """The pages :meth:`__call__` with ``open_group=None`` (the MTP draft) writes, and
        nothing else: K/V and every valid row's raw index key at the rows' positions, without
        the index queries or the attention. ``x [B, T, H]``; ``kv = (k_pages, v_pages)``
        ``[P, ps, Hkv, D]``; ``idx_pages [P, ps, 1, d_idx]``. Returns ``((k_pages, v_pages),
        idx_pages)``."""
        _, _, k, v = self.project(x, batch.positions)
        _, rk = self.indexer.split(self.indexer.index_qk_proj(x))
        return ((write_kv(kv[0], k, batch), write_kv(kv[1], v, batch)),
                write_kv(idx_pages, rk.astype(idx_pages.dtype), batch))
