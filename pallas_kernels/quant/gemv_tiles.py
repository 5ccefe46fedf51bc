"""Tiles of the dequantizing few-row projection (:mod:`pallas_kernels.quant.gemv`): output
columns and K columns per program step, Triton warps and stages, and the split of K.

A program owns ``bn`` output columns and streams them in steps of ``bk`` columns of K
(nvfp4: ``bk / 16`` groups). With a split of K into ``S`` slices the grid is ``(N / bn, S)``:
program ``(j, s)`` streams only the steps of slice ``s`` (``chunk`` whole steps each, the last
slice fewer, the masked last step of a K that is not a multiple of ``bk`` in the last slice)
into a float32 partial. ``split_k = 0`` picks ``S`` from the grid's size: a long K over few
output columns (the 27B's down projection: N = 5,120 over K = 17,408) gives too few programs
to fill the GPU's SMs, each streaming the whole K.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from pallas_kernels.quant.formats import NVFP4_GROUP, QuantFormat

MAX_ROWS = 8
H200_SMS = 132
PROGRAMS_PER_SM = 4  # the automatic split's target: at least this many programs per SM
MIN_SPLIT_STEPS = 8  # ... while each slice keeps at least this many steps


class QuantGemvTiles(NamedTuple):
    """Static tiling: ``bn`` output columns per program and ``bk`` columns of ``K`` per step
    (powers of two; nvfp4: ``bk`` a multiple of 16), Triton ``num_warps`` / ``num_stages``,
    ``reduce_each``: sum each step's products at once into a ``[bn]`` accumulator per row
    (fewer registers with several rows) instead of ``[bn, bk]`` ones summed at the end, and
    ``split_k``: slices of K, each summed by its own programs into a float32 partial (``1``:
    no split, ``0``: :func:`auto_split`; more slices than steps give one step each)."""
    bn: int = 16
    bk: int = 128
    num_warps: int = 4
    num_stages: int = 3
    reduce_each: bool = False
    split_k: int = 0


def _pow2_divisor(v: int, cap: int) -> int:
    """The largest power of two ``<= cap`` dividing ``v``."""
    p = 1
    while p * 2 <= cap and v % (p * 2) == 0:
        p *= 2
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_tiles(fmt: QuantFormat, n: int, k: int, rows: int) -> QuantGemvTiles:
    """First-guess tiles for ``rows`` rows of ``W [n, k]`` (not tuned on a GPU): 16 output
    columns (fp8 blocks: the largest power of two up to 16 dividing the block's rows); steps
    of 128 columns inside an fp8 block (the largest power of two up to 128 dividing the block's
    columns), 256 when one block spans K, 512 for nvfp4 (256 bytes of codes per row);
    ``[bn]`` accumulators from 3 rows on; the automatic split of K. ``n`` is unused (masking
    takes any N; the split is chosen per call)."""
    del n
    bn_s, bk_s = fmt.block
    bn = 16 if fmt.kind == "nvfp4" or bn_s == 1 else _pow2_divisor(bn_s, 16)
    if fmt.kind == "nvfp4":
        bk = 512
    elif bk_s >= k:
        bk = 256
    else:
        bk = _pow2_divisor(bk_s, 128)
    return QuantGemvTiles(bn, bk, 4, 3, rows > 2, 0)


def check_tiles(fmt: QuantFormat, n: int, k: int, rows: int, tiles: QuantGemvTiles) -> None:
    """Raises ValueError naming the rows, K or tile that :func:`quant_gemv` cannot take."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"quant_gemv: {rows} rows; the kernel takes 1 to {MAX_ROWS}.")
    if k != fmt.in_features:
        raise ValueError(f"quant_gemv: x has K={k}, the weights {fmt.in_features}.")
    for name, v in (("bn", tiles.bn), ("bk", tiles.bk)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"quant_gemv: tile {name}={v} must be a power of two.")
    if not isinstance(tiles.split_k, int) or tiles.split_k < 0:
        raise ValueError(f"quant_gemv: split_k={tiles.split_k!r} must be an int >= 0 "
                         "(0: automatic).")
    bn_s, bk_s = fmt.block
    if fmt.kind == "nvfp4":
        if tiles.bk < NVFP4_GROUP:
            raise ValueError(f"quant_gemv: nvfp4 tile bk={tiles.bk} must be a multiple of "
                             f"{NVFP4_GROUP}.")
        return
    if bn_s != 1 and bn_s % tiles.bn:
        raise ValueError(f"quant_gemv: fp8 tile bn={tiles.bn} must divide the scale block's "
                         f"{bn_s} rows (or the block be one row).")
    if bk_s < k and bk_s % tiles.bk:
        raise ValueError(f"quant_gemv: fp8 tile bk={tiles.bk} must divide the scale block's "
                         f"{bk_s} columns (K={k}).")


def step_counts(fmt: QuantFormat, k: int, bk: int) -> tuple[int, int]:
    """``(whole steps, tail)`` of a program's walk over K in steps of ``bk`` columns: fp8 in
    columns, nvfp4 in 16-column groups (``tail``: the valid columns / groups of one last,
    masked step; 0 when ``bk`` divides K)."""
    if fmt.kind == "nvfp4":
        groups, tg = k // NVFP4_GROUP, bk // NVFP4_GROUP
        return groups // tg, groups % tg
    return k // bk, k % bk


def slices(n_steps: int, split: int) -> tuple[int, int]:
    """``(S, chunk)``: ``n_steps >= 1`` steps in slices of ``chunk = ceil(n_steps / split)``
    steps, the last one shorter; ``S = ceil(n_steps / chunk) <= split`` slices, none empty.
    Raises ValueError for ``n_steps`` or ``split`` below 1."""
    if n_steps < 1 or split < 1:
        raise ValueError(f"slices: {n_steps} steps and split {split} must be >= 1.")
    chunk = _cdiv(n_steps, split)
    return _cdiv(n_steps, chunk), chunk


def auto_split(programs: int, n_steps: int, sms: int) -> int:
    """The automatic number of K slices: enough for ``PROGRAMS_PER_SM * sms`` programs in all
    (``programs`` per slice), at most ``n_steps // MIN_SPLIT_STEPS`` (each slice streams at
    least that many steps), at least 1; e.g. on an H200 (132 SMs) fp8 with the default tiles:
    1 for the 27B's gate_up (2,176 programs), 2 for its down (320 programs, 136 steps)."""
    want = _cdiv(PROGRAMS_PER_SM * sms, max(programs, 1))
    return max(1, min(want, n_steps // MIN_SPLIT_STEPS))


def sm_count() -> int:
    """The default device's SMs when it is a GPU (its ``core_count``), else an H200's 132."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or H200_SMS) if dev.platform == "gpu" else H200_SMS


def split_plan(fmt: QuantFormat, n: int, k: int, tiles: QuantGemvTiles,
               sms: int | None = None) -> tuple[int, int]:
    """``(S, chunk)`` of a call: :func:`slices` of its steps (:func:`step_counts`) into
    ``tiles.split_k`` slices, or (``split_k = 0``) :func:`auto_split`'s over ``sms`` SMs
    (``None``: :func:`sm_count`)."""
    n_full, tail = step_counts(fmt, k, tiles.bk)
    n_steps = n_full + (tail > 0)
    split = tiles.split_k or auto_split(_cdiv(n, tiles.bn), n_steps,
                                        sm_count() if sms is None else sms)
    return slices(n_steps, split)


def quant_gemv_applies(fmt: QuantFormat, n: int, k: int, rows: int) -> bool:
    """Whether :func:`quant_gemv` takes ``rows`` rows of ``W [n, k]`` in ``fmt`` with
    :func:`default_tiles` at a sensible speed (at least 4 output columns and 16 columns of K
    per program step); the caller keeps XLA's dequantize + dot otherwise."""
    if n < 1 or not 1 <= rows <= MAX_ROWS or k != fmt.in_features:
        return False
    t = default_tiles(fmt, n, k, rows)
    return t.bn >= 4 and t.bk >= 16


__all__ = ["H200_SMS", "MAX_ROWS", "MIN_SPLIT_STEPS", "PROGRAMS_PER_SM", "QuantGemvTiles",
           "auto_split", "check_tiles", "default_tiles", "quant_gemv_applies", "slices",
           "sm_count", "split_plan", "step_counts"]
