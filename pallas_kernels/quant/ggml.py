"""ggml block types kept packed on the device, dequantized inside a program (XLA).

A GGUF tensor's rows (innermost axis ``K``) are runs of blocks; a row of ``K`` values is held as
its ``K / values * bytes`` raw bytes (uint8), so stacked experts are ``[E, N, row_bytes]`` and a
gather of chosen experts (``codes[ids]``) reads only theirs. :func:`dequantize_rows` decodes
rows to float32 with the arithmetic of the ``gguf`` package's numpy dequantization
(``gguf.quants``; every product there is exact in float32, so the same values come out bit for
bit) and of :mod:`mtp_jax.weights.q2_0` for Q2_0. Formats (ggml's ``block_*`` structs,
little-endian):

``Q8_0``
    32 values in 34 bytes: fp16 ``d``, 32 int8 ``q``; ``v = q * d``.
``Q4_K``
    256 values in 144 bytes: fp16 ``d``, fp16 ``dmin``, 12 bytes of eight 6-bit scales and
    mins, 128 bytes of 4-bit codes (each 64-value chunk: 32 bytes, low nibbles first 32 values,
    high nibbles next 32); ``v = d * sc * q - dmin * m`` per 32-value sub-block.
``IQ3_XXS``
    256 values in 98 bytes: fp16 ``d``, 64 grid indices (each 4 values of a 256-entry grid),
    eight little-endian uint32 (one per 32 values: four 7-bit sign-pattern indices, bits 0-27,
    into the 128 ``ksigns`` patterns, and a 4-bit scale, bits 28-31);
    ``v = d * (0.5 + scale) * 0.5 * grid * sign``.
``Q2_0`` (type 42)
    64 values in 18 bytes: fp16 ``d``, 16 bytes of 2-bit codes (low bits first); ``v = (code -
    1) * d``.

The IQ3_XXS grid and the sign patterns are the ``gguf`` package's tables.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GGML_BLOCKS", "dequantize_rows", "row_bytes"]

# type name -> (values per block, bytes per block)
GGML_BLOCKS = {"Q8_0": (32, 34), "Q4_K": (256, 144), "IQ3_XXS": (256, 98), "Q2_0": (64, 18)}


def row_bytes(ggml_type: str, k: int) -> int:
    """Bytes of a row of ``k`` values; ValueError for a type not in :data:`GGML_BLOCKS` or a
    ``k`` that is not a whole number of blocks."""
    if ggml_type not in GGML_BLOCKS:
        raise ValueError(f"ggml type {ggml_type!r} has no device dequantization; kept types: "
                         f"{sorted(GGML_BLOCKS)}.")
    values, nbytes = GGML_BLOCKS[ggml_type]
    if k % values:
        raise ValueError(f"{ggml_type} rows hold blocks of {values} values; {k} is not a "
                         "multiple.")
    return k // values * nbytes


def _f16(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Two little-endian bytes -> their fp16 value as float32."""
    bits = lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _blocks(codes: jax.Array, ggml_type: str) -> jax.Array:
    """``[..., row_bytes]`` -> ``[..., blocks, bytes per block]``."""
    nbytes = GGML_BLOCKS[ggml_type][1]
    return codes.reshape(*codes.shape[:-1], codes.shape[-1] // nbytes, nbytes)


def _q8_0(b: jax.Array) -> jax.Array:
    d = _f16(b[..., 0], b[..., 1])[..., None]
    q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return q * d


def _q2_0(b: jax.Array) -> jax.Array:
    d = _f16(b[..., 0], b[..., 1])[..., None]
    shifts = jnp.array([0, 2, 4, 6], jnp.uint8)
    codes = (b[..., 2:, None] >> shifts) & 3  # [..., 16, 4]: value 4*i + j
    codes = codes.reshape(*b.shape[:-1], 64).astype(jnp.float32)
    return (codes - 1.0) * d


def _q4_k(b: jax.Array) -> jax.Array:
    d = _f16(b[..., 0], b[..., 1])[..., None]
    dmin = _f16(b[..., 2], b[..., 3])[..., None]
    s = b[..., 4:16]
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=-1)
    scale = d * sc.astype(jnp.float32)  # [..., 8], exact
    offset = dmin * mn.astype(jnp.float32)
    qs = b[..., 16:].reshape(*b.shape[:-1], 4, 32)
    q = jnp.stack([qs & 0x0F, qs >> 4], axis=-2)  # [..., 4, 2, 32]: sub-block 2c + h
    q = q.reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
    return (scale[..., None] * q - offset[..., None]).reshape(*b.shape[:-1], 256)


@functools.cache
def _iq3_tables() -> tuple[np.ndarray, np.ndarray]:
    """(grid [256, 4] float32, sign patterns [128, 8] float32 of +-1) from the gguf package."""
    from gguf import quants

    quants.IQ3_XXS.init_grid()
    grid = np.asarray(quants.IQ3_XXS.grid, np.float32).reshape(256, 4)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    bits = (ksigns[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return grid, np.where(bits == 0, 1.0, -1.0).astype(np.float32)


def _iq3_xxs(b: jax.Array) -> jax.Array:
    grid, signs = (jnp.asarray(t) for t in _iq3_tables())
    lead = b.shape[:-1]
    d = _f16(b[..., 0], b[..., 1])
    qs = b[..., 2:66].astype(jnp.int32)  # [..., 64] grid indices
    words = b[..., 66:98].reshape(*lead, 8, 4).astype(jnp.uint32)
    aux = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    db = d[..., None] * (0.5 + (aux >> 28).astype(jnp.float32)) * 0.5  # [..., 8]
    sign_ids = ((aux[..., None] >> jnp.array([0, 7, 14, 21], jnp.uint32)) & 0x7F)
    sgn = signs[sign_ids.astype(jnp.int32)]  # [..., 8, 4, 8]
    g = grid[qs].reshape(*lead, 8, 4, 8)  # 8 groups x 4 runs of 8 values (two grid entries)
    return (db[..., None, None] * g * sgn).reshape(*lead, 256)


_DECODE = {"Q8_0": _q8_0, "Q4_K": _q4_k, "IQ3_XXS": _iq3_xxs, "Q2_0": _q2_0}


def dequantize_rows(ggml_type: str, codes: jax.Array, k: int) -> jax.Array:
    """``codes [..., row_bytes]`` uint8 (rows of ``k`` values in ``ggml_type``) -> float32
    ``[..., k]``. Raises ValueError for a type without a decoder or mismatched bytes."""
    want = row_bytes(ggml_type, k)
    if codes.shape[-1] != want or codes.dtype != jnp.uint8:
        raise ValueError(f"{ggml_type} rows of {k} values are {want} uint8 bytes; got "
                         f"{codes.shape[-1]} {codes.dtype}.")
    values = _DECODE[ggml_type](_blocks(codes, ggml_type))
    return values.reshape(*codes.shape[:-1], k)
