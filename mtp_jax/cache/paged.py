"""Paged KV pool and the per-forward metadata that addresses it.

Layout: one ``[num_pages, page_size, num_kv_heads, head_dim]`` array per attention layer for K
and for V. Position ``p`` of a request lives at ``page_table[row, p // page_size]``, offset
``p % page_size``. Page 0 is never given to a request: it stands in the page tables of padding
rows and past a request's pages; :func:`write_kv` leaves out the rows addressed to it (padding
rows of a bucket, padding tokens of a prefill). Only padding rows read it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mtp_jax.cache.rows import dropped

TRASH_PAGE = 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKV:
    """K and V pages, a tuple with one array per attention layer, each
    ``[num_pages, page_size, Hkv, D]``."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
              head_dim: int, dtype) -> "PagedKV":
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                   v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)))

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1] if self.k else 0

    @property
    def nbytes(self) -> int:
        return sum(a.size * a.dtype.itemsize for a in self.k + self.v)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttentionBatch:
    """Where the rows of one forward sit in the paged pools.

    positions:  ``[B, T]`` int32, absolute position of each row.
    valid:      ``[B, T]`` bool, rows whose K/V (and recurrent updates) are real; invalid rows
                write nothing and leave every state unchanged.
    page_table: ``[B, max_pages]`` int32, pages of each request (trash page for padding rows).
    """

    positions: jax.Array
    valid: jax.Array
    page_table: jax.Array


def write_kv(pages: jax.Array, new: jax.Array, batch: AttentionBatch) -> jax.Array:
    """Scatter ``new [B, T, Hkv, D]`` into ``pages [P, page_size, Hkv, D]`` at the rows' positions.

    Invalid rows, and rows whose page is the trash page, write nothing. Returns the updated
    pages (donate the input to update in place).
    """
    page_size = pages.shape[1]
    page_idx = jnp.clip(batch.positions // page_size, 0, batch.page_table.shape[1] - 1)
    page = jnp.take_along_axis(batch.page_table, page_idx, axis=1)
    # Rows bound for the trash page (invalid rows, positions past the page table's pages) are
    # left out, not written there: colliding writes serialise (mtp_jax.cache.rows).
    page = dropped(page, batch.valid & (page != TRASH_PAGE), pages.shape[0])
    offset = batch.positions % page_size
    # Scatter on the 4-D pool (no reshape to [P * page_size, ...]): with one row (B * T = 1)
    # XLA turns the scatter into a dynamic-update-slice, and through the reshape the CPU
    # fusion pass duplicated it into the attention gather, copying the whole pool 4x per call.
    return pages.at[page.reshape(-1), offset.reshape(-1)].set(
        new.reshape(-1, *new.shape[2:]).astype(pages.dtype), mode="drop")
