"""NeoX-style (rotate-half) rotary position embedding on the first ``rotary_dim`` channels.

Qwen3.5's mRoPE sections collapse to plain 1-D RoPE for text (the three position streams are
equal), so text positions use this function directly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` at ``positions [B, T]`` (int32) on dims ``[0, rotary_dim)``.

    ``inv_freq_i = theta^(-2i / rotary_dim)``; angles in float32; channels past ``rotary_dim``
    pass through. Returns an array of ``x.dtype``.
    """
    half = rotary_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xr = x[..., :rotary_dim].astype(jnp.float32)
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
