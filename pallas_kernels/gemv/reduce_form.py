"""XLA's multiply-reduce form of a one-row projection: ``y[n] = sum_k x[k] w[n, k]``.

Written as an elementwise product in float32 and a sum over K (not a ``dot``), XLA compiles a
one-row projection into one row-reduction fusion that streams ``w [N, K]`` once; its ``dot``
takes a Triton GEMM (split-K where K is long) above XLA's own size limit for this rewrite
(``DotStrengthReduction``: 10M elements), which reads the weights more slowly at one row.

Measured on the H200 (bf16, one row, ``python -m mtp_jax.bench gemv``, session 11; device time per
call, 16 distinct weights back to back):

============================  ==========  ==========  ==================
projection ``N x K``          this form   XLA dot     Pallas ``gemv``
============================  ==========  ==========  ==================
2B MLP gate/up 12288 x 2048   12.8 us     19.7        14.7
2B MLP down 2048 x 6144       7.5         11.1        (XLA)
2B GDN in-proj 8224 x 2048    9.3         17.1        11.4
27B GDN in-proj 16480 x 5120  37.7        49.2        43.7
27B MLP gate/up 34816 x 5120  78.6        85.7        85.3
27B o_proj 5120 x 6144        15.6        19.0        16.9
27B MLP down 5120 x 17408     72.7        44.4        44.4
2B LM head 248320 x 2048      219.8       227.9       232.3
============================  ==========  ==========  ==================

At K = 17408 XLA splits the reduction in two kernels and loses, so :func:`reduce_applies`
keeps XLA's ``dot`` for K above :data:`MAX_K`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

MAX_K = 8192  # longest contraction measured faster in this form (6144 won, 17408 lost)
MAX_ROWS = 1  # rows measured (several rows would read w once per row)


def reduce_applies(x_shape: tuple[int, ...], w_shape: tuple[int, int]) -> bool:
    """Whether ``x [..., K] @ w [N, K].T`` takes :func:`reduce_matmul` in
    :func:`pallas_kernels.gemv.gemv`: at most :data:`MAX_ROWS` rows and ``K <= MAX_K``."""
    return math.prod(x_shape[:-1]) <= MAX_ROWS and w_shape[1] <= MAX_K


def reduce_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [..., K] @ w [N, K].T -> [..., N]`` in ``w.dtype``: float32 products of the
    ``w.dtype`` operands, summed in float32 over K, rounded once (``x`` is cast to
    ``w.dtype`` first, as for XLA's ``dot``).
    Raises ValueError for mismatched K."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"reduce_matmul: x {x.shape} and w {w.shape} must be [..., K] and "
                         "[N, K].")
    x32 = x.astype(w.dtype).astype(jnp.float32)
    y = jnp.sum(x32[..., None, :] * w.astype(jnp.float32), axis=-1)
    return y.astype(w.dtype)


__all__ = ["MAX_K", "MAX_ROWS", "reduce_applies", "reduce_matmul"]
