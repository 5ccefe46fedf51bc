"""Stored types of the random GGUF writer: float tensors and random ggml blocks.

Types (``TYPES``): the float types ``F32`` / ``F16`` / ``BF16`` (ggml ids 0 / 1 / 30) and the
block types ``Q8_0`` (32 values in 34 bytes), ``Q4_K`` (256 in 144), ``IQ3_XXS`` (256 in 98)
and ``Q2_0`` (64 in 18, type 42, which the ``gguf`` package does not know), the types the
released Flash-Next GGUFs and Strata packs use and mtp_jax keeps packed on the device.

Random blocks are random bytes (every bit pattern of these types decodes to finite values)
whose fp16 scales are then set so that the decoded values have a chosen root-mean-square:
``d`` at byte 0 of every block (``Q4_K`` also ``dmin`` at byte 2, set to ``7.5 d`` so that the
4-bit codes' offset cancels the mins' on average). The scale per unit of ``d`` is measured
once per type by decoding random blocks (``gguf.quants``; Q2_0 from its format: codes 0..3 ->
-1, 0, 1, 2 times ``d``, rms ``sqrt(1.5)``).

A block type needs rows (the last axis) of whole blocks: :func:`stored_type` says which type a
row gets instead (``Q8_0`` where 32 divides the row, else ``F32``), as llama.cpp's quantizer
also falls back (it picks IQ4_NL / Q5_0, which mtp_jax dequantizes at load; ``Q8_0`` stays
packed on the device).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

FLOAT_TYPES = {"F32": (0, np.dtype(np.float32)), "F16": (1, np.dtype(np.float16)),
               "BF16": (30, np.dtype(ml_dtypes.bfloat16))}
# name -> (ggml type id, values per block, bytes per block, byte offsets of fp16 scales)
BLOCK_TYPES = {"Q8_0": (8, 32, 34, (0,)), "Q4_K": (12, 256, 144, (0, 2)),
               "IQ3_XXS": (18, 256, 98, (0,)), "Q2_0": (42, 64, 18, (0,))}
TYPES = tuple(FLOAT_TYPES) + tuple(BLOCK_TYPES)
_Q4K_DMIN = 7.5  # dmin / d


def type_id(name: str) -> int:
    """The ggml type id of a type in :data:`TYPES`."""
    return FLOAT_TYPES[name][0] if name in FLOAT_TYPES else BLOCK_TYPES[name][0]


def check_type(name: str, option: str) -> None:
    """ValueError naming ``option`` when ``name`` is not in :data:`TYPES`."""
    if name not in TYPES:
        raise ValueError(f"{option} {name!r} is not a type this writer makes; use one of "
                         f"{', '.join(TYPES)}.")


def stored_type(requested: str, row: int) -> str:
    """The type a tensor with rows of ``row`` values is stored in when ``requested`` is asked
    for: ``requested`` where its blocks fit the row, else ``Q8_0`` (32-value blocks), else
    ``F32``."""
    if requested in FLOAT_TYPES or row % BLOCK_TYPES[requested][1] == 0:
        return requested
    return "Q8_0" if row % 32 == 0 else "F32"


def nbytes(name: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of numpy ``shape`` stored as ``name`` (rows of whole blocks)."""
    n = int(np.prod(shape)) if shape else 1
    if name in FLOAT_TYPES:
        return n * FLOAT_TYPES[name][1].itemsize
    _, values, size, _ = BLOCK_TYPES[name]
    return n // values * size


def row_bytes(name: str, row: int) -> int:
    """Bytes of one row of ``row`` values stored as ``name``."""
    return nbytes(name, (row,))


def _decode_sample(name: str, raw: np.ndarray) -> np.ndarray:
    """float64 values of random blocks ``raw [n, bytes]`` (for the scale calibration)."""
    if name == "Q2_0":
        d = raw[:, :2].copy().view("<f2").astype(np.float64)
        codes = (raw[:, 2:, None] >> np.array([0, 2, 4, 6], np.uint8)) & 3
        return (codes.reshape(len(raw), -1) - 1.0) * d
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    return np.asarray(quants.dequantize(raw, GGMLQuantizationType[name]), np.float64)


def _set_scales(name: str, blocks: np.ndarray, d: float) -> None:
    """Write the fp16 scales of ``blocks [..., bytes]`` in place: ``d`` (and Q4_K's dmin)."""
    offsets = BLOCK_TYPES[name][3]
    for k, off in enumerate(offsets):
        value = np.float16(d * (_Q4K_DMIN if k else 1.0))
        blocks[..., off:off + 2] = np.frombuffer(value.tobytes(), np.uint8)


@functools.cache
def unit_rms(name: str) -> float:
    """Root-mean-square of the values of random ``name`` blocks whose ``d`` is 1."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (512, BLOCK_TYPES[name][2]), dtype=np.uint8)
    _set_scales(name, raw, 1.0)
    return float(np.sqrt(np.mean(_decode_sample(name, raw) ** 2)))


def random_blocks(rng: np.random.Generator, name: str, shape: tuple[int, ...],
                  rms: float) -> np.ndarray:
    """Random ``name`` blocks of a tensor of numpy ``shape``: uint8 ``[*shape[:-1], row
    bytes]`` whose decoded values have root-mean-square about ``rms`` (finite, fp16 scales)."""
    _, values, size, _ = BLOCK_TYPES[name]
    if shape[-1] % values:
        raise ValueError(f"{name} rows hold whole blocks of {values} values; a row of "
                         f"{shape[-1]} does not (use stored_type).")
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // values, size), dtype=np.uint8)
    _set_scales(name, blocks, rms / unit_rms(name))
    return blocks.reshape(*shape[:-1], shape[-1] // values * size)


def encode(values: np.ndarray, name: str) -> np.ndarray:
    """float values -> the bytes-carrying array of type ``name``: a float type's array, or
    ``Q8_0`` blocks (``gguf.quants.quantize``; uint8 ``[..., row bytes]``). Other block types
    cannot be made from values here (ValueError): they are written as random blocks."""
    if name in FLOAT_TYPES:
        return np.ascontiguousarray(values, FLOAT_TYPES[name][1])
    if name != "Q8_0":
        raise ValueError(f"values can be stored as {', '.join(FLOAT_TYPES)} or Q8_0 here; "
                         f"{name} is written as random blocks only (no quantizer for it).")
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    return quants.quantize(np.ascontiguousarray(values, np.float32), GGMLQuantizationType.Q8_0)
