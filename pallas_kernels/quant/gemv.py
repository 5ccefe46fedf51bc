"""Pallas (Triton lowering) few-row projection ``y = x @ W.T`` on quantized weights, dequantized
inside the kernel, so that a decode step reads only the quantized bytes of ``W [N, K]``.

The weights come in the device forms of :mod:`pallas_kernels.quant.formats` (``fp8`` with
``(bn, bk)`` block scales, ``nvfp4``). Each program owns ``bn`` output columns (``bn`` rows of
``W``) and streams them in ``bk``-column steps against the (at most 8) activation rows:

    w = dequantized weights of the step (float32), rounded to ``out_dtype``
    y[m] += sum over the step of w * float32(x[m] rounded to out_dtype)

Split K (:mod:`pallas_kernels.quant.gemv_tiles`): with ``S > 1`` slices the grid is
``(N / bn, S)``, program ``(j, s)`` sums only the steps of slice ``s`` into a float32 partial
``[S, M, N]``, and XLA sums the ``S`` partials in float32 afterwards; with ``S = 1`` the
program's sum is the result. Either way every output equals ``x.astype(out_dtype) @
dequantize(...).T`` with float32 sums up to their order (:func:`quant_gemv_reference`; but see
dividing nvfp4 below), rounded once to ``out_dtype``; the split changes only that order, never
a weight's dequantization.

fp8: a step lies inside one scale block (``bk`` divides the block's columns, or the block
spans K), so its scale is one value (``bn`` divides the block's rows) or one per row
(``block = (1, ...)``). W = float32(code) * scale, one rounding, as XLA computes it.

nvfp4: ``codes`` are read as ``[N, K/16, 8]`` bytes (a 16-column group per row of 8) and ``x``
as ``[M, K/16, 8, 2]`` whose last axis, split in the kernel, gives the even columns (low
nibbles) and the odd ones (high nibbles): ``y = x_even . lo + x_odd . hi``, no interleaving
(both reshapes are free in XLA). A nibble ``s eem`` becomes the e4m3 byte ``s 0ee m00`` whose
value is exactly ``e2m1 * 2**-6`` (subnormal ``0.5`` included). Without ``divide``,
``W = (e2m1 * scale) * scale_2`` (the first product exact, one rounding), as XLA computes it.
With ``divide``, ``e2m1 = c * 2**k`` with ``c`` 1 or 3, so ``round(e2m1 * scale / scale_2) =
2**k * round(c * scale / scale_2)``: two correctly rounded quotients per 16-column group
(``div.rn.f32``; Triton's ``/`` is the approximate ``div.full.f32``) and an exact scaling per
weight give the correctly rounded quotient the formats module describes (scales in float32's
normal range). XLA's :func:`dequantize` differs there: its algebraic simplifier turns the
division by the broadcast ``scale_2`` into a product with the rounded reciprocal (seen on the
CPU), one float32 ulp off for about a fifth of the weights, rarely visible in bf16.

Masking: a partial last program of N is masked by Pallas; a K that is not a multiple of ``bk``
gets one masked last step (its weights and activations zeroed), in the last slice of a split.

Measured on an H200 without the split (docs/benchmarks.md, session 32): 1.0-2.5 TB/s of held
bytes for fp8, 0.7-1.0 for nvfp4 (bf16's one-row forms: 4.0-4.5); the split and wider tiles
are not measured yet. :func:`default_tiles` is a first guess (2-4 KiB of codes per program
step); the exact rounding of every weight costs about ten ALU operations per nvfp4 weight,
which may make the kernel ALU-bound at decode.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole
from pallas_kernels.quant.formats import NVFP4_GROUP, QuantFormat, check_parts, dequantize
from pallas_kernels.quant.gemv_tiles import (MAX_ROWS, QuantGemvTiles, check_tiles,
                                             default_tiles, quant_gemv_applies, split_plan)

F32 = jnp.float32
NIBBLE_BYTES = NVFP4_GROUP // 2  # bytes of one nvfp4 group
THIRD_X64 = float(np.float32(1.0 / 3.0)) * 64.0  # 64 * fl(1/3), exact in float32


def quant_gemv_reference(x, fmt: QuantFormat, codes, scale, scale_2, *, out_dtype):
    """XLA composition: ``x.astype(out_dtype) @ dequantize(...).T`` with float32 sums,
    ``[..., N]`` in ``out_dtype``."""
    w = dequantize(fmt, codes, scale, scale_2, out_dtype)
    y = jnp.einsum("...k,nk->...n", x.astype(out_dtype), w, preferred_element_type=F32)
    return y.astype(out_dtype)


def _round(v: jax.Array, dtype) -> jax.Array:
    """``v`` rounded to ``dtype`` (nearest even), back in float32."""
    return v.astype(dtype).astype(F32)


def _div_rn(a: jax.Array, b: jax.Array, interpret: bool) -> jax.Array:
    """Correctly rounded float32 ``a / b`` (same shapes): PTX ``div.rn.f32`` in the Triton
    kernel; in interpret mode XLA's divide, behind an optimization barrier (XLA turns a
    division by a broadcast into a product with the rounded reciprocal, off by an ulp)."""
    if interpret:
        return a / lax.optimization_barrier(b)
    [q] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)])
    return q


def _group_factors(s: jax.Array, s2: jax.Array, *, divide: bool, interpret: bool):
    """Per-group factors of the weights, shared by both nibbles: ``(64 * scale,)``, or with
    ``divide`` ``(scale / scale_2, 3 * scale / scale_2)`` correctly rounded; each ``[bn, G, 1]``
    float32. s: ``[bn, G]`` float32 group scales; s2: ``[bn]`` float32."""
    if not divide:
        return ((s * 64.0)[:, :, None],)
    s2g = jnp.broadcast_to(s2[:, None], s.shape)
    return (_div_rn(s, s2g, interpret)[:, :, None],
            _div_rn(3.0 * s, s2g, interpret)[:, :, None])


def _nibble_weights(codes: jax.Array, mag_bit: int, factors, s2: jax.Array, dtype) -> jax.Array:
    """``[bn, G, 8]`` float32 weights of one nibble of each code byte, rounded to ``dtype``.

    codes: ``[bn, G, 8]`` uint8 with the e2m1 code at bits ``mag_bit .. mag_bit + 3`` (0: the
    even columns, 4: the odd ones); factors: :func:`_group_factors`; s2: ``[bn]`` float32."""
    sign = (codes << 4) & 0x80 if mag_bit == 0 else codes & 0x80
    mag = ((codes >> mag_bit) & 7) << 2
    v = lax.bitcast_convert_type(sign | mag, jnp.float8_e4m3fn).astype(F32)  # e2m1 * 2**-6
    if len(factors) == 1:  # (e2m1 * scale) * scale_2: the first product exact
        return _round(v * factors[0] * s2[:, None, None], dtype)
    q1, q3 = factors
    three = ((mag & 4) != 0) & ((mag & 0x18) != 0)  # e2m1 magnitude 1.5, 3 or 6
    p = v * jnp.where(three, THIRD_X64, 64.0)  # the signed power of two 2**k, exactly
    return _round(p * jnp.where(three, q3, q1), dtype)


def _steps(step, n_full: int, tail: int, chunk: int | None, accs):
    """The program's steps: unmasked ones in a loop, then step ``n_full``, whose first ``tail``
    columns are valid (none when ``tail`` is 0), in a loop of one trip: its start must be
    traced, as a static slice past the array's end is refused when the kernel is traced.

    ``chunk`` None: all ``n_full`` unmasked steps. Else the program's slice of K, ``s =
    program_id(1)``: steps ``s * chunk`` to ``min((s + 1) * chunk, n_full)`` (traced bounds),
    and step ``n_full`` only in the slice holding it (``s == n_full // chunk``)."""
    lo, hi, tail_trips = 0, n_full, 1
    if chunk is not None:
        s = pl.program_id(1)
        lo = s * chunk
        hi = jnp.minimum(lo + chunk, n_full)
        tail_trips = (s == n_full // chunk).astype(jnp.int32)
    if chunk is not None or n_full:
        accs = lax.fori_loop(lo, hi, lambda i, a: step(i, a, None), accs)
    if tail:
        accs = lax.fori_loop(n_full, n_full + tail_trips, lambda i, a: step(i, a, tail), accs)
    return accs


def _valid(shape, axis: int, valid: int) -> jax.Array:
    """``[shape]`` bool: the index along ``axis`` is below ``valid``."""
    return lax.broadcasted_iota(jnp.int32, shape, axis) < valid


def _ds(i, size: int):
    """Step ``i``'s slice (``i`` traced)."""
    return pl.ds(pl.multiple_of(i * size, size), size)


def _row_sums(a: jax.Array) -> jax.Array:
    """``[bn, ...]`` -> ``[bn]``: sums over all axes but the first."""
    return jnp.sum(a, axis=tuple(range(1, a.ndim)))


def _add(accs, prods, reduce_each: bool):
    """Adds each row's products (summed over all axes but the first with ``reduce_each``)."""
    if reduce_each:
        prods = [_row_sums(p) for p in prods]
    return tuple(a + p for a, p in zip(accs, prods))


def _store(y_ref, accs, reduce_each: bool):
    """Writes each row's sums, rounded to the output dtype, to its row of the ``[M, bn]``
    output block (of a split K: the float32 ``[1, M, bn]`` block of the program's slice)."""
    lead = (0,) * (len(y_ref.shape) - 2)
    for m, a in enumerate(accs):
        y_ref[(*lead, m, slice(None))] = (a if reduce_each else _row_sums(a)).astype(y_ref.dtype)


def _fp8_kernel(x_ref, c_ref, s_ref, y_ref, *, rows, k, bn, bk, block, dtype, reduce_each,
                chunk):
    j = pl.program_id(0)
    bn_s, bk_s = block
    srow = None if bn_s == 1 else j // (bn_s // bn)
    steps_per_block = 0 if bk_s >= k else bk_s // bk

    def step(i, accs, valid):
        cols = _ds(i, bk)
        kb = 0 if not steps_per_block else i // steps_per_block
        s = s_ref[:, kb][:, None] if srow is None else s_ref[srow, kb]
        if valid is None:
            codes = c_ref[:, cols]
            xs = [x_ref[m, cols] for m in range(rows)]
        else:
            mask, xmask = _valid((bn, bk), 1, valid), _valid((bk,), 0, valid)
            codes = plgpu.load(c_ref.at[:, cols], mask=mask)
            xs = [plgpu.load(x_ref.at[jnp.int32(m), cols], mask=xmask) for m in range(rows)]
        w = _round(codes.astype(F32) * s, dtype)
        xs = [_round(xm, dtype) for xm in xs]
        if valid is not None:
            w = jnp.where(mask, w, 0.0)
            xs = [jnp.where(xmask, xm, 0.0) for xm in xs]
        return _add(accs, [w * xm[None, :] for xm in xs], reduce_each)

    zero = jnp.zeros((bn,) if reduce_each else (bn, bk), F32)
    _store(y_ref, _steps(step, k // bk, k % bk, chunk, (zero,) * rows), reduce_each)


def _nvfp4_kernel(x_ref, c_ref, s_ref, s2_ref, y_ref, *, rows, groups, bn, tg, divide, dtype,
                  reduce_each, chunk, interpret):
    s2 = s2_ref[...]

    def step(i, accs, valid):
        gs = _ds(i, tg)
        if valid is None:
            codes, s = c_ref[:, gs, :], s_ref[:, gs]
            xs = [x_ref[m, gs, :, :] for m in range(rows)]
        else:
            wmask = _valid((bn, tg, NIBBLE_BYTES), 1, valid)
            xmask = _valid((tg, NIBBLE_BYTES, 2), 0, valid)
            codes = plgpu.load(c_ref.at[:, gs, :], mask=wmask)
            s = plgpu.load(s_ref.at[:, gs], mask=_valid((bn, tg), 1, valid))
            xs = [plgpu.load(x_ref.at[jnp.int32(m), gs, :, :], mask=xmask) for m in range(rows)]
        factors = _group_factors(s.astype(F32), s2, divide=divide, interpret=interpret)
        lo, hi = (_nibble_weights(codes, b, factors, s2, dtype) for b in (0, 4))
        xs = [_round(xm, dtype) for xm in xs]
        if valid is not None:
            lo, hi = jnp.where(wmask, lo, 0.0), jnp.where(wmask, hi, 0.0)
            xs = [jnp.where(xmask, xm, 0.0) for xm in xs]
        prods = []
        for xm in xs:
            xe, xo = jnp.unstack(xm, axis=-1)
            prods.append(lo * xe[None] + hi * xo[None])
        return _add(accs, prods, reduce_each)

    zero = jnp.zeros((bn,) if reduce_each else (bn, tg, NIBBLE_BYTES), F32)
    _store(y_ref, _steps(step, groups // tg, groups % tg, chunk, (zero,) * rows), reduce_each)


@functools.partial(jax.jit, static_argnames=("fmt", "out_dtype", "tiles", "interpret"))
def quant_gemv_pallas(x, codes, scale, scale_2, *, fmt: QuantFormat, out_dtype,
                      tiles: QuantGemvTiles, interpret: bool = False):
    """The kernel on ``x [M, K]`` (``1 <= M <= 8``); ``[M, N]`` in ``out_dtype``. Arguments as
    :func:`quant_gemv`, tiles checked by :func:`check_tiles`; K split as
    :func:`~pallas_kernels.quant.gemv_tiles.split_plan` says."""
    m, k = x.shape
    n = check_parts(fmt, codes, scale, scale_2)
    check_tiles(fmt, n, k, m, tiles)
    bn = tiles.bn
    n_split, chunk = split_plan(fmt, n, k, tiles)
    rows_spec = lambda *tail: pl.BlockSpec((bn, *tail), lambda j, s: (j,) + (0,) * len(tail))
    common = dict(rows=m, bn=bn, dtype=jnp.dtype(out_dtype), reduce_each=tiles.reduce_each,
                  chunk=None if n_split == 1 else chunk)
    if fmt.kind == "fp8":
        body = functools.partial(_fp8_kernel, k=k, bk=tiles.bk, block=fmt.block, **common)
        s_spec = whole(scale.shape) if fmt.block[0] != 1 else rows_spec(scale.shape[1])
        args, specs = (x, codes, scale), [whole(x.shape), rows_spec(k), s_spec]
    else:
        groups = k // NVFP4_GROUP
        body = functools.partial(_nvfp4_kernel, groups=groups, tg=tiles.bk // NVFP4_GROUP,
                                 divide=fmt.divide, interpret=interpret, **common)
        args = (x.reshape(m, groups, NIBBLE_BYTES, 2),
                codes.reshape(n, groups, NIBBLE_BYTES), scale, scale_2)
        specs = [whole(args[0].shape), rows_spec(groups, NIBBLE_BYTES), rows_spec(groups),
                 rows_spec()]
    if n_split == 1:
        out_spec = pl.BlockSpec((m, bn), lambda j, s: (0, j))
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
    else:
        out_spec = pl.BlockSpec((1, m, bn), lambda j, s: (s, 0, j))
        out_shape = jax.ShapeDtypeStruct((n_split, m, n), F32)
    y = pl.pallas_call(
        body,
        grid=(pl.cdiv(n, bn), n_split),
        in_specs=specs,
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret, name=f"quant_gemv_{fmt.kind}",
    )(*args)
    return y if n_split == 1 else jnp.sum(y, axis=0).astype(out_dtype)


def quant_gemv(x, fmt: QuantFormat, codes, scale, scale_2, *, out_dtype,
               tiles: QuantGemvTiles | None = None, interpret: bool | None = None):
    """``x [..., K] @ W.T -> [..., N]`` in ``out_dtype`` with ``W`` dequantized in the kernel.

    Args:
      x: ``[..., K]`` activations, at most 8 rows once the leading dims are flattened; cast to
        ``out_dtype`` in the kernel.
      fmt: the weights' :class:`QuantFormat` (``in_features == K``).
      codes, scale, scale_2: the device parts (:meth:`QuantFormat.shapes`; ``scale_2`` is
        ``None`` for fp8).
      out_dtype: the model dtype: the dequantized weights are rounded to it (as
        :func:`dequantize` rounds them) and so is the result.
      tiles: :class:`QuantGemvTiles` (default :func:`default_tiles`, whose ``split_k = 0``
        splits a long K over few output columns: :func:`~pallas_kernels.quant.gemv_tiles.
        auto_split`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``[..., N]`` in ``out_dtype``: :func:`quant_gemv_reference` up to the order of its float32
      sums (and, for nvfp4 with ``divide``, XLA's rounded reciprocal: see the module
      docstring).
    Raises:
      ValueError: parts of the wrong shape or dtype or stacked (``[E, N, ...]``), more than 8
        rows, ``K != in_features``, tiles that do not fit the scale blocks
        (:func:`check_tiles`).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = math.prod(lead)
    n = check_parts(fmt, codes, scale, scale_2)
    if codes.ndim != 2:
        raise ValueError(f"quant_gemv: takes one matrix, got stacked codes {codes.shape}.")
    tiles = tiles or default_tiles(fmt, n, k, rows)
    check_tiles(fmt, n, k, rows, tiles)
    y = quant_gemv_pallas(x.reshape(rows, k), codes, scale, scale_2, fmt=fmt,
                          out_dtype=jnp.dtype(out_dtype), tiles=tiles,
                          interpret=interpret_mode(interpret))
    return y.reshape(*lead, n)


__all__ = ["MAX_ROWS", "QuantGemvTiles", "check_tiles", "default_tiles", "quant_gemv",
           "quant_gemv_applies", "quant_gemv_pallas", "quant_gemv_reference", "split_plan"]
