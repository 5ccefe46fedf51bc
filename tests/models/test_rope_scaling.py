"""RoPE scaling (issue 32, item 6): YaRN's inverse frequencies and attention factor against a
float64 numpy re-derivation written here from the paper (arXiv:2309.00071, sections 3.2-3.4)
and transformers' documented defaults, and a tiny YaRN checkpoint against transformers' logits
past its pretraining context (``tests/fixtures/tiny_yarn``, built by
``tests/fixtures/make_golden_yarn.py``), in the target and in the MTP draft.

The fixture's ``plain_logits`` (the same weights with plain RoPE) are 0.19 away from its YaRN
logits past position 16, 1900 times the tolerance: a model that dropped the scaling, or applied
it to the draft only, fails here.
"""

from __future__ import annotations

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.models.layers.rotary import apply_rotary, rope_cos_sin, rope_inv_freq
from mtp_jax.rope import DEFAULT_ROPE, RopeScaling, yarn_attention_factor
from tests.helpers.paths import FIXTURES

ATOL = RTOL = 1e-4
ORIGINAL = 16  # the fixture's original_max_position_embeddings


def yarn_inv_freq_f64(rotary_dim, theta, factor, original, beta_fast=32.0, beta_slow=1.0,
                      truncate=True):
    """YaRN's ``[rotary_dim // 2]`` inverse frequencies in float64, from the paper: dimension
    pair i has wavelength ``2 pi theta^(2i/d)``; it turns ``r_i = L / wavelength_i`` times over
    the original context L. Pairs turning more than beta_fast times keep their frequency, fewer
    than beta_slow times are divided by the factor, and between them the two are mixed linearly
    in i between the pair indices where r = beta_fast and r = beta_slow (rounded outward)."""
    d = rotary_dim
    i = np.arange(d // 2, dtype=np.float64)
    base = theta ** (-2.0 * i / d)

    def index_of(rotations):  # solve L * theta^(-2i/d) / (2 pi) = rotations for i
        return d * np.log(original / (2 * np.pi * rotations)) / (2 * np.log(theta))

    lo, hi = index_of(beta_fast), index_of(beta_slow)
    if truncate:
        lo, hi = np.floor(lo), np.ceil(hi)
    lo, hi = max(lo, 0.0), min(hi, d - 1.0)
    if lo == hi:
        hi += 0.001
    divided_share = np.clip((i - lo) / (hi - lo), 0.0, 1.0)
    return base / factor * divided_share + base * (1.0 - divided_share)


def yarn(factor, original, **kw) -> RopeScaling:
    return RopeScaling("yarn", factor=factor, original_max_position_embeddings=original,
                       attention_factor=yarn_attention_factor(factor), **kw)


@pytest.mark.parametrize("rotary_dim, theta, scaling", [
    (64, 1e7, yarn(4.0, 262144)),  # Qwen's long-context recipe on Qwen3.5 / 3.6
    (8, 100.0, yarn(4.0, ORIGINAL, beta_fast=2.0, beta_slow=0.125)),  # the fixture's
    (32, 1e4, yarn(8.0, 64, truncate=False)),  # fractional ramp ends
    (16, 5e5, yarn(2.0, 4096, beta_fast=16.0, beta_slow=2.0)),
])
def test_yarn_inv_freq_matches_float64_rederivation(rotary_dim, theta, scaling):
    want = yarn_inv_freq_f64(rotary_dim, theta, scaling.factor,
                             scaling.original_max_position_embeddings, scaling.beta_fast,
                             scaling.beta_slow, scaling.truncate)
    got = np.asarray(rope_inv_freq(rotary_dim, theta, scaling), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    plain = theta ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
    assert got[0] == pytest.approx(plain[0])
    assert got[-1] == pytest.approx(plain[-1] / scaling.factor)


def test_fixture_ramp_blends_every_way():
    """The fixture's four frequencies: kept, 2/3 kept, 1/3 kept, divided."""
    got = np.asarray(rope_inv_freq(8, 100.0, yarn(4.0, ORIGINAL, beta_fast=2.0, beta_slow=0.125)))
    plain = 100.0 ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(got / plain, [1.0, 0.75, 0.5, 0.25], rtol=1e-6)


def test_attention_factor():
    """0.1 ln(s) + 1 (paper eq. 22); the given value wins; DeepSeek's mscale ratio; 1 at s <= 1."""
    assert yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-15)
    assert yarn_attention_factor(4.0, attention_factor=0.8) == 0.8
    want = (0.1 * 0.707 * math.log(40) + 1) / (0.1 * 1.0 * math.log(40) + 1)
    assert yarn_attention_factor(40.0, mscale=0.707, mscale_all_dim=1.0) == pytest.approx(want)
    assert yarn_attention_factor(40.0, mscale=0.707) == pytest.approx(0.1 * math.log(40) + 1)
    assert yarn_attention_factor(1.0) == 1.0


def test_cos_sin_scaled_and_default_unchanged():
    pos = jnp.arange(40, dtype=jnp.int32)[None]
    s = yarn(4.0, 262144)
    cos, sin = rope_cos_sin(pos, 64, 1e7, s)
    ang = np.arange(40)[:, None] * yarn_inv_freq_f64(64, 1e7, 4.0, 262144)
    np.testing.assert_allclose(np.asarray(cos[0]), np.cos(ang) * s.attention_factor, atol=2e-6)
    np.testing.assert_allclose(np.asarray(sin[0]), np.sin(ang) * s.attention_factor, atol=2e-6)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 40, 2, 128)), jnp.float32)
    legacy = 1.0 / (1e7 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64))  # the old formula
    assert np.array_equal(np.asarray(rope_inv_freq(64, 1e7, DEFAULT_ROPE)), np.asarray(legacy))
    y = apply_rotary(x, pos, 64, 1e7, s)
    assert np.array_equal(np.asarray(y[..., 64:]), np.asarray(x[..., 64:]))  # pass-through dims


# ---- the golden checkpoint -------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden():
    with np.load(os.path.join(FIXTURES, "tiny_yarn", "golden.npz")) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def model():
    return mtp_jax.load_model(os.path.join(FIXTURES, "tiny_yarn"), dtype="float32")


def test_fixture_is_yarn_and_discriminates(golden):
    """No compile: the fixture's YaRN logits past the original context are far (> 100 x the
    tolerance) from what plain RoPE gives on the same weights."""
    cfg = mtp_jax.ModelConfig.from_folder(os.path.join(FIXTURES, "tiny_yarn"))
    assert cfg.rope_scaling == yarn(4.0, ORIGINAL, beta_fast=2.0, beta_slow=0.125)
    assert golden["input_ids"].shape[1] > 2 * ORIGINAL
    far = np.abs(golden["logits"] - golden["plain_logits"])[:, ORIGINAL:]
    assert far.max() > 100 * ATOL


def test_target_logits_match_transformers(model, golden):
    logits, hidden = model.forward(jnp.asarray(golden["input_ids"]))
    np.testing.assert_allclose(np.asarray(hidden), golden["hidden"], atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(np.asarray(logits), golden["logits"], atol=ATOL, rtol=RTOL)


def test_draft_logits_match_transformers_modules(model, golden):
    draft, _ = model.mtp_forward(jnp.asarray(golden["hidden"]),
                                 jnp.asarray(golden["mtp_next_ids"]))
    np.testing.assert_allclose(np.asarray(draft), golden["mtp_logits"], atol=ATOL, rtol=RTOL)
