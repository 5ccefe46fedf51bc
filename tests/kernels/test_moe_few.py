"""Few-pairs routed-experts kernels (decode and verify rows): the kernels (interpreter) against
the XLA reference and a float64 loop, the ``pallas`` backend's dispatch and XLA escape, the
Triton lowering at the Qwen3.6-35B-A3B shape, and (GPU) the compiled kernels at that shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.models.layers.mlp import Experts
from pallas_kernels.moe import api
from pallas_kernels.moe.few import (FewTiles, check_few_tiles, default_few_tiles,
                                    moe_experts_few, moe_experts_few_weighted)
from pallas_kernels.moe.reference import moe_experts_reference
from tests.helpers.triton_lowering import lower_for_cuda

A3B = dict(e=256, k=8, h=2048, i=512)  # Qwen3.6-35B-A3B routed experts
FLASH = dict(e=512, k=10, h=2560, i=640)  # H and I not powers of two
E, K, H, I = 8, 4, 64, 32  # small: 8 experts, top-4, so tokens share experts
TILES = [FewTiles(16, 32, 16, 16),  # two H steps (gate/up), two I steps per pair (down)
         FewTiles(32, 64, 32, 32, num_warps=2, num_stages=2)]  # one step each


def _weights(seed, e, h, i, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    return (jnp.asarray(r.standard_normal((e, 2 * i, h)) * h ** -0.5, dtype),
            jnp.asarray(r.standard_normal((e, h, i)) * i ** -0.5, dtype))


def _inputs(seed, n, h=H, k=K, e=E, dtype=jnp.float32):
    """Token rows, top-k style ids (distinct within a token, shared across tokens) and routing
    weights."""
    r = np.random.default_rng(seed)
    ids = np.stack([r.choice(e, k, replace=False) for _ in range(n)])
    return (jnp.asarray(r.standard_normal((n, h)), dtype), jnp.asarray(ids, jnp.int32),
            jnp.asarray(r.random((n, k)) + 0.1, jnp.float32))


def _numpy_weighted(x, ids, w, gu, dn):
    """float64 loop: sum_j w[n, j] * down_e @ (silu(gate_e @ x) * (up_e @ x))."""
    x, ids, w, gu, dn = (np.asarray(a, np.float64) for a in (x, ids, w, gu, dn))
    i = dn.shape[-1]
    out = np.zeros_like(x)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = gu[e, :i] @ x[t], gu[e, i:] @ x[t]
            out[t] += w[t, j] * (dn[e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("n,tiles", [(1, TILES[0]), (3, TILES[0]), (4, TILES[0]), (8, TILES[0]),
                                     (3, TILES[1])])
def test_interpret_matches_reference(n, tiles):
    gu, dn = _weights(n, E, H, I)
    x, ids, w = _inputs(100 + n, n)
    assert n == 1 or np.unique(np.asarray(ids)).size < ids.size  # experts repeat across tokens
    got = moe_experts_few(x, ids, gu, dn, tiles=tiles, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(moe_experts_reference(x, ids, gu, dn)),
                               rtol=1e-5, atol=1e-5)
    got_w = moe_experts_few_weighted(x, ids, w, gu, dn, tiles=tiles, interpret=True)
    assert got_w.shape == (n, H)
    np.testing.assert_allclose(np.asarray(got_w), _numpy_weighted(x, ids, w, gu, dn),
                               rtol=1e-5, atol=1e-5)


def test_interpret_bfloat16_repeats_within_token():
    """bf16 operands, f32 token rows (cast to the weights' dtype, as the reference does) and an
    expert twice in one token."""
    gu, dn = _weights(7, E, H, I, jnp.bfloat16)
    x, _, w = _inputs(8, 4, dtype=jnp.float32)
    ids = jnp.asarray([[1, 1, 2, 3], [3, 0, 1, 7], [7, 6, 5, 4], [2, 2, 2, 2]], jnp.int32)
    ref = moe_experts_reference(x, ids, gu, dn)
    got = moe_experts_few(x, ids, gu, dn, tiles=TILES[0], interpret=True)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-2, atol=1e-2)
    got_w = moe_experts_few_weighted(x.astype(jnp.bfloat16), ids, w, gu, dn, tiles=TILES[0],
                                     interpret=True)
    assert got_w.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got_w, np.float32), _numpy_weighted(
        x.astype(jnp.bfloat16), ids, w, gu, dn), rtol=2e-2, atol=2e-2)


def test_pallas_backend_dispatch():
    """Few pairs take the few kernels (interpreter), H not a multiple of 16 takes XLA (runs on a
    CPU without the interpreter), more pairs than experts the grouped kernels (lowered)."""
    gu, dn = _weights(9, E, H, I)
    x, ids, w = _inputs(10, 2)
    ref = moe_experts_reference(x, ids, gu, dn)
    want_w = _numpy_weighted(x, ids, w, gu, dn)
    few = api.moe_experts(x, ids, gu, dn, backend="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(few), np.asarray(ref), rtol=1e-5, atol=1e-5)
    few_w = api.moe_experts_weighted(x, ids, w, gu, dn, backend="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(few_w), want_w, rtol=1e-5, atol=1e-5)
    gu40, dn40 = _weights(11, E, 40, I)
    x40 = _inputs(12, 2, h=40)[0]
    escape = api.moe_experts_weighted(x40, ids, w, gu40, dn40, backend="pallas")  # no interpret
    np.testing.assert_allclose(np.asarray(escape), _numpy_weighted(x40, ids, w, gu40, dn40),
                               rtol=1e-5, atol=1e-5)
    for n, name in ((2, "moe_few_gate_up"), (3, "moe_gate_up")):  # 12 pairs > 8 experts
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*_inputs(0, n), gu, dn)]
        text = lower_for_cuda(lambda *a: api.moe_experts_weighted(*a, backend="pallas"), *args)
        assert name in text and ("moe_few" in text) == (name == "moe_few_gate_up")


def test_experts_module_pallas_keeps_xla_for_few_pairs():
    """``Experts`` with ``pallas`` sends decode rows to the XLA form (measured faster in the
    engine on the H200), not to the few kernels."""
    mod = Experts(E, H, I, jnp.bfloat16, backend="pallas")
    graphdef, state = nnx.split(mod)
    x, ids, w = _inputs(14, 1, dtype=jnp.bfloat16)
    text = lower_for_cuda(lambda s, *a: nnx.merge(graphdef, s)(*a), state, x, ids, w)
    assert "moe_few" not in text


def test_bad_inputs_raise():
    gu, dn = _weights(0, E, H, I)
    x, ids, w = _inputs(0, 2)
    with pytest.raises(ValueError, match="weights"):
        moe_experts_few_weighted(x, ids, w[:, :2], gu, dn, interpret=True)
    with pytest.raises(ValueError, match="weights"):
        api.moe_experts_weighted(x, ids, w.T, gu, dn)
    with pytest.raises(ValueError, match="dn_bk=48"):
        moe_experts_few(x, ids, gu, dn, tiles=TILES[0]._replace(dn_bk=48), interpret=True)
    with pytest.raises(ValueError, match="gu_bn=64"):  # does not divide I = 32
        check_few_tiles(TILES[0]._replace(gu_bn=64), H, I)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 32])
def test_default_tiles_fill_the_gpu(n):
    """Default tiles divide the A3B dims and give >= 128 programs per kernel (132 SMs)."""
    e, k, h, i = A3B["e"], A3B["k"], A3B["h"], A3B["i"]
    for down_rows in (n, n * k):
        t = default_few_tiles(n * k, down_rows, h, i)
        check_few_tiles(t, h, i)
        assert n * k * (i // t.gu_bn) >= 128 and down_rows * (h // t.dn_bh) >= 128


@pytest.mark.parametrize("shape,n", [(A3B, 1), (A3B, 3), (A3B, 4), (A3B, 8), (A3B, 32),
                                     (FLASH, 1)])
def test_triton_lowering_real_shapes(shape, n):
    """Both forms lower for CUDA at the real shapes with their default tiles."""
    e, k, h, i = shape["e"], shape["k"], shape["h"], shape["i"]
    args = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int32),
            jax.ShapeDtypeStruct((n, k), jnp.float32),
            jax.ShapeDtypeStruct((e, 2 * i, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, h, i), jnp.bfloat16))
    for fn in (lambda x, ids, w, gu, dn: api.moe_experts(x, ids, gu, dn, backend="pallas"),
               lambda *a: api.moe_experts_weighted(*a, backend="pallas")):
        text = lower_for_cuda(fn, *args)
        assert "moe_few_gate_up" in text and "moe_few_down" in text


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 3, 4, 8, 32])
def test_gpu_few_kernels_match_reference(n):
    e, k, h, i = A3B["e"], A3B["k"], A3B["h"], A3B["i"]
    kg, kd = jax.random.split(jax.random.key(30))  # on device: the weights are GBs
    gu = (jax.random.normal(kg, (e, 2 * i, h)) * h ** -0.5).astype(jnp.bfloat16)
    dn = (jax.random.normal(kd, (e, h, i)) * i ** -0.5).astype(jnp.bfloat16)
    x, ids, w = _inputs(31, n, h, k, e, jnp.bfloat16)
    ref = jax.lax.map(lambda a: moe_experts_reference(a[0][None], a[1][None], gu, dn)[0],
                      (x, ids))  # one token at a time: the reference gathers f32 weights
    ref = np.asarray(ref, np.float32)
    got = jax.jit(lambda *a: api.moe_experts(*a, backend="pallas"))(x, ids, gu, dn)
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2e-2, atol=2e-2)
    got_w = jax.jit(lambda *a: api.moe_experts_weighted(*a, backend="pallas"))(x, ids, w, gu, dn)
    want_w = np.einsum("nkh,nk->nh", ref, np.asarray(w))
    np.testing.assert_allclose(np.asarray(got_w, np.float32), want_w, rtol=2e-2, atol=3e-2)
