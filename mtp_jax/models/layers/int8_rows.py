"""Weight-only int8 rows with one float32 scale per row, for the MTP draft's LM head and
projections (``speculative_draft_head_dtype`` / ``speculative_draft_layer_dtype``).

``quantize_rows(w)`` stores ``w [N, K]`` as ``q [N, K] int8`` and ``scale [N] float32`` with
``w[n] ~= q[n] * scale[n]``: symmetric round-to-nearest, ``scale[n] = max_k |w[n, k]| / 127``
(per-output-channel absmax scaling, as in LLM.int8's vector-wise weight quantization, Dettmers
et al. 2022, without its outlier split). Each element is off by at most ``scale[n] / 2``.

``int8_matmul(x, q, scale)`` is ``(x @ q.T) * scale`` summed in float32: half the bytes of a
bf16 head for the same rows. It is a ``dot`` of ``x`` and ``q`` converted to ``x``'s dtype
(exact: every int8 value is a bf16 value), which XLA fuses into its GEMM, with ``x`` padded to
at least :data:`MIN_ROWS` rows. Measured on the H200 (the 27B head, 248,320 x 5,120, session
17, wall time per call in a loop less the loop's own ~25 us): about 320 us with 8 rows (4.0
TB/s of int8), 420 us for the same ``dot`` at one row and for the one-row multiply-reduce form
(the int8-to-float conversions bound that form), against about 565 us for the bf16 head's
one-row reduce form (``python -m mtp_jax.bench draft-head --parts``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["INT8_MAX", "MIN_ROWS", "quantize_rows", "quantize_rows_in_blocks", "int8_matmul"]

INT8_MAX = 127  # symmetric range: -127 .. 127 (-128 unused)
MIN_ROWS = 8  # rows the dot is padded to (XLA's GEMM streams q faster at 8 rows than at 1)


def quantize_rows(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``w [N, K]`` (any float dtype) -> ``(q [N, K] int8, scale [N] float32)`` with ``|w[n, k]
    - q[n, k] * scale[n]| <= scale[n] / 2``; an all-zero row gets scale 1 (its q is zero).
    Raises ValueError for an array that is not 2-D."""
    if w.ndim != 2:
        raise ValueError(f"quantize_rows: w has shape {w.shape}; expected [N, K].")
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=1)
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w32 / scale[:, None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def quantize_rows_in_blocks(w: jax.Array, rows: int = 4096) -> tuple[jax.Array, jax.Array]:
    """:func:`quantize_rows` of ``w [N, K]`` (the same values) computed ``rows`` rows at a time
    (``jax.lax.map``), so that its float32 working copy is one block of rows, not the whole
    table (in one piece, the 27B's LM head of 248,320 x 5,120 needs a 5.1 GB float32 copy at
    load, now that the int8 draft head is the GPU's default). Raises ValueError for an array
    that is not 2-D."""
    if w.ndim != 2:
        raise ValueError(f"quantize_rows_in_blocks: w has shape {w.shape}; expected [N, K].")

    def one(row):
        q, scale = quantize_rows(row[None])
        return q[0], scale[0]
    return jax.lax.map(one, w, batch_size=max(1, min(rows, w.shape[0])))


def int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """``x [..., K]`` (float) times int8 rows ``q [N, K]`` with ``scale [N]`` -> ``[..., N]``
    float32: ``sum_k x[k] q[n, k]`` in float32, times ``scale[n]`` (not rounded to ``x``'s
    dtype). Raises ValueError for mismatched shapes or a ``q`` that is not int8."""
    n, k = q.shape
    if q.dtype != jnp.int8 or x.shape[-1] != k or scale.shape != (n,):
        raise ValueError(f"int8_matmul: x {x.shape}, q {q.shape} {q.dtype}, scale {scale.shape}"
                         " must be [..., K], int8 [N, K] and [N].")
    lead = x.shape[:-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    if m < MIN_ROWS:
        x2 = jnp.pad(x2, ((0, MIN_ROWS - m), (0, 0)))
    y = jnp.einsum("mk,nk->mn", x2, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y[:m] * scale).reshape(*lead, n)
