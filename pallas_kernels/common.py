"""Small helpers shared by the kernels of every op."""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl


def interpret_mode(interpret: bool | None) -> bool:
    """Pallas interpret mode: ``interpret``, or (``None``) when the default device is not a GPU."""
    return jax.default_backend() != "gpu" if interpret is None else interpret


def next_pow2(n: int) -> int:
    """``n`` rounded up to a power of two (``1`` for ``n <= 1``): Triton block sizes."""
    return 1 << max(n - 1, 0).bit_length()


def whole(shape) -> pl.BlockSpec:
    """The whole array as one block (the kernel indexes it itself, e.g. by slot)."""
    return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def widest_tile(dim: int, rows: int, target: int, lo: int, hi: int) -> int:
    """Widest power-of-two tile in ``[lo, hi]`` dividing ``dim`` that still gives ``rows * dim /
    tile >= target`` programs (``lo`` when none does): a few-rows kernel's output tile, wide
    enough to write long rows, narrow enough to keep every SM streaming."""
    best, t = lo, lo
    while t <= hi:
        if dim % t == 0 and rows * (dim // t) >= target:
            best = t
        t *= 2
    return best


def pow2_step(dim: int, want: int, lo: int, hi: int | None, smallest: int) -> int:
    """A contraction step: ``want`` clamped to ``[lo, hi]`` (``hi`` None: no cap), rounded down
    to a power of two, halved (not below ``smallest``) until it divides ``dim``, at most ``dim``."""
    t = max(lo, want) if hi is None else min(hi, max(lo, want))
    t = 1 << (t.bit_length() - 1)
    while t > smallest and dim % t:
        t //= 2
    return min(t, dim)


def check_moe_tiles(what: str, tiles, hidden: int, inter: int, lo: int, hint: str = "") -> None:
    """Raises ValueError naming the first of ``tiles.gu_bn`` / ``gu_bk`` / ``dn_bh`` / ``dn_bk``
    (few-rows MoE kernels' tiles of I, H, H, I) that is not a power of two >= ``lo`` dividing
    its dimension; ``what`` names the kernels, ``hint`` ends the message."""
    for name, dim, dim_name in (("gu_bn", inter, "I"), ("gu_bk", hidden, "H"),
                                ("dn_bh", hidden, "H"), ("dn_bk", inter, "I")):
        t = getattr(tiles, name)
        if t < lo or t & (t - 1) or dim % t:
            raise ValueError(f"{what} tile {name}={t} must be a power of two >= {lo} dividing "
                             f"{dim_name}={dim}{hint}.")


__all__ = ["check_moe_tiles", "interpret_mode", "next_pow2", "pow2_step", "whole",
           "widest_tile"]
