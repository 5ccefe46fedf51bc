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


__all__ = ["interpret_mode", "next_pow2", "whole"]
