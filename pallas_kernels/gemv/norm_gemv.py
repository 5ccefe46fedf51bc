"""One-row projection with the residual add + RMSNorm before it and (optionally) SwiGLU after it,
as one Triton kernel: at batch-1 decode the three ops around a projection are each a kernel of
1-2 us on the H200 (latency, not bytes), as long as a fifth of the projection itself.

    h  = x + delta                                    (delta cast to x's dtype, the sum rounded
                                                       to it: the model's residual add)
    hn = h / sqrt(mean(h^2) + eps) * (1 + nw)         (float32, rounded to x's dtype)
    p  = hn @ w.T                                     (float32 sums, rounded once)
    y  = p                      (act=None)
    y  = silu(p[:I]) * p[I:]    (act="silu_mul"; w = [gate; up], 2I rows; silu and the product
                                 rounded as XLA rounds jax.nn.silu(gate) * up in x's dtype)

(HF ``Qwen3_5RMSNorm`` then ``Qwen3_5MLP``'s ``gate_proj`` / ``up_proj``, or a mixer's
in-projection.) Every program recomputes the norm of the row (``K`` elements from L2; the
weights it streams are ``bn x K``), so no program waits for another; program 0 writes ``h``.

The results equal :func:`norm_gemv_reference` up to the order of the float32 sums (the norm's
and the projection's), i.e. the last bit of a rounded value.

Measured on the H200 (bf16, session 15, ``bench gemv --parts norm``: 16 chained layers,
device time per layer): the 2B MLP (gate/up 12288 x 2048 with SwiGLU) 17.1-17.2 us against
17.15-17.18 for the three kernels it replaces (norm, XLA's multiply-reduce projection at about
13.7, SwiGLU); the 2B GDN in-projection (8224 x 2048, no act) 12.3 against 12.2. The
projection itself streams the weights more slowly than XLA's multiply-reduce form; the kernel
saves only the launches between the three. In the 2B decode step (``--gemv-backend fused``,
the MLPs only): 1.345 -> 1.328 ms on one machine, 1.297 -> 1.321 on another (two A/B pairs each),
so ``auto`` does not take it; with the GDN in-projections fused as well, 1.313 -> 1.351 (not
kept).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole

F32 = jnp.float32
ACTS = (None, "silu_mul")


class NormGemvTiles(NamedTuple):
    """``bn`` output columns per program (a power of two dividing the output width), ``bk``
    the contraction piece (a power of two dividing K), Triton ``num_warps``, how many pieces
    of its weights a program loads before the norm (``preload``), and whether each piece's
    products are summed over ``bk`` at once (``reduce_each``: a ``[bn]`` accumulator instead of
    ``[bn, bk]``)."""
    bn: int = 8
    bk: int = 1024
    num_warps: int = 4
    preload: int = 0
    reduce_each: bool = False


def default_tiles(out: int, k: int, act: str | None) -> NormGemvTiles:
    """Tiles within 1% of the fastest measured on the H200 (``bench gemv --parts norm``,
    2B shapes, one row; the sweep's spread was 17.2-20 us on the MLP): ``bn`` 16 with SwiGLU
    (two weight blocks per program), else 8, halved until it divides the output width; ``bk``
    the largest power of two up to 1024 dividing K; 4 warps; weights loaded after the norm;
    ``[bn, bk]`` accumulators."""
    bn = 16 if act == "silu_mul" else 8
    while out % bn:
        bn //= 2
    bk = 1024
    while k % bk:
        bk //= 2
    return NormGemvTiles(bn, bk, 4, 0, False)


def norm_gemv_reference(x, delta, nw, w, eps: float, act: str | None = None):
    """XLA reference of :func:`norm_gemv`: ``(h, y)``."""
    h = x if delta is None else (x.astype(F32) + delta.astype(x.dtype).astype(F32)).astype(
        x.dtype)
    h32 = h.astype(F32)
    hn = (h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
          * (1.0 + nw.astype(F32))).astype(x.dtype)
    p = jnp.einsum("...k,nk->...n", hn, w.astype(x.dtype), preferred_element_type=F32)
    p = p.astype(x.dtype)
    if act == "silu_mul":
        i = w.shape[0] // 2
        p = jax.nn.silu(p[..., :i]) * p[..., i:]
    return h, p


def _silu_mul(g: jax.Array, u: jax.Array, dtype) -> jax.Array:
    """``silu(g) * u`` rounded to ``dtype`` after each op as XLA rounds ``jax.nn.silu(g) * u``
    on 16-bit values (exp, 1 + e, 1 / a, g * s, the product with u; bit for bit on the CPU)."""
    rnd = lambda a: a.astype(dtype).astype(F32)
    g32, u32 = g.astype(F32), u.astype(F32)
    sig = rnd(1.0 / rnd(1.0 + rnd(jnp.exp(-g32))))
    return (rnd(g32 * sig) * u32).astype(dtype)


def _kernel(*refs, has_delta: bool, act: str | None, k: int, bn: int, bk: int, eps: float,
            preload: int, reduce_each: bool):
    x_ref, *refs = refs
    d_ref = refs.pop(0) if has_delta else None
    nw_ref, *refs = refs
    n_w = 2 if act == "silu_mul" else 1
    w_refs, outs = refs[:n_w], refs[n_w:]
    h_ref = outs[0] if has_delta else None
    y_ref = outs[-1]
    j = pl.program_id(0)
    pieces = [pl.ds(p * bk, bk) for p in range(k // bk)]
    loaded = [[w[:, c] for c in pieces[:preload]] for w in w_refs]

    hs, total = [], jnp.zeros((), F32)
    for c in pieces:
        h = x_ref[0, c]
        if has_delta:
            h = (h.astype(F32) + d_ref[0, c].astype(F32)).astype(x_ref.dtype)

            @pl.when(j == 0)
            def _():
                h_ref[0, c] = h
        h32 = h.astype(F32)
        hs.append(h32)
        total = total + jnp.sum(h32 * h32)
    scale = lax.rsqrt(total / k + eps)

    accs = [jnp.zeros((bn,) if reduce_each else (bn, bk), F32) for _ in w_refs]
    for p, c in enumerate(pieces):
        xn = (hs[p] * scale * (1.0 + nw_ref[c].astype(F32))).astype(x_ref.dtype).astype(F32)
        for i, w in enumerate(w_refs):
            wp = loaded[i][p] if p < preload else w[:, c]
            prod = wp.astype(F32) * xn[None, :]
            accs[i] = accs[i] + (jnp.sum(prod, axis=1) if reduce_each else prod)
    ys = [(a if reduce_each else jnp.sum(a, axis=1)).astype(x_ref.dtype) for a in accs]
    y = _silu_mul(ys[0], ys[1], x_ref.dtype) if act == "silu_mul" else ys[0]
    y_ref[0, pl.ds(pl.multiple_of(j * bn, bn), bn)] = y


def supports(w_shape, act: str | None) -> bool:
    """Whether the kernel takes ``w [N, K]`` with :func:`default_tiles` in at most 16 pieces of
    K (so it compiles in seconds; a model whose shapes do not fit keeps the unfused ops), and
    an even N with SwiGLU."""
    n, k = w_shape
    if act == "silu_mul" and n % 2:
        return False
    t = default_tiles(n // 2 if act == "silu_mul" else n, k, act)
    return k // t.bk <= 16


def check_norm_gemv(x_shape, w_shape, act, tiles: NormGemvTiles) -> None:
    """Raises ValueError naming the shape or tile that :func:`norm_gemv` cannot take."""
    n, k = w_shape
    if act not in ACTS:
        raise ValueError(f"norm_gemv: act {act!r} is unknown; use one of {ACTS}.")
    if tuple(x_shape) != (1, k):
        raise ValueError(f"norm_gemv: x {tuple(x_shape)} must be one row [1, K] of w {w_shape}.")
    out = n // 2 if act == "silu_mul" else n
    if act == "silu_mul" and n % 2:
        raise ValueError(f"norm_gemv: act='silu_mul' needs an even number of rows [gate; up], "
                         f"got {n}.")
    for name, v, dim, dname in (("bn", tiles.bn, out, "the output width"),
                                ("bk", tiles.bk, k, "K")):
        if v < 1 or v & (v - 1) or dim % v:
            raise ValueError(f"norm_gemv: tile {name}={v} must be a power of two dividing "
                             f"{dname} ({dim}).")


@functools.partial(jax.jit, static_argnames=("eps", "act", "tiles", "interpret"))
def norm_gemv_pallas(x, delta, nw, w, *, eps: float, act: str | None,
                     tiles: NormGemvTiles, interpret: bool = False):
    """The kernel on ``x [1, K]``; arguments and results as :func:`norm_gemv`."""
    n, k = w.shape
    check_norm_gemv(x.shape, w.shape, act, tiles)
    has_delta = delta is not None
    out = n // 2 if act == "silu_mul" else n
    bn = tiles.bn
    args = [x] + ([delta.astype(x.dtype)] if has_delta else []) + [nw]
    specs = [whole(a.shape) for a in args]
    if act == "silu_mul":
        args += [w, w]
        specs += [pl.BlockSpec((bn, k), lambda j: (j, 0)),
                  pl.BlockSpec((bn, k), lambda j: (j + out // bn, 0))]
    else:
        args.append(w)
        specs.append(pl.BlockSpec((bn, k), lambda j: (j, 0)))
    out_shape = ([jax.ShapeDtypeStruct((1, k), x.dtype)] if has_delta else []) + [
        jax.ShapeDtypeStruct((1, out), x.dtype)]
    res = pl.pallas_call(
        functools.partial(_kernel, has_delta=has_delta, act=act, k=k, bn=bn, bk=tiles.bk,
                          eps=eps, preload=tiles.preload, reduce_each=tiles.reduce_each),
        grid=(out // bn,),
        in_specs=specs,
        out_specs=[whole(s.shape) for s in out_shape],
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=1),
        interpret=interpret,
        name="norm_gemv" + ("_silu_mul" if act else ""),
    )(*args)
    return (res[0], res[1]) if has_delta else (x, res[0])


def norm_gemv(x, delta, nw, w, eps: float, *, act: str | None = None,
              tiles: NormGemvTiles | None = None, interpret: bool | None = None):
    """Residual add, zero-centred RMSNorm and a one-row projection (with SwiGLU) in one kernel.

    Args:
      x: ``[..., K]`` one row of the residual stream (its dtype is the results').
      delta: ``[..., K]`` the block output to add, or ``None``.
      nw: ``[K]`` the zero-centred norm weight (scale ``1 + nw``).
      w: ``[N, K]`` the projection (HF ``[out, in]``); ``[gate; up]`` with ``act="silu_mul"``.
      eps: added to the mean of squares.
      act: ``None`` or ``"silu_mul"`` (see the module docstring).
      tiles: :class:`NormGemvTiles` (default :func:`default_tiles`).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(h [..., K], y [..., N or N/2])`` in ``x.dtype``; ``h`` is ``x`` when delta is None.
    Raises:
      ValueError: more than one row, mismatched shapes, an unknown act, tiles that do not fit.
    """
    lead = x.shape[:-1]
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"norm_gemv: delta {delta.shape} must match x {x.shape}.")
    if nw.shape != (x.shape[-1],):
        raise ValueError(f"norm_gemv: norm weight {nw.shape} must be [K] for x {x.shape}.")
    k = x.shape[-1]
    out = w.shape[0] // 2 if act == "silu_mul" else w.shape[0]
    flat = lambda a: None if a is None else a.reshape(-1, k)
    h, y = norm_gemv_pallas(flat(x), flat(delta), nw, w, eps=float(eps), act=act,
                            tiles=tiles or default_tiles(out, k, act),
                            interpret=interpret_mode(interpret))
    return h.reshape(x.shape), y.reshape(*lead, y.shape[-1])


__all__ = ["ACTS", "NormGemvTiles", "check_norm_gemv", "default_tiles", "norm_gemv",
           "norm_gemv_pallas", "norm_gemv_reference", "supports"]
