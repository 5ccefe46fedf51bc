"""XLA paged causal attention over key blocks, for page tables much wider than the context.

:func:`~pallas_kernels.paged_attention.reference.paged_attention_reference` gathers every page
of the table and scores ``[B, T, Hq, S]`` at once, ``S = max_pages * page_size``: the table's
width (``max_model_len``), not the context. A 2048-token prefill chunk of the 27B shape (24
query heads) at ``max_model_len = 131072`` would hold 25.8 GB of float32 scores per layer. This
form walks the table in blocks of :data:`BLOCK_KEYS` keys with an online softmax (the running
maximum and sum of flash attention: Dao et al. 2022, "FlashAttention", Algorithm 1) and stops
after the block holding the largest query position, so its time and memory follow the context.
:func:`pallas_kernels.paged_attention.paged_attention` takes it where the table holds more
than :data:`MAX_GATHER_KEYS` keys; below that the one-shot gather stays (measured on the H200
for every benchmark shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention.reference import MASKED_SCORE

BLOCK_KEYS = 4096  # keys scored per loop step (rounded up to whole pages)
MAX_GATHER_KEYS = 16384  # widest page table (in keys) that the one-shot reference takes


def uses_blocks(page_size: int, max_pages: int) -> bool:
    """Whether a table of ``max_pages`` pages of ``page_size`` keys takes the blocked form."""
    return page_size * max_pages > MAX_GATHER_KEYS


def paged_attention_blocked(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                            page_table: jax.Array, q_positions: jax.Array, *,
                            scale: float, block_keys: int = BLOCK_KEYS) -> jax.Array:
    """Causal grouped-query attention over paged K/V, one key block at a time.

    Args and result as :func:`~pallas_kernels.paged_attention.reference.
    paged_attention_reference` (``q [B, T, Hq, D]`` roped, pools ``[P, page_size, Hkv, D]``,
    ``page_table [B, max_pages]`` int32, ``q_positions [B, T]`` int32; returns ``[B, T, Hq,
    D]`` in ``q.dtype``), equal to it up to float rounding (the softmax is summed per block).
    ``block_keys``: keys per step, rounded up to whole pages. Slots past a row's position,
    stale or never written (even NaN or inf), get zero weight as in the reference; a row that
    sees no key gets the reference's masked-uniform average.
    """
    b, t, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    group = hq // hkv
    per_block = max(1, -(-block_keys // page_size))  # pages per block
    max_pages = page_table.shape[1]
    num_blocks = -(-max_pages // per_block)
    table = jnp.pad(page_table, ((0, 0), (0, num_blocks * per_block - max_pages)))
    keys = per_block * page_size
    # Blocks up to the one holding the largest query position (the rest is masked anyway).
    used = jnp.clip(jnp.max(q_positions) // keys + 1, 1, num_blocks)
    qg = q.reshape(b, t, hkv, group, d)

    def step(j, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(table, j * per_block, per_block, axis=1)
        k = k_pages[pages].reshape(b, keys, hkv, d)
        v = v_pages[pages].reshape(b, keys, hkv, d)
        v = jnp.where(jnp.isfinite(v), v, 0)
        s = jnp.einsum("btkgd,bskd->btkgs", qg, k, preferred_element_type=jnp.float32) * scale
        key_pos = j * keys + jnp.arange(keys, dtype=jnp.int32)
        visible = key_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, keys]
        s = jnp.where(visible[:, :, None, None, :], s, MASKED_SCORE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum("btkgs,bskd->btkgd", p.astype(v.dtype), v,
                        preferred_element_type=jnp.float32)
        return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr[..., None] + pv

    init = (jnp.full((b, t, hkv, group), MASKED_SCORE, jnp.float32),
            jnp.zeros((b, t, hkv, group), jnp.float32),
            jnp.zeros((b, t, hkv, group, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, used, step, init)
    return (acc / l[..., None]).reshape(b, t, hq, d).astype(q.dtype)


__all__ = ["BLOCK_KEYS", "MAX_GATHER_KEYS", "paged_attention_blocked", "uses_blocks"]
