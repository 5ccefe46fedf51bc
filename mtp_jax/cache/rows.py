"""Row writes into pools that leave out the rows bound for a trash id.

Padding rows (a bucket's empty rows, a prefill chunk's padded tail, snapshot targets not saved)
are addressed to a trash page, slot or snapshot that nothing reads. Writing them there made
every such row of a call hit the same address: XLA's GPU scatter, which cannot assume unique
indices and so updates atomically, serialises colliding writes, and a 1024-token prefill
chunk holding 532 tokens took 3.4x the time of a full one (H100, session 62,
docs/benchmarks.md). Here those rows get an out-of-range index instead, which a scatter with
``mode="drop"`` skips, and the remaining writes go to distinct addresses. (The Pallas
kernels store padding rows at the trash ids in-kernel, plain stores that do not serialise;
only padding rows read those ids.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["dropped", "set_rows"]


def dropped(index: jax.Array, keep: jax.Array, size: int) -> jax.Array:
    """``index`` where ``keep``, else ``size`` (one past the last row: out of range, so a
    scatter with ``mode="drop"`` leaves that row out). Shapes broadcast; int32."""
    return jnp.where(keep, index, size)


def set_rows(pool: jax.Array, index: jax.Array, rows: jax.Array, trash: int = 0) -> jax.Array:
    """``pool.at[index].set(rows)`` (``rows`` cast to ``pool.dtype``), leaving out the rows
    whose ``index`` is ``trash``: ``pool [N, ...]``, ``index [R]`` int32 in ``[0, N)``,
    ``rows [R, ...]``. Returns the new pool (donate the input to update in place)."""
    index = dropped(index, index != trash, pool.shape[0])
    return pool.at[index].set(rows.astype(pool.dtype), mode="drop")
