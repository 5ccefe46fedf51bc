"""Dequantization of the quantized safetensors formats (pure numpy, float64 arithmetic).

Every function takes the stored arrays as numpy arrays in their stored dtypes (``float8_e4m3fn``
from ``ml_dtypes``, ``uint8`` for packed FP4, float scales) and returns the weight in float64.
Leading dimensions (a stacked expert axis ``E``) are allowed: the last two axes are the
matrix ``[out, in]``; a scale that is one value per matrix has ``prod(leading)`` (or 1) values.

Formulas (``/work/shared/FORMATS.md``; transformers ``FineGrainedFP8``, TensorRT-Model-Optimizer,
compressed-tensors ``nvfp4-pack-quantized``):

* block FP8: ``W[r, c] = w[r, c] * scale_inv[r // b0, c // b1]`` (``scale_inv`` multiplies
  despite its name; the last row / column blocks may be partial, no padding is stored);
* per-tensor FP8: ``W = w * weight_scale``;
* NVFP4: ``W[r, c] = e2m1(code[r, c]) * weight_scale[r, c // 16] * weight_scale_2``;
  compressed-tensors stores ``weight_global_scale = 1 / weight_scale_2``.

e2m1 packing: two 4-bit codes per byte along the input axis, column ``2j`` in the low nibble,
``2j + 1`` in the high nibble; a code is sign (bit 3) and magnitude index (bits 0-2) into
:data:`E2M1_VALUES`.
"""

from __future__ import annotations

import numpy as np

__all__ = ["E2M1_VALUES", "unpack_e2m1", "dequant_fp8_block", "dequant_fp8_tensor",
           "dequant_nvfp4", "dequant_ct_nvfp4", "block_scale_shape"]

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # magnitude index 0..7


def block_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of a block-FP8 ``weight_scale_inv`` for a weight of ``shape [..., out, in]``:
    ``[..., ceil(out / b0), ceil(in / b1)]`` (partial edge blocks included)."""
    *lead, r, c = shape
    return (*lead, -(-r // block[0]), -(-c // block[1]))


def _per_matrix(scale: np.ndarray, lead: tuple[int, ...]) -> np.ndarray:
    """A per-matrix scale (1 value, or one per leading index) shaped ``lead + (1, 1)``."""
    s = np.asarray(scale, np.float64).reshape(-1)
    if s.size == 1:
        return s.reshape((1,) * (len(lead) + 2))
    return s.reshape(tuple(lead) + (1, 1))


def dequant_fp8_block(w: np.ndarray, scale_inv: np.ndarray,
                      block: tuple[int, int]) -> np.ndarray:
    """Block FP8: ``w [..., out, in]`` float8_e4m3fn, ``scale_inv [..., ceil(out/b0),
    ceil(in/b1)]`` -> float64 ``[..., out, in]``."""
    r, c = w.shape[-2:]
    s = np.asarray(scale_inv, np.float64)
    s = np.repeat(np.repeat(s, block[0], axis=-2)[..., :r, :], block[1], axis=-1)[..., :c]
    return w.astype(np.float64) * s


def dequant_fp8_tensor(w: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Per-tensor FP8: ``w [..., out, in]`` float8_e4m3fn times its one scale per matrix."""
    return w.astype(np.float64) * _per_matrix(scale, w.shape[:-2])


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """``packed [..., out, in/2]`` uint8 -> float64 ``[..., out, in]`` e2m1 values (low nibble
    = even column)."""
    p = np.asarray(packed, np.uint8)
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    mag = E2M1_VALUES[codes & 0x7]
    return np.where(codes & 0x8, -mag, mag)


def dequant_nvfp4(packed: np.ndarray, weight_scale: np.ndarray, scale_2: np.ndarray,
                  group: int = 16) -> np.ndarray:
    """NVFP4: ``packed [..., out, in/2]`` uint8, ``weight_scale [..., out, in/group]``
    float8_e4m3fn, ``scale_2`` one float per matrix (ModelOpt's ``weight_scale_2``) ->
    float64 ``[..., out, in]``."""
    vals = unpack_e2m1(packed)
    s = np.repeat(np.asarray(weight_scale).astype(np.float64), group, axis=-1)
    return vals * s * _per_matrix(scale_2, packed.shape[:-2])


def dequant_ct_nvfp4(packed: np.ndarray, weight_scale: np.ndarray, global_scale: np.ndarray,
                     group: int = 16) -> np.ndarray:
    """compressed-tensors NVFP4: as :func:`dequant_nvfp4` but divided by
    ``weight_global_scale`` (one float per matrix), ``W = e2m1 * weight_scale / global``."""
    vals = unpack_e2m1(packed)
    s = np.repeat(np.asarray(weight_scale).astype(np.float64), group, axis=-1)
    return vals * s / _per_matrix(global_scale, packed.shape[:-2])
