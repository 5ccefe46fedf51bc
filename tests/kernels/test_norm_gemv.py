"""The fused add + RMSNorm + one-row projection (+ SwiGLU) kernel against a float64 numpy
re-derivation (interpret mode on the CPU; the Triton kernel on a GPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv.norm_gemv import NormGemvTiles, norm_gemv, norm_gemv_reference

EPS = 1e-6


def numpy_norm_gemv(x, d, nw, w, act):
    """float64: h = x + d; hn = h / rms(h) * (1 + nw); p = hn @ w.T; SwiGLU."""
    x, nw, w = (np.asarray(a, np.float64) for a in (x, nw, w))
    h = x if d is None else x + np.asarray(d, np.float64)
    hn = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * (1 + nw)
    p = hn @ w.T
    if act == "silu_mul":
        i = w.shape[0] // 2
        g = p[..., :i]
        p = g / (1 + np.exp(-g)) * p[..., i:]
    return h, p


def inputs(seed, n, k, dtype, with_delta=True):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (1, 1, k), jnp.float32).astype(dtype)
    d = jax.random.normal(ks[1], (1, 1, k), jnp.float32).astype(dtype) if with_delta else None
    nw = (0.3 * jax.random.normal(ks[2], (k,), jnp.float32)).astype(dtype)
    w = (jax.random.normal(ks[3], (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, d, nw, w


@pytest.mark.parametrize("act,with_delta,tiles", [
    ("silu_mul", True, NormGemvTiles(8, 64, 4, 1, False)),
    (None, True, NormGemvTiles(4, 128, 4, 0, True)),
    (None, False, NormGemvTiles(16, 64, 4, 4, False)),
])
def test_norm_gemv_float32_matches_float64(act, with_delta, tiles):
    """float32 on random inputs: h and y within float32 rounding of the float64 re-derivation;
    the tiles cover one and several pieces of K, weights loaded before and after the norm, and
    both accumulator forms."""
    x, d, nw, w = inputs(1, 96, 256, jnp.float32, with_delta)
    h, y = norm_gemv(x, d, nw, w, EPS, act=act, tiles=tiles)
    h64, y64 = numpy_norm_gemv(x, d, nw, w, act)
    np.testing.assert_allclose(np.asarray(h), h64, rtol=0, atol=1e-6)
    assert y.shape == (1, 1, 48 if act else 96)
    np.testing.assert_allclose(np.asarray(y), y64, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("act", ["silu_mul", None])
def test_norm_gemv_bf16_matches_xla_roundings(act):
    """bf16: equal to the XLA composition (add, norm, projection, SwiGLU with its roundings)
    but for the order of float32 sums: within a bf16 ulp or two."""
    x, d, nw, w = inputs(2, 64, 512, jnp.bfloat16)
    h, y = norm_gemv(x, d, nw, w, EPS, act=act, tiles=NormGemvTiles(8, 256, 4, 1, True))
    hr, yr = norm_gemv_reference(x, d, nw, w, EPS, act)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(hr, np.float32))
    yr32 = np.asarray(yr, np.float32)
    diff = np.abs(np.asarray(y, np.float32) - yr32)
    assert np.all(diff <= 2 ** -7 * np.abs(yr32) + 1e-3), diff.max()
    _, y64 = numpy_norm_gemv(x, d, nw, w, act)
    assert np.max(np.abs(np.asarray(y, np.float64) - y64)) < 0.05 * np.max(np.abs(y64))


def test_norm_gemv_small_rows_see_eps():
    """A row of tiny values (mean of squares 1e-8, below eps = 1e-6): eps sets the scale, so a
    kernel that dropped it (or misplaced it) would be off by a factor of about 10."""
    x, d, nw, w = inputs(4, 64, 128, jnp.float32)
    x, d = x * 1e-4, d * 1e-4
    h, y = norm_gemv(x, d, nw, w, EPS, act="silu_mul", tiles=NormGemvTiles(8, 64, 4, 0, False))
    h64, y64 = numpy_norm_gemv(x, d, nw, w, "silu_mul")
    np.testing.assert_allclose(np.asarray(h), h64, rtol=0, atol=1e-10)
    np.testing.assert_allclose(np.asarray(y), y64, rtol=2e-5, atol=1e-7)


def test_norm_gemv_rejects_bad_input():
    x, d, nw, w = inputs(3, 96, 256, jnp.float32)
    with pytest.raises(ValueError, match="one row"):
        norm_gemv(jnp.concatenate([x, x], 1), None, nw, w, EPS)
    with pytest.raises(ValueError, match="bn=64"):
        norm_gemv(x, d, nw, w, EPS, act="silu_mul", tiles=NormGemvTiles(64, 64))
    with pytest.raises(ValueError, match="act"):
        norm_gemv(x, d, nw, w, EPS, act="gelu")
    with pytest.raises(ValueError, match="even"):
        norm_gemv(x, d, nw, w[:95], EPS, act="silu_mul")


def test_decoder_fused_matches_hf_decode_logits():
    """One-row steps of the tiny dense fixture with the gemv backend ``fused`` give HF's
    cached decode logits (golden fixture, float32; interpret mode on the CPU), and the kernel
    is in the traced step (each MLP's add + norm + gate/up + SwiGLU), in decode mode with the
    fused GDN decode (GDN backend ``pallas``), as the engine's batch-1 steps run on a GPU."""
    from flax import nnx

    from tests.helpers.paths import fixture_path
    from mtp_jax.cache.paged import AttentionBatch
    from mtp_jax.models.layers.basic import set_gemv_backend
    from mtp_jax.models.loader import load_model
    from tests.helpers.model_backends import prefill_one_row

    g = np.load(fixture_path("tiny_dense") + "/golden.npz")
    m = load_model(fixture_path("tiny_dense"), "float32", with_mtp=False)
    model = nnx.merge(m.graphdef, m.params)
    assert set_gemv_backend(model, "fused") > 0
    for layer in model.layers:
        if layer.layer_type != "full_attention":
            layer.linear_attn.backend = "pallas"
    ids = g["input_ids"][:1]
    t = ids.shape[1]
    kv, gdn, table = prefill_one_row(model, m.cfg, ids)
    tokens = g["greedy_tokens"][:1]
    for step in range(3):
        batch = AttentionBatch(jnp.full((1, 1), t + step, jnp.int32), jnp.ones((1, 1), bool),
                               table)
        tok = jnp.asarray(tokens[:, step:step + 1])
        if step == 0:
            text = str(jax.make_jaxpr(lambda a, b, c: model(a, batch, b, c, "decode"))(
                tok, kv, gdn))
            assert text.count("name=norm_gemv_pallas") == m.cfg.num_hidden_layers
        hidden, kv, gdn = model(tok, batch, kv, gdn, "decode")
        logits = np.asarray(model.logits(hidden))[0, 0]
        np.testing.assert_allclose(logits, g["decode_logits"][0, step], atol=1e-4, rtol=1e-4)


def test_supports_bounds_the_pieces():
    """Shapes the kernel compiles quickly (at most 16 power-of-two pieces of K, up to 1024
    each): the released hidden sizes, the tiny fixture's; not K = 1000 (125 pieces of 8), nor
    an odd [gate; up]."""
    from pallas_kernels.gemv.norm_gemv import supports

    assert supports((12288, 2048), "silu_mul") and supports((34816, 5120), "silu_mul")
    assert supports((256, 64), "silu_mul") and supports((8224, 2048), None)
    assert not supports((256, 1000), "silu_mul")  # 125 pieces of 8
    assert not supports((255, 64), "silu_mul")
