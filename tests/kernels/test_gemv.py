"""The few-rows projection kernel (``pallas_kernels.gemv``) against float64 numpy and XLA
(interpret mode and the Triton lowering on CPU; compiled on a GPU), and its dispatch."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.compile_cache import CompilationCacheWarning
from pallas_kernels.gemv import (GemvTiles, default_tiles, few_rows_matmul, few_rows_reference,
                                 gemv)
from tests.helpers.triton_lowering import lower_for_cuda


def _inputs(m, n, k, dtype, seed=0):
    rng = np.random.default_rng(seed + 7 * n + k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype)


def _numpy(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


@pytest.mark.parametrize("form", ["fma", "fmar", "dot"])
@pytest.mark.parametrize("m", [1, 3])
def test_kernel_matches_float64(form, m):
    """Four programs of 16 columns, four contraction steps (state carried across steps)."""
    x, w = _inputs(m, 64, 256, jnp.float32, seed=m)
    y = few_rows_matmul(x, w, GemvTiles(16, 64, form), interpret=True)
    assert y.shape == (m, 64) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _numpy(x, w), rtol=1e-5, atol=1e-5)


def test_bf16_rounds_once():
    """bf16 in and out: each output is the float32 sum rounded once (within one bf16 ulp of
    the float64 product)."""
    x, w = _inputs(2, 32, 512, jnp.bfloat16)
    y = np.asarray(few_rows_matmul(x, w, GemvTiles(8, 128), interpret=True), np.float64)
    ref = _numpy(x, w)
    assert np.all(np.abs(y - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-6)


@pytest.mark.parametrize("form", ["fma", "dot"])
def test_rows_do_not_depend_on_the_row_count(form):
    x, w = _inputs(4, 32, 256, jnp.bfloat16, seed=5)
    t = GemvTiles(16, 128, form)
    y4 = np.asarray(few_rows_matmul(x, w, t, interpret=True), np.float32)
    for i in range(4):
        y1 = np.asarray(few_rows_matmul(x[i:i + 1], w, t, interpret=True), np.float32)
        np.testing.assert_array_equal(y1[0], y4[i])


def test_refuses_bad_tiles_and_shapes():
    x, w = _inputs(1, 48, 256, jnp.float32)
    with pytest.raises(ValueError, match="bn=32 must be a power of two >= 1 dividing N=48"):
        few_rows_matmul(x, w, GemvTiles(32, 64))
    with pytest.raises(ValueError, match="bn=8 must be a power of two >= 16"):
        few_rows_matmul(x, w, GemvTiles(8, 64, "dot"))
    with pytest.raises(ValueError, match="form 'mma' is unknown"):
        few_rows_matmul(x, w, GemvTiles(16, 64, "mma"))
    with pytest.raises(ValueError, match=r"must be \[M, K\]"):
        few_rows_matmul(x[:, :128], w, GemvTiles(16, 64))
    with pytest.raises(ValueError, match="backend 'cuda'"):
        gemv(x, w, backend="cuda")


def test_default_tiles_of_real_projections():
    # 2B gate/up, GDN in-projection, attention q/k/v; 27B gate/up
    assert default_tiles(12288, 2048) == GemvTiles(8, 512)
    assert default_tiles(8224, 2048) == GemvTiles(8, 512)
    assert default_tiles(5120, 2048) == GemvTiles(8, 512)
    assert default_tiles(34816, 5120) == GemvTiles(4, 512)  # 27B gate/up
    assert default_tiles(4096, 1024) == GemvTiles(16, 512)
    # XLA keeps narrow outputs (2B down / o_proj) and K without a 256 multiple
    assert default_tiles(2048, 6144) is None and default_tiles(8192, 200) is None


def _has_pallas(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch_takes_the_kernel_for_one_wide_row_only():
    x, w = _inputs(2, 4096, 256, jnp.float32, seed=1)
    one = x[:1].reshape(1, 1, 256)
    assert _has_pallas(lambda a, b: gemv(a, b, backend="pallas"), one, w)
    assert not _has_pallas(lambda a, b: gemv(a, b, backend="pallas"), x, w)  # two rows
    assert not _has_pallas(lambda a, b: gemv(a, b, backend="pallas"), one, w[:2048])
    assert not _has_pallas(lambda a, b: gemv(a, b, backend="xla"), one, w)
    y = gemv(one, w, backend="pallas")
    assert y.shape == (1, 1, 4096)
    np.testing.assert_allclose(np.asarray(y[0]), _numpy(one[0], w), rtol=1e-5, atol=1e-5)


def test_merged_linear_backend_and_loader_wiring():
    from mtp_jax.config import ConfigError
    from mtp_jax.models.layers.basic import MergedLinear, set_gemv_backend
    from mtp_jax.models.loader import load_model
    from tests.helpers.paths import fixture_path

    _, w1 = _inputs(1, 4000, 256, jnp.float32, seed=2)
    _, w2 = _inputs(1, 96, 256, jnp.float32, seed=3)
    x, _ = _inputs(1, 4, 256, jnp.float32, seed=4)
    merged = MergedLinear([w1, w2])
    ref = merged(x)
    assert set_gemv_backend(merged, "pallas") == 1 and merged.backend == "pallas"
    out = merged(x)
    assert [o.shape for o in out] == [(1, 4000), (1, 96)]
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        load_model(fixture_path("tiny_dense"), "float32", gemv_backend="pallas")


@pytest.mark.parametrize("n,k", [(4096, 2048), (8224, 2048)])
def test_lowers_to_triton(n, k):
    x, w = _inputs(1, n, k, jnp.bfloat16)
    text = lower_for_cuda(lambda a, b: few_rows_matmul(a, b, default_tiles(n, k),
                                                       interpret=False), x, w)
    assert "few_rows_matmul" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 12288, 2048), (1, 8224, 2048), (1, 5120, 2048),
                                   (4, 5120, 2048), (1, 34816, 5120)])
def test_gpu_kernel_matches_xla(m, n, k):
    x, w = _inputs(m, n, k, jnp.bfloat16, seed=m)
    tiles = default_tiles(n, k)
    y = np.asarray(few_rows_matmul(x, w, tiles), np.float32)
    # XLA with float32 sums rounded once (its plain bf16 einsum may round split-K partials)
    y_x = np.asarray(few_rows_reference(x, w), np.float32)
    ref = _numpy(x, w)
    assert np.all(np.abs(y - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-5)
    assert np.all(np.abs(y - y_x) <= 2.0 ** -7 * np.abs(y_x) + 1e-5)


# XLA's multiply-reduce form (backend "reduce")


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 2.0 ** -8)])
def test_reduce_form_matches_float64(dtype, bound):
    """One row ``[1, 1, K]``: float32 sums of the products, rounded once to ``w.dtype``."""
    from pallas_kernels.gemv import reduce_matmul

    x, w = _inputs(1, 96, 640, dtype, seed=11)
    y = reduce_matmul(x.reshape(1, 1, 640), w)
    assert y.shape == (1, 1, 96) and y.dtype == dtype
    ref = _numpy(x, w)[0]
    assert np.all(np.abs(np.asarray(y, np.float64)[0, 0] - ref) <= bound * np.abs(ref) + 1e-6)
    with pytest.raises(ValueError, match=r"must be \[..., K\] and \[N, K\]"):
        reduce_matmul(x[:, :64], w)


def _ops(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def test_dispatch_takes_the_reduce_form_for_one_row_up_to_max_k():
    from pallas_kernels.gemv.reduce_form import MAX_K

    x, w = _inputs(2, 64, 256, jnp.float32, seed=12)
    one = x[:1].reshape(1, 1, 256)
    reduce = lambda a, b: gemv(a, b, backend="reduce")
    text = _ops(reduce, one, w)
    assert "reduce_sum" in text and "dot_general" not in text
    assert "dot_general" in _ops(reduce, x, w)  # two rows: XLA's dot
    _, long_w = _inputs(1, 8, MAX_K + 256, jnp.float32, seed=13)
    long_x = jnp.ones((1, MAX_K + 256), jnp.float32)
    assert "dot_general" in _ops(reduce, long_x, long_w)  # K above MAX_K: XLA's dot
    np.testing.assert_allclose(np.asarray(gemv(one, w, backend="reduce"))[0],
                               _numpy(one[0], w), rtol=1e-5, atol=1e-5)


def test_reduce_backend_reaches_every_projection_and_matches_hf():
    """``load_model(gemv_backend="reduce")`` routes the one-row calls of the merged and plain
    projections and of the LM head through the reduce form; one-row cached decode logits
    match HF's (golden fixture, float32), row by row."""
    from flax import nnx

    from mtp_jax.cache.paged import AttentionBatch
    from mtp_jax.models.layers.basic import Embed, Linear, MergedLinear
    from mtp_jax.models.loader import load_model
    from tests.helpers.paths import fixture_path
    from tests.helpers.model_backends import prefill_one_row

    g = np.load(fixture_path("tiny_dense") + "/golden.npz")
    m = load_model(fixture_path("tiny_dense"), "float32", with_mtp=False, gemv_backend="reduce")
    assert m.cfg.kernels.gemv == "reduce"
    model = nnx.merge(m.graphdef, m.params)
    kinds = [type(n) for _, n in nnx.iter_graph(model)
             if isinstance(n, (Linear, MergedLinear, Embed))]
    assert Linear in kinds and MergedLinear in kinds and Embed in kinds
    assert all(n.backend == "reduce" for _, n in nnx.iter_graph(model)
               if isinstance(n, (Linear, MergedLinear, Embed)))
    hidden = jnp.ones((1, 1, m.cfg.hidden_size), jnp.float32)
    assert "dot_general" not in _ops(model.logits, hidden)
    t = g["input_ids"].shape[1]
    for row in range(g["input_ids"].shape[0]):
        kv, gdn, table = prefill_one_row(model, m.cfg, g["input_ids"][row:row + 1])
        for step in range(3):
            p = jnp.full((1, 1), t + step, jnp.int32)
            tok = jnp.asarray(g["greedy_tokens"][row:row + 1, step:step + 1])
            hidden, kv, gdn = model(tok, AttentionBatch(p, jnp.ones((1, 1), bool), table), kv,
                                    gdn, "decode")
            np.testing.assert_allclose(np.asarray(model.logits(hidden))[0, 0],
                                       g["decode_logits"][row, step], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm", ["none", "mtp"])
def test_reduce_backend_greedy_generation_matches_hf(algorithm):
    """The engine at batch 1 with ``gemv_backend="reduce"`` (its one-row decode steps and MTP
    draft steps take the reduce form; a verify window takes XLA's dot) reproduces HF's greedy
    continuation of each golden prompt (float32), with speculation off and on."""
    from mtp_jax import LLM, SamplingParams
    from tests.helpers.paths import fixture_path

    g = np.load(fixture_path("tiny_dense") + "/golden.npz")
    with warnings.catch_warnings():  # the cache moving off, when an earlier test turned it on
        warnings.simplefilter("ignore", CompilationCacheWarning)
        llm = LLM(fixture_path("tiny_dense"), dtype="float32", max_running_requests=1,
                  speculative_algorithm=algorithm, speculative_num_steps=2,
                  gemv_backend="reduce", compilation_cache_dir="none")
    assert llm.engine.model.cfg.kernels.gemv == "reduce"
    n = g["greedy_tokens"].shape[1]
    for row, ref in zip(g["input_ids"], g["greedy_tokens"]):
        out = llm.generate([row.tolist()], SamplingParams(temperature=0, max_tokens=n,
                                                          ignore_eos=True))[0]
        assert out.token_ids == ref.tolist()
