"""Quantizers for the writer of quantized test checkpoints (``random_checkpoint --quantize``):
float weights ``[..., out, in]`` -> the stored tensors of one format (``FORMATS.md``).

Each returns ``{role: array}`` with roles ``weight`` (codes), ``scale_inv`` / ``scale`` /
``scale_2`` / ``global_scale`` / ``input`` (an activation scale of 1, stored as released files
store it and never used by the reader). Leading axes (stacked experts ``E``) get their own
scales. Rounding: FP8 through ``ml_dtypes.float8_e4m3fn`` (round to nearest even, values
clipped to +-448 first); FP4 to the nearest e2m1 value.

* block FP8: ``scale_inv[i, j] = amax(block) / 448`` over ``block`` rows x cols (partial edge
  blocks included), codes ``w / scale_inv``;
* per-tensor FP8: ``weight_scale = amax / 448``;
* NVFP4: ``weight_scale_2 = amax / (448 * 6)``, group scales ``amax(group) / 6 /
  weight_scale_2`` in F8_E4M3, codes ``e2m1(w / (group scale * weight_scale_2))``, packed
  two per byte, even column in the low nibble; compressed-tensors stores
  ``weight_global_scale = 1 / weight_scale_2``.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["SCHEMES", "quantize"]

SCHEMES = ("fp8-block", "modelopt-fp8", "modelopt-nvfp4", "ct-nvfp4")
FP8_MAX = 448.0
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_F8 = ml_dtypes.float8_e4m3fn


def _to_fp8(x: np.ndarray) -> np.ndarray:
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(_F8)


def _safe(s: np.ndarray) -> np.ndarray:
    return np.where(s > 0, s, 1.0)


def _fp8_block(x: np.ndarray, block: tuple[int, int]) -> dict[str, np.ndarray]:
    *lead, r, c = x.shape
    nr, nc = -(-r // block[0]), -(-c // block[1])
    padded = np.zeros((*lead, nr * block[0], nc * block[1]))
    padded[..., :r, :c] = np.abs(x)
    amax = padded.reshape(*lead, nr, block[0], nc, block[1]).max(axis=(-3, -1))
    scale = _safe(amax / FP8_MAX).astype(np.float32)
    full = np.repeat(np.repeat(scale.astype(np.float64), block[0], -2), block[1], -1)
    return {"weight": _to_fp8(x / full[..., :r, :c]), "scale_inv": scale}


def _per_matrix_amax(x: np.ndarray) -> np.ndarray:
    return np.abs(x).max(axis=(-2, -1))  # shape lead (a 0-d array for a plain matrix)


def _fp8_tensor(x: np.ndarray) -> dict[str, np.ndarray]:
    scale = _safe(_per_matrix_amax(x) / FP8_MAX).astype(np.float32)
    codes = _to_fp8(x / scale.astype(np.float64)[..., None, None])
    return {"weight": codes, "scale": scale, "input": np.ones_like(scale)}


def _e2m1_codes(v: np.ndarray) -> np.ndarray:
    """Nearest e2m1 code (sign bit 3, magnitude index bits 0-2) of each value."""
    mag = np.abs(v)[..., None]
    idx = np.argmin(np.abs(mag - _E2M1), axis=-1).astype(np.uint8)
    return idx | np.where((v < 0) & (idx > 0), 8, 0).astype(np.uint8)


def _nvfp4(x: np.ndarray, group: int) -> dict[str, np.ndarray]:
    *lead, r, c = x.shape
    if c % group:
        raise ValueError(f"NVFP4 needs the input size {c} to be a multiple of {group}")
    scale_2 = _safe(_per_matrix_amax(x) / (FP8_MAX * 6.0)).astype(np.float32)
    s2 = scale_2.astype(np.float64)[..., None, None]
    g = x.reshape(*lead, r, c // group, group)
    scale = _to_fp8(np.abs(g).max(-1) / 6.0 / s2)
    real = _safe(scale.astype(np.float64) * s2)
    codes = _e2m1_codes(g / real[..., None]).reshape(*lead, r, c)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"weight": packed.astype(np.uint8), "scale": scale, "scale_2": scale_2,
            "input": np.ones_like(scale_2)}


def quantize(x: np.ndarray, scheme: str, block: tuple[int, int] = (128, 128),
             group: int = 16) -> dict[str, np.ndarray]:
    """The stored tensors (``{role: array}``) of ``x [..., out, in]`` in ``scheme``
    (:data:`SCHEMES`). ``ct-nvfp4`` gives ``global_scale = 1 / scale_2`` (shape ``[1]`` per
    matrix) and an ``input`` global scale."""
    x = np.asarray(x, np.float64)
    if scheme == "fp8-block":
        return _fp8_block(x, block)
    if scheme == "modelopt-fp8":
        return _fp8_tensor(x)
    if scheme == "modelopt-nvfp4":
        return _nvfp4(x, group)
    if scheme == "ct-nvfp4":
        q = _nvfp4(x, group)
        s2 = q.pop("scale_2")
        q["global_scale"] = (1.0 / s2.astype(np.float64)).astype(np.float32).reshape(
            *s2.shape, 1) if s2.ndim else np.array([1.0 / float(s2)], np.float32)
        return q
    raise ValueError(f"quantization scheme {scheme!r} is unknown; use one of {SCHEMES}.")
