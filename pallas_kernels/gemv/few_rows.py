"""Pallas (Triton lowering) projection for few rows: ``y = x @ w.T`` at decode and verify.

At one to a few rows a projection is bound by reading ``w [N, K]`` from HBM. Each program
owns ``bn`` output columns, i.e. ``bn`` contiguous rows of ``w``, and streams them in
``bk``-wide steps of K against the (few) activation rows. Three forms of the step:

* ``"fma"``: elementwise ``w * x`` into a float32 ``[bn, bk]`` accumulator per row, one sum
  over ``bk`` at the end (CUDA-core FMAs; no minimum tile);
* ``"fmar"``: the same products summed over ``bk`` at every step into a ``[bn]``
  accumulator per row (fewer registers for several rows; a reduction per step);
* ``"dot"``: the rows broadcast into a ``[16, bk]`` operand (Triton's dot needs >= 16 rows)
  and one MMA per step (loads that feed a dot are the ones Triton software-pipelines).

Every output element is the float32 sum of its ``K`` products, rounded once to ``x.dtype``;
each row is computed the same way whatever the number of rows (checked in interpret mode).

On the H200 (``python -m mtp_jax.bench gemv``, session 10) ``fma`` was the fastest form at one row;
at four rows every form lost to XLA's GEMM, so :func:`pallas_kernels.gemv.gemv` runs the
kernel for one row only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode

F32 = jnp.float32
DOT_ROWS = 16
FORMS = ("fma", "fmar", "dot")


class GemvTiles(NamedTuple):
    """Static tiling: ``bn`` output columns per program, ``bk`` contraction step (both powers
    of two dividing N and K), the step's ``form``, Triton ``num_warps`` / ``num_stages``."""
    bn: int
    bk: int
    form: str = "fma"
    num_warps: int = 4
    num_stages: int = 3


def few_rows_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """XLA reference: ``x [M, K] @ w[N, K].T -> [M, N]`` in ``x.dtype`` (float32 sums)."""
    y = jnp.einsum("mk,nk->mn", x.astype(w.dtype), w, preferred_element_type=F32)
    return y.astype(x.dtype)


def check_tiles(t: GemvTiles, n: int, k: int) -> None:
    """Raises ValueError naming the tile that does not fit ``w [N, K]``."""
    if t.form not in FORMS:
        raise ValueError(f"few-rows projection form {t.form!r} is unknown; use one of {FORMS}.")
    lo = DOT_ROWS if t.form == "dot" else 1
    for name, v, dim, dname in (("bn", t.bn, n, "N"), ("bk", t.bk, k, "K")):
        if v < lo or v & (v - 1) or dim % v:
            raise ValueError(f"few-rows projection tile {name}={v} must be a power of two >= "
                             f"{lo} dividing {dname}={dim}.")


def _fma_kernel(x_ref, w_ref, y_ref, *, rows: int, k: int, bn: int, bk: int,
                reduce_each_step: bool = False):
    j = pl.program_id(0)

    def step(i, accs):
        k0 = pl.multiple_of(i * bk, bk)
        wb = w_ref[:, pl.ds(k0, bk)].astype(F32)
        prods = [wb * x_ref[m, pl.ds(k0, bk)].astype(F32)[None, :] for m in range(rows)]
        if reduce_each_step:
            prods = [jnp.sum(p, axis=1) for p in prods]
        return tuple(a + p for a, p in zip(accs, prods))

    zero = jnp.zeros((bn,) if reduce_each_step else (bn, bk), F32)
    accs = jax.lax.fori_loop(0, k // bk, step, tuple(zero for _ in range(rows)))
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    for m, a in enumerate(accs):
        y_ref[m, cols] = (a if reduce_each_step else jnp.sum(a, axis=1)).astype(y_ref.dtype)


def _dot_kernel(x_ref, w_ref, y_ref, *, rows: int, k: int, bn: int, bk: int):
    j = pl.program_id(0)
    row_id = jax.lax.broadcasted_iota(jnp.int32, (DOT_ROWS, bk), 0)

    def step(i, acc):
        k0 = pl.multiple_of(i * bk, bk)
        xb = jnp.zeros((DOT_ROWS, bk), w_ref.dtype)
        for m in range(rows):
            xm = x_ref[m, pl.ds(k0, bk)].astype(w_ref.dtype)
            xb = jnp.where(row_id == m, xm[None, :], xb)
        wb = w_ref[:, pl.ds(k0, bk)]
        return acc + jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())),
                                         preferred_element_type=F32)

    acc = jax.lax.fori_loop(0, k // bk, step, jnp.zeros((DOT_ROWS, bn), F32))
    out_row = jax.lax.broadcasted_iota(jnp.int32, (DOT_ROWS, bn), 0)
    cols = pl.ds(pl.multiple_of(j * bn, bn), bn)
    for m in range(rows):
        y_ref[m, cols] = jnp.sum(jnp.where(out_row == m, acc, 0.0), axis=0).astype(y_ref.dtype)


def few_rows_matmul(x: jax.Array, w: jax.Array, tiles: GemvTiles, *,
                    interpret: bool | None = None, name: str = "few_rows_matmul") -> jax.Array:
    """``x [M, K] @ w[N, K].T -> [M, N]`` in ``x.dtype``, one Triton kernel.

    Args:
      x: ``[M, K]`` activation rows, ``1 <= M <= 16``; cast to ``w.dtype`` inside the kernel
        (``dot``) or multiplied in float32 (``fma``, ``fmar``).
      w: ``[N, K]`` weight (the HF ``[out, in]`` layout), bf16 / f16 / f32.
      tiles: :class:`GemvTiles` (see :func:`check_tiles`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
      name: the kernel's name in profiles.
    Raises:
      ValueError: mismatched shapes, more than 16 rows, or tiles that do not fit.
    """
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or not 1 <= m <= DOT_ROWS:
        raise ValueError(f"few_rows_matmul: x {x.shape} and w {w.shape} must be [M, K] and "
                         f"[N, K] with 1 <= M <= {DOT_ROWS}.")
    check_tiles(tiles, n, k)
    interpret = interpret_mode(interpret)
    body = {"dot": _dot_kernel, "fma": _fma_kernel,
            "fmar": functools.partial(_fma_kernel, reduce_each_step=True)}[tiles.form]
    return pl.pallas_call(
        functools.partial(body, rows=m, k=k, bn=tiles.bn, bk=tiles.bk),
        grid=(n // tiles.bn,),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)),
                  pl.BlockSpec((tiles.bn, k), lambda j: (j, 0))],
        out_specs=pl.BlockSpec((m, n), lambda j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret, name=name,
    )(x, w)
