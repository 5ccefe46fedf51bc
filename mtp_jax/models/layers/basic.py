"""Linear, embedding and zero-centred RMSNorm modules.

Parameter names and layouts follow the HF checkpoints (``weight [out, in]``) so that a loaded
tensor fills its parameter without transposition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    """``y = x @ weight.T`` with ``weight [out_features, in_features]`` (no bias)."""

    def __init__(self, in_features: int, out_features: int, dtype):
        self.weight = nnx.Param(jnp.zeros((out_features, in_features), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w)


class Embed(nnx.Module):
    """Token embedding ``weight [vocab, hidden]``; also the tied ``lm_head``."""

    def __init__(self, vocab: int, hidden: int, dtype):
        self.weight = nnx.Param(jnp.zeros((vocab, hidden), dtype))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Logits against the embedding matrix: ``[..., H] -> [..., V]`` (tied head)."""
        w = self.weight[...]
        return jnp.einsum("...h,vh->...v", x.astype(w.dtype), w)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis, in float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm of the Qwen3.5 family: ``x / rms(x) * (1 + w)``.

    Statistics and the scale in float32, result cast back to ``x.dtype``
    (HF ``Qwen3_5RMSNorm``). ``weight [dim]`` is stored zero-centred.
    """

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.zeros((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))
        return y.astype(x.dtype)
