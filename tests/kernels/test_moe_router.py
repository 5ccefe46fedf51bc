"""MoE softmax top-k routing: the one-kernel Pallas router against a float64 numpy derivation
and the XLA reference (interpret mode and the Triton lowering on CPU; compiled on a GPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.router import route_topk
from tests.helpers.triton_lowering import lower_for_cuda


def _numpy_route(logits, top_k, normalize):
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]  # ties: lower id first
    w = np.take_along_axis(p, ids, -1)
    if normalize:
        w /= w.sum(-1, keepdims=True)
    return w, ids


@pytest.mark.parametrize("n,e,top_k,normalize", [(3, 256, 8, True), (5, 64, 10, True),
                                                 (2, 32, 3, False)])
def test_pallas_router_matches_numpy_and_xla(n, e, top_k, normalize):
    rng = np.random.default_rng(e + top_k)
    logits = (2 * rng.standard_normal((n, e))).astype(np.float32)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1.0  # a tie at the top: id 5 first
    w_np, ids_np = _numpy_route(logits, top_k, normalize)
    for backend in ("xla", "pallas"):
        w, ids = route_topk(jnp.asarray(logits, jnp.bfloat16 if e == 64 else jnp.float32),
                            top_k, normalize=normalize, backend=backend, interpret=True)
        assert w.dtype == jnp.float32 and ids.dtype == jnp.int32 and w.shape == (n, top_k)
        if e != 64:
            np.testing.assert_array_equal(np.asarray(ids), ids_np)
            np.testing.assert_allclose(np.asarray(w), w_np, rtol=2e-6, atol=1e-7)
        assert list(np.asarray(ids)[0, :2]) == [5, 9]
    xla = route_topk(jnp.asarray(logits), top_k, normalize=normalize, backend="xla")
    pallas = route_topk(jnp.asarray(logits), top_k, normalize=normalize, backend="pallas",
                        interpret=True)
    np.testing.assert_array_equal(np.asarray(pallas[1]), np.asarray(xla[1]))
    np.testing.assert_allclose(np.asarray(pallas[0]), np.asarray(xla[0]), rtol=1e-6)


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_router_reads_the_first_experts_columns_in_place(interpret):
    """A merged projection's output ``[logits | shared gate | ...]``: only the first E columns
    are routed over (the rest are large, so reading them would change the result)."""
    rng = np.random.default_rng(11)
    logits = (2 * rng.standard_normal((3, 64))).astype(np.float32)
    wide = np.concatenate([logits, 40 + rng.standard_normal((3, 37)).astype(np.float32)], -1)
    w_np, ids_np = _numpy_route(logits, 8, True)
    for backend in ("xla", "pallas"):
        w, ids = route_topk(jnp.asarray(wide), 8, normalize=True, backend=backend,
                            num_experts=64, interpret=interpret)
        np.testing.assert_array_equal(np.asarray(ids), ids_np)
        np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-5, atol=1e-7)


def test_router_refuses_bad_input():
    logits = jnp.ones((2, 48))
    with pytest.raises(ValueError, match="power of two"):
        route_topk(logits, 4, normalize=True, backend="pallas")
    with pytest.raises(ValueError, match="top_k=49"):
        route_topk(logits, 49, normalize=True)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        route_topk(logits, 4, normalize=True, backend="cuda")
    with pytest.raises(ValueError, match="num_experts=64"):
        route_topk(logits, 4, normalize=True, num_experts=64)


def test_router_lowers_to_triton():
    text = lower_for_cuda(lambda x: route_topk(x, 8, normalize=True, backend="pallas",
                                               interpret=False),
                          jnp.ones((4, 256), jnp.float32))
    assert "moe_route_topk" in text


@pytest.mark.gpu
@pytest.mark.parametrize("n,e,top_k", [(1, 256, 8), (32, 256, 8), (128, 512, 10)])
def test_gpu_router_matches_numpy(n, e, top_k):
    rng = np.random.default_rng(n)
    logits = (2 * rng.standard_normal((n, e))).astype(np.float32)
    w_np, ids_np = _numpy_route(logits, top_k, True)
    w, ids = route_topk(jnp.asarray(logits), top_k, normalize=True, backend="pallas")
    np.testing.assert_array_equal(np.asarray(ids), ids_np)
    np.testing.assert_allclose(np.asarray(w), w_np, rtol=1e-5, atol=1e-7)
