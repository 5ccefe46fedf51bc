"""XLA reference of paged causal attention for prefill, decode and verify rows.

Each query row attends every cached key at a position ``<=`` its own (bottom-right causal per
row), which covers prefill chunks, a decode step (one row) and a verify window of k+1 rows alike.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite, so a row with no visible key gives a zeros-weighted output, not NaN.
MASKED_SCORE = -1e30


def paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_table: jax.Array, q_positions: jax.Array, *,
                              scale: float) -> jax.Array:
    """Grouped-query attention over paged K/V.

    Args:
      q: ``[B, T, Hq, D]`` queries (already roped).
      k_pages, v_pages: ``[num_pages, page_size, Hkv, D]`` one layer's pool.
      page_table: ``[B, max_pages]`` int32, page ids of each request in position order.
      q_positions: ``[B, T]`` int32 absolute position of each query row.
      scale: softmax scale (``D ** -0.5``).
    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; softmax in float32.
    """
    b, t, hq, d = q.shape
    _, page_size, hkv, _ = k_pages.shape
    group = hq // hkv
    k = k_pages[page_table].reshape(b, -1, hkv, d)  # [B, S, Hkv, D]
    v = v_pages[page_table].reshape(b, -1, hkv, d)
    s = k.shape[1]
    qg = q.reshape(b, t, hkv, group, d)
    scores = jnp.einsum("btkgd,bskd->btkgs", qg, k,
                        preferred_element_type=jnp.float32) * scale
    key_pos = jnp.arange(s, dtype=jnp.int32)
    visible = key_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    # Slots a row cannot see may hold stale or never-written values (even NaN or inf); a zero
    # weight times NaN is NaN, so such values are zeroed rather than trusted to the weight.
    v = jnp.where(jnp.isfinite(v), v, 0)
    scores = jnp.where(visible[:, :, None, None, :], scores, MASKED_SCORE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("btkgs,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, hq, d).astype(q.dtype)
