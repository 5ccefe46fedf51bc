"""ggml ``Q2_0`` (GGUF tensor type 42), the block type the PyPI ``gguf`` package (0.19) lacks.

Layout (mainline ggml ``block_q2_0``; ../shared/FORMATS.md): blocks of 64 values in 18 bytes,
an fp16 (little-endian) scale ``d`` then 16 bytes of 2-bit codes; value ``j`` of a block is bits
``2*(j % 4)`` .. ``2*(j % 4) + 1`` of code byte ``j // 4`` (low bits first), and decodes to
``(code - 1) * d`` (codes 0..3 -> -1, 0, +1, +2 times ``d``). Blocks run along the last
(innermost, input) axis of a tensor.
"""

from __future__ import annotations

import numpy as np

Q2_0_TYPE = 42
Q2_0_BLOCK = 64  # values per block
Q2_0_BYTES = 18  # bytes per block: fp16 d + 16 code bytes
_SHIFTS = np.array([0, 2, 4, 6], np.uint8)


def q2_0_byte_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored byte shape of a Q2_0 tensor of logical ``shape`` (last dim a multiple of 64)."""
    if not shape or shape[-1] % Q2_0_BLOCK:
        raise ValueError(f"Q2_0 tensors need a last dimension that is a multiple of "
                         f"{Q2_0_BLOCK}; got shape {list(shape)}.")
    return (*shape[:-1], shape[-1] // Q2_0_BLOCK * Q2_0_BYTES)


def dequantize_q2_0(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Q2_0 bytes (any shape, ``prod(shape) / 64 * 18`` uint8) -> float32 ``shape``."""
    n = int(np.prod(shape))
    raw = np.asarray(data, np.uint8).reshape(-1)
    if n % Q2_0_BLOCK or raw.size != n // Q2_0_BLOCK * Q2_0_BYTES:
        raise ValueError(f"Q2_0 data of {raw.size} bytes does not hold shape {list(shape)} "
                         f"({Q2_0_BYTES} bytes per {Q2_0_BLOCK} values).")
    blocks = raw.reshape(-1, Q2_0_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [n_blocks, 1]
    codes = (blocks[:, 2:, None] >> _SHIFTS) & 3  # [n_blocks, 16, 4]: value 4*b + k
    values = (codes.reshape(-1, Q2_0_BLOCK).astype(np.float32) - 1.0) * d
    return values.reshape(shape)


def quantize_q2_0(values: np.ndarray) -> np.ndarray:
    """float ``[..., K]`` (K a multiple of 64) -> Q2_0 bytes ``[..., K / 64 * 18]`` uint8.

    The scale is ``max|x| / 2`` per block (so codes reach -1..+2 times it), codes the nearest of
    the four levels. For writing random / test checkpoints; not an accuracy-tuned quantizer."""
    x = np.asarray(values, np.float32)
    out_shape = q2_0_byte_shape(x.shape)
    blocks = x.reshape(-1, Q2_0_BLOCK)
    d = (np.abs(blocks).max(axis=1, keepdims=True) / 2).astype(np.float16)
    inv = np.divide(1.0, d.astype(np.float32), out=np.zeros_like(d, np.float32),
                    where=d.astype(np.float32) != 0)
    codes = np.clip(np.rint(blocks * inv) + 1, 0, 3).astype(np.uint8)  # [n, 64]
    packed = (codes.reshape(-1, 16, 4) << _SHIFTS).sum(axis=2, dtype=np.uint8)  # [n, 16]
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), packed], axis=1)
    return out.reshape(out_shape)
