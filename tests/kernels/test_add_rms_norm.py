"""The fused residual add + RMSNorm kernel against a float64 numpy derivation and the XLA
reference (interpret mode and the Triton lowering on CPU; compiled on a GPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm import add_rms_norm, chunk_of
from tests.helpers.triton_lowering import lower_for_cuda

EPS = 1e-6


def _inputs(rows, hidden, dtype, seed=0):
    rng = np.random.default_rng(seed + hidden)
    x = (3 * rng.standard_normal((rows, hidden))).astype(np.float32)
    d = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = (0.3 * rng.standard_normal(hidden)).astype(np.float32)
    return (jnp.asarray(x, dtype), jnp.asarray(d, dtype), jnp.asarray(w, dtype))


def _numpy(h, w):
    h = np.asarray(h, np.float64)
    return h / np.sqrt(np.mean(h * h, -1, keepdims=True) + EPS) * (1 + np.asarray(w, np.float64))


@pytest.mark.parametrize("hidden", [256, 640, 6144])  # one piece of 256; 5 of 128; 3 of 2048
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pallas_matches_numpy_and_xla(hidden, dtype):
    x, d, w = _inputs(3, hidden, dtype)
    h_x, y_x = add_rms_norm(x, d, w, EPS, backend="xla")
    h_p, y_p = add_rms_norm(x, d, w, EPS, backend="pallas", interpret=True)
    assert h_p.dtype == y_p.dtype == dtype and y_p.shape == (3, hidden)
    np.testing.assert_array_equal(np.asarray(h_p, np.float32), np.asarray(h_x, np.float32))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    ref = _numpy(h_x, w)
    np.testing.assert_allclose(np.asarray(y_p, np.float32), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(y_x, np.float32), ref, rtol=tol, atol=tol)


def test_without_delta_and_leading_axes():
    x, _, w = _inputs(6, 512, jnp.float32)
    x = x.reshape(2, 3, 512)
    h, y = add_rms_norm(x, None, w, EPS, backend="pallas", interpret=True)
    assert h is x and y.shape == (2, 3, 512)
    np.testing.assert_allclose(np.asarray(y), _numpy(x, w), rtol=1e-5, atol=1e-5)


def test_no_rows():
    x, d, w = _inputs(0, 64, jnp.float32)
    h, y = add_rms_norm(x, d, w, EPS, backend="pallas", interpret=True)
    assert h.shape == y.shape == (0, 64)


def test_rows_do_not_depend_on_the_row_count():
    """A verify window (k + 1 rows) and a decode step (1 row) must agree row for row."""
    x, d, w = _inputs(4, 640, jnp.bfloat16, seed=3)
    _, y4 = add_rms_norm(x, d, w, EPS, backend="pallas", interpret=True)
    for i in range(4):
        _, y1 = add_rms_norm(x[i:i + 1], d[i:i + 1], w, EPS, backend="pallas", interpret=True)
        np.testing.assert_array_equal(np.asarray(y1[0], np.float32),
                                      np.asarray(y4[i], np.float32))


def test_chunk_of_real_hidden_sizes():
    assert [chunk_of(h) for h in (2048, 4096, 5120, 6144, 8192)] == [2048, 4096, 1024, 2048,
                                                                    4096]
    assert chunk_of(64) == 64 and chunk_of(200) is None and chunk_of(8) is None


def test_refuses_bad_input():
    x, d, w = _inputs(2, 200, jnp.float32)
    with pytest.raises(ValueError, match="hidden size 200"):
        add_rms_norm(x, d, w, EPS, backend="pallas")
    with pytest.raises(ValueError, match="backend 'cuda'"):
        add_rms_norm(x, d, w, EPS, backend="cuda")
    with pytest.raises(ValueError, match=r"must be \[..., H\]"):
        add_rms_norm(x, d[:, :100], w, EPS)


@pytest.mark.parametrize("hidden", [2048, 5120])
def test_lowers_to_triton(hidden):
    x, d, w = _inputs(4, hidden, jnp.bfloat16)
    text = lower_for_cuda(lambda a, b, c: add_rms_norm(a, b, c, EPS, backend="pallas",
                                                       interpret=False), x, d, w)
    assert "add_rms_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("rows,hidden", [(1, 2048), (4, 5120), (300, 2048)])
def test_gpu_kernel_matches_xla(rows, hidden):
    x, d, w = _inputs(rows, hidden, jnp.bfloat16, seed=rows)
    h_x, y_x = add_rms_norm(x, d, w, EPS, backend="xla")
    h_p, y_p = add_rms_norm(x, d, w, EPS, backend="pallas")
    np.testing.assert_array_equal(np.asarray(h_p, np.float32), np.asarray(h_x, np.float32))
    np.testing.assert_allclose(np.asarray(y_p, np.float32), _numpy(h_x, w), rtol=1e-2,
                               atol=1e-2)
    # at most one bf16 ulp from XLA's order of summation
    diff = np.abs(np.asarray(y_p, np.float32) - np.asarray(y_x, np.float32))
    assert np.all(diff <= 2.0 ** -7 * np.abs(np.asarray(y_x, np.float32)) + 1e-6)


def test_model_with_the_pallas_norms_matches_xla():
    """The tiny dense model with its decoder norms, final norm and MTP norm on the kernel
    (interpret mode): the target's hidden states and the draft's output as with XLA."""
    from mtp_jax.cache.paged import AttentionBatch
    from mtp_jax.cache.pools import make_pools
    from mtp_jax.models.loader import load_model
    from tests.helpers.paths import fixture_path

    m = load_model(fixture_path("tiny_dense"), "float32", with_mtp=True)
    b, t = 2, 5
    rng = np.random.default_rng(7)
    ids = jnp.asarray(rng.integers(2, m.cfg.vocab_size, (b, t)), jnp.int32)
    pools = make_pools(m.cfg, num_pages=1 + b, page_size=8, slots=b, k=0, mtp=True,
                       dtype=jnp.float32)
    batch = AttentionBatch(jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                           jnp.ones((b, t), bool),
                           jnp.asarray(1 + np.arange(b)[:, None], jnp.int32))

    def run(backend):
        model = m.module()
        norms = [model.norm, model.mtp.norm] + [
            n for layer in list(model.layers) + list(model.mtp.layers)
            for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        for n in norms:
            n.backend = backend
        hidden, _, _ = model(ids, batch, pools.kv, pools.gdn, "prefill")
        z, _ = model.mtp(model.embed_tokens, hidden, ids, batch, pools.draft_kv)
        return np.asarray(hidden), np.asarray(z)

    (h_x, z_x), (h_p, z_p) = run("xla"), run("pallas")
    assert np.abs(h_x).max() > 0.1 and np.abs(z_x).max() > 0.1
    np.testing.assert_allclose(h_p, h_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(z_p, z_x, rtol=1e-5, atol=1e-5)
