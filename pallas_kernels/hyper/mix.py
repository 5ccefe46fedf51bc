"""The hyper-connection mix of qwen4_exp as two Pallas (Triton) kernels, for calls of a few rows
(decode, verify and draft steps).

XLA runs the mix (:mod:`pallas_kernels.hyper.reference`) before every block as about nine
small kernels (the previous block's inject add, the streams' sums of squares, converts, the
low-rank down and inject projections, the up projection with the weighted mean), about 18 us
at one row on the H200 for 6 us of weight bytes (docs/benchmarks.md, session 36): latency,
not bytes. Here it is two:

* :func:`hyper_down` (kernel A, a program per ``bn`` rows of ``[w_down; w_inj]`` and stream
  ``s``): the pending inject ``h + inj_prev * y_prev`` (optional) on stream ``s``, its RMS
  statistic, and stream ``s``'s part of the projections ``d = hn @ [w_down; w_inj].T`` (float32
  partials ``[hc, M, r + hc]``). The norm is per stream, so a program reads only its stream of
  ``h`` (``H`` values a row) and waits for no other; programs ``(0, s)`` write ``h`` and the
  statistics ``rs``.
* :func:`hyper_up` (kernel B, ``H / bj`` programs): the partials summed and rounded once (the
  projection's output), ``silu(d / hc)``, the up projection for its ``bj`` columns of every
  stream, ``sigmoid``, the normalised streams and their mean: the block input ``x``; program 0
  writes ``inj = 2 * sigmoid(d_inj / hc)``.

Every rounding is the reference's (the model dtype after each elementwise op, float32 sums
rounded once), so the results equal :func:`hyper_mix_reference` up to the order of float32
sums. Rows are unrolled (at most :data:`MAX_ROWS`); calls with more rows take XLA.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole

F32 = jnp.float32
MAX_ROWS = 8


class HyperTiles(NamedTuple):
    """Kernel A: ``bn`` projection rows per program (one program per ``bn`` rows and stream),
    ``bk`` columns of a stream per step (a power of two dividing H), ``warps_a`` (Triton).
    Kernel B: ``bj`` columns of each stream per program, ``bkr`` columns of ``r`` per step,
    ``warps_b``."""
    bn: int = 4
    bk: int = 512
    warps_a: int = 4
    bj: int = 8
    bkr: int = 64
    warps_b: int = 4


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two up to ``cap`` dividing ``n``."""
    b = cap
    while n % b:
        b //= 2
    return b


def default_tiles(hidden: int, r: int) -> HyperTiles:
    """First tiles (not yet swept): ``bk`` the largest power of two up to 512 dividing H,
    ``bkr`` up to 64 dividing r, ``bn`` 4, ``bj`` 8 (both halved until they divide)."""
    return HyperTiles(bn=_pow2_divisor(r, 4), bk=_pow2_divisor(hidden, 512),
                      bj=_pow2_divisor(hidden, 8), bkr=_pow2_divisor(r, 64))


def unsupported(rows: int, hc: int, hidden: int, r: int) -> str | None:
    """Why the kernels cannot take the shape (naming the value and the rule), or ``None``: they
    take 1 to :data:`MAX_ROWS` rows, a power-of-two stream count, a width H and a rank r that
    are multiples of 16 (Triton blocks are powers of two of at least 16) and at most 16 steps
    of :func:`default_tiles`' ``bk`` over H and ``bkr`` over r (the steps are unrolled)."""
    t = default_tiles(hidden, r)
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (the kernels take 1 to {MAX_ROWS}; XLA takes more)"
    if hc < 1 or hc & (hc - 1):
        return f"hc_count {hc} is not a power of two"
    if hidden % 16 or hidden // t.bk > 16:
        return (f"hidden_size {hidden} is not a multiple of 16 of at most 16 steps of "
                f"{t.bk} columns")
    if r % 16 or r // t.bkr > 16:
        return f"hc_lowrank {r} is not a multiple of 16 of at most 16 steps of {t.bkr} columns"
    return None


def supports(rows: int, hc: int, hidden: int, r: int) -> bool:
    """Whether :func:`unsupported` finds nothing."""
    return unsupported(rows, hc, hidden, r) is None


def _round(v, dtype):
    return v.astype(dtype).astype(F32)


def _sigmoid(v, dtype):
    """``jax.nn.sigmoid`` of a value already in ``dtype``, rounded to it."""
    return _round(1.0 / (1.0 + jnp.exp(-v)), dtype)


def _at(start, size: int):
    """``pl.ds(start, size)``, ``start`` hinted a multiple of ``size`` when traced."""
    return pl.ds(start if isinstance(start, int) else pl.multiple_of(start, size), size)


def _pick(vec, lane, s):
    """``vec[s]`` of a small float32 vector, ``s`` static or traced."""
    return jnp.sum(jnp.where(lane == s, vec, 0.0))


def _call(kernel, grid, args, out_shape, warps: int, interpret: bool, name: str):
    """``pl.pallas_call`` of ``kernel`` over ``grid`` with every array whole (the kernels
    index their pieces themselves)."""
    return pl.pallas_call(
        kernel, grid=grid, in_specs=[whole(a.shape) for a in args],
        out_specs=[whole(s.shape) for s in out_shape], out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret, name=name)(*args)


def _down_kernel(*refs, rows, hc, hidden, r, inj, pending, bn, bk, eps):
    it = iter(refs)
    h_ref = next(it)
    ip_ref, y_ref = (next(it), next(it)) if pending else (None, None)
    nw_ref, wd_ref = next(it), next(it)
    wi_ref = next(it) if inj else None
    dp_ref, rs_ref = next(it), next(it)
    ho_ref = next(it) if pending else None
    dt = h_ref.dtype
    j, s = pl.program_id(0), pl.program_id(1)
    lane = lax.broadcasted_iota(jnp.int32, (hc,), 0)
    base = s * hidden
    steps = [_at(base + p * bk, bk) for p in range(hidden // bk)]
    inj_s = [_pick(ip_ref[m, :].astype(F32), lane, s) for m in range(rows)] if pending else None

    def piece(m, p):
        """Row m's stream s (after the pending inject), step p of bk columns, float32."""
        h = h_ref[m, steps[p]].astype(F32)
        if pending:
            y = y_ref[m, pl.ds(p * bk, bk)].astype(F32)
            h = _round(h + _round(inj_s[m] * y, dt), dt)
        return h

    hs = [[piece(m, p) for p in range(len(steps))] for m in range(rows)]
    rs = [lax.rsqrt(sum(jnp.sum(v * v) for v in hs[m]) / hidden + eps) for m in range(rows)]

    @pl.when(j == 0)
    def _():
        for m in range(rows):
            plgpu.store(rs_ref.at[jnp.int32(m), :], jnp.full((hc,), rs[m], F32),
                        mask=lane == s)
            if pending:
                for p, cols in enumerate(steps):
                    ho_ref[m, cols] = hs[m][p].astype(dt)

    def project(w_ref, row0, n_out, col0):
        acc = [jnp.zeros((n_out,), F32) for _ in range(rows)]
        for p, cols in enumerate(steps):
            w = w_ref[pl.ds(row0, n_out), cols].astype(F32)
            g = 1.0 + nw_ref[cols].astype(F32)
            for m in range(rows):
                hn = _round(hs[m][p] * rs[m] * g, dt)
                acc[m] = acc[m] + jnp.sum(w * hn[None, :], axis=1)
        for m in range(rows):
            dp_ref[s, m, pl.ds(col0, n_out)] = acc[m]

    nd = r // bn

    @pl.when(j < nd)
    def _():
        row0 = pl.multiple_of(j * bn, bn)
        project(wd_ref, row0, bn, row0)

    if inj:
        @pl.when(j == nd)
        def _():
            project(wi_ref, 0, hc, r)


@functools.partial(jax.jit, static_argnames=("hc", "eps", "tiles", "interpret"))
def hyper_down(h, pending, nw, w_down, w_inj, *, hc: int, eps: float, tiles: HyperTiles,
               interpret: bool = False):
    """Kernel A on ``h [M, hc*H]`` (M <= :data:`MAX_ROWS`), program ``(j, s)`` for ``bn``
    projection rows and stream ``s``: returns ``(h [M, hc*H] after the pending inject (``h``
    itself without one), dp [hc, M, r (+ hc)] float32 (each stream's part of the down, then
    the inject projection; their sum is the projection), rs [M, hc] float32)``. Arguments as
    :func:`~pallas_kernels.hyper.reference.hyper_mix_reference`."""
    rows, w = h.shape
    hidden, r = w // hc, w_down.shape[0]
    inj = w_inj is not None
    args = [h] + (list(pending) if pending is not None else []) + [nw, w_down] + (
        [w_inj] if inj else [])
    out_shape = [jax.ShapeDtypeStruct((hc, rows, r + (hc if inj else 0)), F32),
                 jax.ShapeDtypeStruct((rows, hc), F32)]
    if pending is not None:
        out_shape.append(jax.ShapeDtypeStruct((rows, w), h.dtype))
    kernel = functools.partial(_down_kernel, rows=rows, hc=hc, hidden=hidden, r=r, inj=inj,
                               pending=pending is not None, bn=tiles.bn, bk=tiles.bk, eps=eps)
    res = _call(kernel, (r // tiles.bn + (1 if inj else 0), hc), args, out_shape,
                tiles.warps_a, interpret, "hyper_down")
    return (res[2] if pending is not None else h), res[0], res[1]


def _up_kernel(*refs, rows, hc, hidden, r, inj, bj, bkr):
    it = iter(refs)
    dp_ref, h_ref, rs_ref, nw_ref, wu_ref = (next(it) for _ in range(5))
    x_ref = next(it)
    inj_ref = next(it) if inj else None
    dt = h_ref.dtype
    j = pl.program_id(0)
    lane = lax.broadcasted_iota(jnp.int32, (hc,), 0)
    col0 = pl.multiple_of(j * bj, bj)
    d = lambda m, cols: _round(sum(dp_ref[t, m, cols] for t in range(hc)), dt)  # one rounding
    act = []
    for m in range(rows):
        pieces = []
        for q in range(r // bkr):
            a = _round(d(m, pl.ds(q * bkr, bkr)) / hc, dt)
            pieces.append(_round(a * _sigmoid(a, dt), dt))
        act.append(pieces)
    rs = [rs_ref[m, :] for m in range(rows)]
    acc = [jnp.zeros((bj,), F32) for _ in range(rows)]
    for s in range(hc):
        cols = pl.ds(s * hidden + col0, bj)
        up = [jnp.zeros((bj,), F32) for _ in range(rows)]
        for q in range(r // bkr):
            w = wu_ref[cols, pl.ds(q * bkr, bkr)].astype(F32)
            up = [up[m] + jnp.sum(w * act[m][q][None, :], axis=1) for m in range(rows)]
        g = 1.0 + nw_ref[cols].astype(F32)
        for m in range(rows):
            hn = _round(h_ref[m, cols].astype(F32) * _pick(rs[m], lane, s) * g, dt)
            acc[m] = acc[m] + _round(_sigmoid(_round(up[m], dt), dt) * hn, dt)
    for m in range(rows):
        x_ref[m, pl.ds(col0, bj)] = (acc[m] / hc).astype(dt)
    if inj:
        @pl.when(j == 0)
        def _():
            for m in range(rows):
                z = _round(d(m, pl.ds(r, hc)) / hc, dt)
                inj_ref[m, :] = (2.0 * _sigmoid(z, dt)).astype(dt)


@functools.partial(jax.jit, static_argnames=("hc", "inj", "tiles", "interpret"))
def hyper_up(dp, h, rs, nw, w_up, *, hc: int, inj: bool, tiles: HyperTiles,
             interpret: bool = False):
    """Kernel B: ``dp [hc, M, r (+ hc)]`` and ``rs`` of :func:`hyper_down`, ``h [M, hc*H]`` (after
    the pending inject), ``nw [hc*H]``, ``w_up [hc*H, r]``. Returns ``(x [M, H], inj [M, hc]
    or None)`` in h's dtype."""
    rows, w = h.shape
    hidden, r = w // hc, w_up.shape[1]
    args = [dp, h, rs, nw, w_up]
    out_shape = [jax.ShapeDtypeStruct((rows, hidden), h.dtype)] + (
        [jax.ShapeDtypeStruct((rows, hc), h.dtype)] if inj else [])
    kernel = functools.partial(_up_kernel, rows=rows, hc=hc, hidden=hidden, r=r, inj=inj,
                               bj=tiles.bj, bkr=tiles.bkr)
    res = _call(kernel, (hidden // tiles.bj,), args, out_shape, tiles.warps_b, interpret,
                "hyper_up")
    return res[0], (res[1] if inj else None)


def hyper_mix(h, pending, nw, w_down, w_inj, w_up, *, hc: int, eps: float,
              tiles: HyperTiles | None = None, interpret: bool | None = None):
    """The hyper-connection mix before a block in two kernels.

    Args:
      h: ``[..., hc*H]`` the residual streams (its dtype is the results'); at most
        :data:`MAX_ROWS` rows in all.
      pending: ``(inj_prev [..., hc], y_prev [..., H])``, the previous block's inject folded
        in, or ``None``.
      nw: ``[hc*H]`` the zero-centred norm weight.
      w_down, w_inj, w_up: ``[r, hc*H]``, ``[hc, hc*H]`` or ``None``, ``[hc*H, r]``.
      hc, eps: the stream count and the norm's epsilon.
      tiles: :class:`HyperTiles` (default :func:`default_tiles`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(h, x [..., H], inj [..., hc] or None)``, as
      :func:`~pallas_kernels.hyper.reference.hyper_mix_reference`.
    Raises:
      ValueError: a shape :func:`supports` does not take, or mismatched arrays.
    """
    lead, w = h.shape[:-1], h.shape[-1]
    rows = math.prod(lead)
    r, hidden = w_down.shape[0], w // hc
    if (w % hc or w_down.shape != (r, w) or w_up.shape != (w, r) or nw.shape != (w,)
            or (w_inj is not None and w_inj.shape != (hc, w))):
        raise ValueError(f"hyper_mix: h {h.shape}, nw {nw.shape}, w_down {w_down.shape}, "
                         f"w_inj {None if w_inj is None else w_inj.shape}, w_up {w_up.shape} "
                         f"do not fit {hc} streams.")
    why = unsupported(rows, hc, hidden, r)
    if why:
        raise ValueError(f"hyper_mix: not a shape the kernels take: {why}.")
    interpret = interpret_mode(interpret)
    tiles = tiles or default_tiles(hidden, r)
    flat = lambda a, n: a.reshape(rows, n)
    pend = None if pending is None else (flat(pending[0], hc).astype(h.dtype),
                                         flat(pending[1], hidden).astype(h.dtype))
    h2, dp, rs = hyper_down(flat(h, w), pend, nw, w_down, w_inj, hc=hc, eps=float(eps),
                           tiles=tiles, interpret=interpret)
    x, inj = hyper_up(dp, h2, rs, nw, w_up, hc=hc, inj=w_inj is not None, tiles=tiles,
                      interpret=interpret)
    return (h2.reshape(h.shape), x.reshape(*lead, hidden),
            None if inj is None else inj.reshape(*lead, hc))


__all__ = ["MAX_ROWS", "HyperTiles", "default_tiles", "hyper_down", "hyper_mix", "hyper_up",
           "supports", "unsupported"]
