"""The GDN causal-conv state: the raw (pre-conv) inputs that the next rows' conv reads.

A layer with conv kernel ``K`` needs the last ``K-1`` inputs of each request. Two layouts of a
slot's state ``[..., C, columns]``:

* **shift register**, ``K-1`` columns: the last ``K-1`` inputs, oldest first; consuming rows
  moves every column (qwen4_exp's slot-state hooks use it).
* **ring**, ``K`` columns: the input at position ``p`` lives in column ``p mod K``. A step at
  position ``p`` reads columns ``(p-K+1 .. p-1) mod K`` and writes column ``p mod K``, which no
  read of that step touches, so the programs of one kernel that share a window (every value
  block of a GDN head reads the head's q/k window) can read it and write it in place without a
  race (:mod:`pallas_kernels.gdn.fused_decode`). The Qwen3.5 family's pools use it
  (:class:`mtp_jax.cache.linear_state.LinearState`). A zero ring is a zero window at any
  position, so a fresh request needs no alignment.

Both hold the same inputs: :func:`ordered_window` reads a ring as the shift register at a
position, :func:`store_rows` writes rows into it; :func:`advance_at` gives the state after each
of several row counts of one chunk (prefix-cache snapshots inside a prefill chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def is_ring(window: jax.Array, kernel: int) -> bool:
    """True when ``window [..., C, n]`` is a ring (``n = K``), False for a shift register
    (``n = K-1``). Raises ValueError for any other ``n``."""
    n = window.shape[-1]
    if n not in (kernel, kernel - 1):
        raise ValueError(f"conv state has {n} columns; a conv of kernel {kernel} keeps "
                         f"{kernel - 1} (shift register) or {kernel} (ring).")
    return n == kernel


def ring_columns(position: jax.Array, kernel: int) -> jax.Array:
    """Ring columns of the ``K-1`` inputs before ``position [B]``, oldest first: ``[B, K-1]``
    int32, ``(position - K + 1 + i) mod K``."""
    offsets = jnp.arange(1 - kernel, 0, dtype=jnp.int32)
    return jnp.mod(position.astype(jnp.int32)[:, None] + offsets[None, :], kernel)


def ordered_window(ring: jax.Array, position: jax.Array) -> jax.Array:
    """The shift register ``[B, C, K-1]`` (the ``K-1`` inputs before ``position [B]``, oldest
    first) of a ring ``[B, C, K]``."""
    cols = ring_columns(position, ring.shape[-1])
    return jnp.take_along_axis(ring, cols[:, None, :], axis=-1)


def store_rows(ring: jax.Array, rows: jax.Array, length: jax.Array,
               start: jax.Array) -> jax.Array:
    """Ring ``[B, C, K]`` after consuming the first ``length [B]`` of ``rows [B, T, C]``, row 0
    at position ``start [B]``: row t goes to column ``(start + t) mod K``, a later row over an
    earlier one; columns no row reaches keep their value. So a ring is the same whether its
    rows came one decode step at a time, as a committed verify window or as a prefill chunk:
    column c holds the input at the last position ``= c (mod K)`` consumed."""
    kernel = ring.shape[-1]
    first = jnp.mod(jnp.arange(kernel, dtype=jnp.int32)[None, :] - start[:, None], kernel)
    length = length.astype(jnp.int32)[:, None]
    hit = first < length  # [B, K]: some row lands in column c
    last = jnp.where(hit, first + kernel * ((length - 1 - first) // kernel), 0)
    taken = jnp.take_along_axis(rows, last[:, :, None], axis=1)  # [B, K, C]
    return jnp.where(hit[:, None, :], jnp.swapaxes(taken, 1, 2).astype(ring.dtype), ring)


def conv_window(conv_state: jax.Array, qkv: jax.Array, length: jax.Array) -> jax.Array:
    """Shift register after consuming the first ``length [B]`` rows of ``qkv [B, T, C]``.

    ``conv_state [B, C, K-1]`` holds the last K-1 raw inputs; the result holds the K-1 raw
    inputs ending at row ``length - 1`` (unchanged when ``length`` is 0).
    """
    km1 = conv_state.shape[-1]
    ext = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2), qkv.astype(conv_state.dtype)], axis=1)
    take = lambda e, n: jax.lax.dynamic_slice_in_dim(e, n, km1, axis=0)
    return jnp.swapaxes(jax.vmap(take)(ext, length), 1, 2)


def window_before(state: jax.Array, kernel: int, start: jax.Array | None) -> jax.Array:
    """The shift register ``[B, C, K-1]`` of either layout before position ``start [B]``
    (needed for a ring; ignored for a shift register). Raises ValueError for a ring without
    ``start``."""
    if not is_ring(state, kernel):
        return state
    return ordered_window(state, _need_start(start))


def advance(state: jax.Array, kernel: int, qkv: jax.Array, length: jax.Array,
            start: jax.Array | None) -> jax.Array:
    """Either layout after consuming the first ``length [B]`` rows of ``qkv [B, T, C]``, whose
    first row is at position ``start [B]`` (needed for a ring). Unchanged for ``length`` 0."""
    if not is_ring(state, kernel):
        return conv_window(state, qkv, length)
    return store_rows(state, qkv, length, _need_start(start))


def advance_at(state: jax.Array, kernel: int, qkv: jax.Array, rows: jax.Array,
               start: jax.Array | None) -> jax.Array:
    """The state of either layout after each of several row counts: ``[B, S, C, columns]``,
    entry ``[b, s]`` equal to :func:`advance` of the first ``rows[b, s]`` rows of
    ``qkv [B, T, C]`` (``0 <= rows <= T``; row 0 at position ``start [B]``, needed for a ring).
    Only the last ``K`` rows before each count can be in it, so those are gathered
    (``[B, S, K, C]``) and consumed from ``state`` (all K of them replace it entirely)."""
    b, s = rows.shape
    rows = rows.astype(jnp.int32)
    lo = jnp.maximum(rows - kernel, 0)  # [B, S] first of the rows that can be in the state
    idx = jnp.minimum(lo[..., None] + jnp.arange(kernel, dtype=jnp.int32), qkv.shape[1] - 1)
    tail = qkv[jnp.arange(b)[:, None, None], idx]  # [B, S, K, C]
    flat = lambda a: a.reshape(b * s, *a.shape[2:])
    first = None if start is None else flat(jnp.asarray(start, jnp.int32)[:, None] + lo)
    out = advance(jnp.repeat(state, s, axis=0), kernel, flat(tail), flat(rows - lo), first)
    return out.reshape(b, s, *out.shape[1:])


def _need_start(start):
    if start is None:
        raise ValueError("the conv state is a ring (K columns, keyed by position): pass the "
                         "rows' first position `start [B]`.")
    return jnp.asarray(start, jnp.int32)
