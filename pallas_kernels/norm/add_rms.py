"""Residual add fused with the zero-centred RMSNorm of the Qwen3.5 family.

    h = x + delta                                  (in x's dtype, as the model's residual add)
    y = (h / sqrt(mean(h^2) + eps) * (1 + w))      (float32, cast back to x's dtype)

(HF ``Qwen3_5RMSNorm`` after the decoder layer's residual add.) XLA runs each norm of a
decode step as three small kernels (the residual add, the mean of squares, the scaling) of
1.2-1.8 us each on the H200, two norms per decoder layer (``docs/benchmarks.md``, session 9);
``backend="pallas"`` does all of it in one Triton kernel, one program per row.

``h`` equals XLA's bitwise (one correctly rounded addition); ``y`` may differ from XLA's in the
last bit, as the kernel sums the squares in its own order. Every row is computed the same way
whatever the number of rows, so a verify window and a decode step agree row for row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import interpret_mode, whole

BACKENDS = ("xla", "pallas")
MAX_CHUNK = 4096  # columns a program holds per piece (a power of two)
F32 = jnp.float32


def rms_norm_reference(h: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """XLA reference: ``h [..., H]`` -> ``h / rms(h) * (1 + weight)`` in ``h``'s dtype
    (statistics and scale in float32)."""
    h32 = h.astype(F32)
    y = h32 * lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(F32))).astype(h.dtype)


def add_rms_norm_reference(x: jax.Array, delta: jax.Array | None, weight: jax.Array,
                           eps: float) -> tuple[jax.Array, jax.Array]:
    """XLA reference of :func:`add_rms_norm`."""
    h = x if delta is None else x + delta.astype(x.dtype)
    return h, rms_norm_reference(h, weight, eps)


def chunk_of(hidden: int) -> int | None:
    """The largest power of two up to :data:`MAX_CHUNK` that divides ``hidden`` and leaves at
    most 8 pieces (2048 -> 2048, 5120 -> 1024, 6144 -> 2048), or ``None`` when there is none
    of at least 16 columns."""
    c = MAX_CHUNK
    while c >= 16:
        if hidden % c == 0 and hidden // c <= 8:
            return c
        c //= 2
    return None


def _kernel(*refs, eps: float, chunk: int, pieces: int, has_delta: bool):
    """One row: ``x [H]`` (+ ``delta [H]``) -> ``h [H]`` (with delta) and ``y [H]``."""
    if has_delta:
        x_ref, d_ref, w_ref, h_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    i = pl.program_id(0)
    rows, total = [], jnp.zeros((), F32)
    for j in range(pieces):
        cols = pl.ds(j * chunk, chunk)
        h = x_ref[i, cols]
        if has_delta:
            h = (h.astype(F32) + d_ref[i, cols].astype(F32)).astype(h_ref.dtype)
            h_ref[i, cols] = h
        h32 = h.astype(F32)
        rows.append(h32)
        total = total + jnp.sum(h32 * h32)
    scale = lax.rsqrt(total / (chunk * pieces) + eps)
    for j in range(pieces):
        cols = pl.ds(j * chunk, chunk)
        w = 1.0 + w_ref[cols].astype(F32)
        y_ref[i, cols] = (rows[j] * scale * w).astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm_pallas(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float,
                        *, interpret: bool = False):
    """One-kernel add + norm over ``x [R, H]``; arguments and results as :func:`add_rms_norm`."""
    r, hidden = x.shape
    chunk = chunk_of(hidden)
    has_delta = delta is not None
    args = (x, delta.astype(x.dtype), weight) if has_delta else (x, weight)
    out_shape = [jax.ShapeDtypeStruct((r, hidden), x.dtype)] * (2 if has_delta else 1)
    outs = pl.pallas_call(
        functools.partial(_kernel, eps=eps, chunk=chunk, pieces=hidden // chunk,
                          has_delta=has_delta),
        grid=(r,),
        in_specs=[whole(a.shape) for a in args],
        out_specs=[whole((r, hidden))] * len(out_shape),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=4 if chunk >= 1024 else 1,
                                             num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(*args)
    return (outs[0], outs[1]) if has_delta else (x, outs[0])


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array, eps: float, *,
                 backend: str = "xla", interpret: bool | None = None):
    """Residual add and zero-centred RMSNorm of the sum.

    Args:
      x: ``[..., H]`` residual stream (its dtype is that of both results).
      delta: ``[..., H]`` the block output to add, or ``None`` (norm of ``x`` alone).
      weight: ``[H]`` the zero-centred norm weight (the scale is ``1 + weight``).
      eps: added to the mean of squares.
      backend: ``"xla"`` or ``"pallas"`` (one Triton kernel; GPU, or interpret mode).
      interpret: Pallas interpret mode (``None``: when the default device is not a GPU).
    Returns:
      ``(h, y)``: ``h = x + delta`` (``x`` when ``delta`` is None) and ``y`` its norm, both
      ``[..., H]`` in ``x.dtype``.
    Raises:
      ValueError: unknown backend, mismatched shapes, or (pallas) a hidden size with no
        power-of-two piece of 16 to 4096 columns in at most 8 pieces (:func:`chunk_of`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"add_rms_norm: backend {backend!r} is unknown; use one of "
                         f"{BACKENDS}.")
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {x.shape}, delta "
                         f"{None if delta is None else delta.shape} and weight {weight.shape} "
                         "must be [..., H], [..., H] and [H].")
    if backend == "xla" or x.size == 0:  # no rows: nothing for a kernel to do
        return add_rms_norm_reference(x, delta, weight, eps)
    if chunk_of(hidden) is None:
        raise ValueError(f"add_rms_norm: hidden size {hidden} has no power-of-two piece of "
                         "16 to 4096 columns in at most 8 pieces; use the XLA backend.")
    lead = x.shape[:-1]
    flat = lambda a: None if a is None else a.reshape(-1, hidden)
    h, y = add_rms_norm_pallas(flat(x), flat(delta), weight, float(eps),
                               interpret=interpret_mode(interpret))
    return (x if delta is None else h.reshape(x.shape)), y.reshape(*lead, hidden)
