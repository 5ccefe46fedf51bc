"""NeoX-style (rotate-half) rotary position embedding on the first ``rotary_dim`` channels, with
the RoPE scaling the config asks for (:class:`mtp_jax.rope.RopeScaling`).

Qwen3.5's mRoPE sections collapse to plain 1-D RoPE for text (the three position streams are
equal), so text positions use these functions directly. Every path that ropes (the XLA
attention, the fused Pallas prep, QSA's index heads and block keys, the MTP draft layers) takes
its tables from :func:`rope_inv_freq` and :func:`rope_cos_sin`, so all apply one scaling.

    inv_freq_i = theta^(-2i / rotary_dim)                          default, i < rotary_dim / 2
    inv_freq_i = theta^(-2i / rotary_dim) / factor                 linear
    inv_freq_i = interp_i * ramp_i + extrap_i * (1 - ramp_i)       yarn (arXiv:2309.00071 eq. 20)
        extrap_i = theta^(-2i / rotary_dim), interp_i = extrap_i / factor,
        ramp_i = clip((i - low) / (high - low), 0, 1), (low, high) = yarn_correction_range
    cos, sin = cos(p * inv_freq) * m, sin(p * inv_freq) * m         m = attention_factor (yarn)

The arithmetic follows transformers' (``_compute_yarn_parameters``; Qwen3_5TextRotaryEmbedding
multiplies cos and sin by the attention factor), in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mtp_jax.rope import DEFAULT_ROPE, RopeScaling, yarn_correction_range

F32 = jnp.float32


def yarn_ramp(low: float, high: float, half: int) -> jax.Array:
    """``[half]`` float32 ``clip((i - low) / (high - low), 0, 1)``: 0 where YaRN keeps the
    frequency (high frequencies, small i), 1 where it divides it by ``factor``; ``high`` is
    nudged by 0.001 when equal to ``low`` (as transformers does, against a division by 0)."""
    if low == high:
        high += 0.001
    return jnp.clip((jnp.arange(half, dtype=F32) - low) / (high - low), 0.0, 1.0)


def rope_inv_freq(rotary_dim: int, theta: float,
                  scaling: RopeScaling = DEFAULT_ROPE) -> jax.Array:
    """``[rotary_dim // 2]`` float32 inverse frequencies (radians per position) of the
    scaling's type (module docstring)."""
    exponents = jnp.arange(0, rotary_dim, 2, dtype=F32) / rotary_dim
    if scaling.rope_type == "default":
        return 1.0 / (theta ** exponents)
    if scaling.rope_type == "linear":
        return 1.0 / (theta ** exponents) / scaling.factor
    pos_freqs = theta ** exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    low, high = yarn_correction_range(scaling, rotary_dim, theta)
    keep = 1.0 - yarn_ramp(low, high, rotary_dim // 2)
    return interpolation * (1.0 - keep) + extrapolation * keep


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float,
                 scaling: RopeScaling = DEFAULT_ROPE,
                 inv_freq: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """``cos, sin [*positions.shape, rotary_dim // 2]`` float32 at integer ``positions``,
    multiplied by the scaling's attention factor (1 but for YaRN). ``inv_freq``: precomputed
    :func:`rope_inv_freq` (else computed here)."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    angles = positions.astype(F32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    return cos, sin


def apply_rotary(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float,
                 scaling: RopeScaling = DEFAULT_ROPE) -> jax.Array:
    """Rotate ``x [B, T, heads, D]`` at ``positions [B, T]`` (int32) on dims ``[0, rotary_dim)``.

    Pairs are ``(i, i + rotary_dim / 2)``; angles and the rotation in float32; channels past
    ``rotary_dim`` pass through (unscaled). Returns an array of ``x.dtype``.
    """
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, scaling)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xr = x[..., :rotary_dim].astype(F32)
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
