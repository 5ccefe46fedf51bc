"""``gemv``: a projection ``x @ w.T``, by backend: ``xla`` (XLA's ``dot``), ``reduce`` (XLA's
multiply-reduce form for one row, :mod:`pallas_kernels.gemv.reduce_form`: the fastest form
measured on every one-row shape with K <= 8192) or ``pallas`` (the few-rows Triton kernel for
one row and wide outputs). Calls a backend does not cover take XLA's ``dot``.

The Pallas kernel, measured on the H200 (bf16, one row, session 10; ``docs/benchmarks.md``;
``reduce`` was faster than it on every shape in session 11):

* ``python -m mtp_jax.bench gemv`` (profiler device time per call, best tiles): the kernel beat
  XLA on the 2B gate/up (14.1 against 16.1 us), GDN in-projection (10.3 against 12.9 us) and
  q/k/v (7.1 against 12.6 us; XLA times from the engine's profile), matched it on the 27B
  gate/up (85.8 against 87.1 us; 4.2 TB/s) and down projection (44.6 against 46.2 us; the
  engine does not route the down projection here: it is not merged), and lost at 2048 output
  columns (2B down 9.9 against 8.7 us, o_proj 4.5 against 3.7 us) and at four rows on every
  shape; so XLA keeps those.
* In the 2B decode step (``python -m mtp_jax.bench profile``): gate/up 15.5 against 16.1 us, GDN
  in-projection 11.4 against 12.9 us, attention q/k/v 7.2 against 12.6 us; device time per
  step 1.582 -> 1.542 ms.
* The 27B decode step with this kernel (then with 16-column tiles, see :func:`default_tiles`)
  and the fused norm: 14.66 against 13.46 ms with XLA; session 11 (4-column tiles, this
  kernel alone): 13.88 against 13.77 ms.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.gemv.few_rows import GemvTiles, few_rows_matmul
from pallas_kernels.gemv.reduce_form import reduce_applies, reduce_matmul

BACKENDS = ("xla", "reduce", "pallas", "fused")
MIN_COLUMNS = 4096  # output columns below which XLA wins (too few programs to fill the card)
PROGRAM_ELEMENTS = 16384  # weights a program reads (bn x K): 32 KB in bf16


def default_tiles(n: int, k: int) -> GemvTiles | None:
    """Tiles for one row of ``w [N, K]``, or ``None`` where XLA keeps the projection: N below
    :data:`MIN_COLUMNS` or not a multiple of 4, K not a multiple of 256.

    ``bn``: the widest of 16, 8, 4 dividing N whose ``bn x K`` block stays within
    :data:`PROGRAM_ELEMENTS` (else 4); ``bk``: 512 where it divides K, else 256. In the
    session-10 sweep (one row): the best tiles on both 27B shapes (bn 4; bn 16 was about
    4-12% slower there, and slower than XLA), within 6% of the best on the 2B gate/up and
    q/k/v (bn 8), and on the 2B
    GDN in-projection (bn 8) outside the sweep's 12 fastest (above 10.75 against 10.26 us),
    though 11.4 against XLA's 12.9 us in the engine. The engine runs of that session used
    these tiles on the 2B shape except q/k/v (bn 4 then).
    """
    if n < MIN_COLUMNS or n % 4 or k % 256:
        return None
    bn = next((b for b in (16, 8) if n % b == 0 and b * k <= PROGRAM_ELEMENTS), 4)
    return GemvTiles(bn, 512 if k % 512 == 0 else 256, "fma", 4, 3)


def gemv(x: jax.Array, w: jax.Array, *, backend: str = "xla",
         interpret: bool | None = None) -> jax.Array:
    """``x [..., K] @ w[N, K].T -> [..., N]`` in ``w.dtype`` (``x`` is cast to it first), float32
    sums.

    ``backend="reduce"`` (and ``"fused"``, whose add + norm + projection fusion the layers
    call themselves: :func:`pallas_kernels.gemv.norm_gemv.norm_gemv`) runs
    :func:`reduce_matmul` where
    :func:`pallas_kernels.gemv.reduce_form.reduce_applies` (one row, K <= 8192);
    ``backend="pallas"`` runs :func:`few_rows_matmul` when ``x`` holds one row and
    :func:`default_tiles` fits ``w``; every other call is XLA's einsum. ``interpret``: Pallas
    interpret mode (``None``: when the default device is not a GPU).
    Raises ValueError for an unknown backend or mismatched K.
    """
    if backend not in BACKENDS:
        raise ValueError(f"gemv: backend {backend!r} is unknown; use one of {BACKENDS}.")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"gemv: x {x.shape} and w {w.shape} must be [..., K] and [N, K].")
    x = x.astype(w.dtype)
    if backend in ("reduce", "fused") and reduce_applies(x.shape, w.shape):
        return reduce_matmul(x, w)
    tiles = default_tiles(n, k)
    if backend != "pallas" or tiles is None or math.prod(x.shape[:-1]) != 1:
        return jnp.einsum("...k,nk->...n", x, w)
    y = few_rows_matmul(x.reshape(1, k), w, tiles, interpret=interpret)
    return y.reshape(*x.shape[:-1], n)


__all__ = ["BACKENDS", "default_tiles", "gemv"]
