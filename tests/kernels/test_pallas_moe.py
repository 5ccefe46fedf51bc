"""Routed MoE experts: the XLA reference against float64 numpy, the block routing's invariants,
the Pallas kernels (interpreter) and the ``xla`` backend against the reference, the Triton
lowering at the Qwen3.6-35B-A3B shape, and (GPU) the compiled kernels at that shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.models.layers.mlp import Experts
from pallas_kernels.moe import api
from pallas_kernels.moe.pallas import (MoeTiles, default_tiles, moe_experts_pallas,
                                       num_row_blocks, route_blocks)
from pallas_kernels.moe.reference import moe_experts_reference
from tests.helpers.triton_lowering import lower_for_cuda

A3B = dict(e=256, k=8, h=2048, i=512)  # Qwen3.6-35B-A3B routed experts
FLASH = dict(e=512, k=10, h=2560, i=640)  # Qwen3.8-Flash-Next: H and I not powers of two
TILES_16 = MoeTiles(bm=16, gu_bn=16, gu_bk=32, dn_bn=32, dn_bk=16)
TILES_16_UNSORTED = TILES_16._replace(sort_pairs=False)
TILES_64 = MoeTiles(bm=64, gu_bn=32, gu_bk=16, dn_bn=16, dn_bk=32)


def _weights(seed, e, h, i, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    gu = r.standard_normal((e, 2 * i, h)) * h ** -0.5
    dn = r.standard_normal((e, h, i)) * i ** -0.5
    return jnp.asarray(gu, dtype), jnp.asarray(dn, dtype)


def _routing(seed, n, k, e, kind="distinct"):
    """``distinct``: top-k style (distinct experts per token); ``skewed``: most pairs on two
    experts (several blocks per expert, most experts empty); ``repeats``: ids drawn with
    replacement (an expert may repeat within a token)."""
    r = np.random.default_rng(seed)
    if kind == "distinct":
        ids = np.stack([r.choice(e, k, replace=False) for _ in range(n)])
    elif kind == "skewed":
        hot = r.choice([3, e - 1], (n, k))
        ids = np.where(r.random((n, k)) < 0.8, hot, r.integers(0, e, (n, k)))
    else:
        ids = r.integers(0, e, (n, k))
    return jnp.asarray(ids, jnp.int32)


def _x(seed, n, h, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n, h)), dtype)


def _numpy_experts(x, ids, gu, dn):
    """float64 loop over pairs: down_e @ (silu(gate_e @ x) * (up_e @ x))."""
    x, ids, gu, dn = (np.asarray(a, np.float64) for a in (x, ids, gu, dn))
    i = dn.shape[-1]
    out = np.zeros(ids.shape + (x.shape[1],))
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = gu[e, :i] @ x[t], gu[e, i:] @ x[t]
            out[t, j] = dn[e] @ (g / (1 + np.exp(-g)) * u)
    return out


def test_reference_matches_float64_numpy():
    gu, dn = _weights(0, 8, 32, 16)
    x, ids = _x(1, 5, 32), _routing(2, 5, 3, 8, "repeats")
    np.testing.assert_allclose(np.asarray(moe_experts_reference(x, ids, gu, dn)),
                               _numpy_experts(x, ids, gu, dn), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,e,bm", [(1, 8, 64, 16), (37, 6, 8, 16), (37, 2, 64, 64),
                                      (300, 4, 16, 128)])
@pytest.mark.parametrize("kind", ["distinct", "skewed", "repeats"])
def test_route_blocks_invariants(n, k, e, bm, kind):
    ids = _routing(3, n, k, e, kind)
    block_expert, row_pair = map(np.asarray, jax.jit(route_blocks, static_argnums=(1, 2))(
        ids, e, bm))
    p, flat = n * k, np.asarray(ids).reshape(-1)
    assert block_expert.shape == (num_row_blocks(p, e, bm),) and row_pair.shape == (
        block_expert.size * bm,)
    counts = np.bincount(flat, minlength=e)
    used = int(np.sum(-(-counts // bm)))
    np.testing.assert_array_equal(block_expert[used:], -1)  # unused blocks at the end
    assert np.all(block_expert[:used] >= 0)
    real = row_pair < p
    np.testing.assert_array_equal(np.sort(row_pair[real]), np.arange(p))  # each pair once
    row_expert = np.repeat(block_expert, bm)
    np.testing.assert_array_equal(flat[row_pair[real]], row_expert[real])  # its expert's block
    np.testing.assert_array_equal(row_pair[used * bm:], p)


@pytest.mark.parametrize("n,k,e,kind,tiles", [
    (1, 8, 64, "distinct", TILES_16),
    (4, 2, 8, "distinct", TILES_16),
    (8, 4, 16, "repeats", TILES_16),
    (8, 4, 16, "repeats", TILES_16_UNSORTED),  # one block per pair (decode form)
    (37, 6, 8, "distinct", TILES_16),  # several blocks per expert
    (37, 3, 64, "skewed", TILES_16),  # most experts get zero tokens
    (37, 5, 32, "skewed", TILES_64),
])
def test_pallas_interpret_matches_reference(n, k, e, kind, tiles):
    h, i = (32, 64) if tiles is TILES_64 else (64, 32)
    gu, dn = _weights(4, e, h, i)
    x, ids = _x(5, n, h), _routing(6, n, k, e, kind)
    got = api.moe_experts(x, ids, gu, dn, backend="pallas", tiles=tiles, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(moe_experts_reference(x, ids, gu, dn)),
                               rtol=1e-5, atol=1e-5)


def test_pallas_interpret_bfloat16():
    gu, dn = _weights(7, 16, 64, 32, jnp.bfloat16)
    x, ids = _x(8, 9, 64, jnp.bfloat16), _routing(9, 9, 4, 16)
    got = moe_experts_pallas(x, ids, gu, dn, tiles=TILES_16, interpret=True)
    ref = moe_experts_reference(x, ids, gu, dn)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,k", [(16, 4), (3, 2)])  # grouped blocks; the few-pairs form
def test_pallas_interpret_at_flash_next_widths(n, k):
    """Qwen3.8-Flash-Next's widths (H 2560, I 640: not powers of two, so the tiles are the
    powers of two dividing them) with 8 experts, bf16, the tiles the engine would take."""
    e, h, i = 8, FLASH["h"], FLASH["i"]
    gu, dn = _weights(13, e, h, i, jnp.bfloat16)
    x, ids = _x(14, n, h, jnp.bfloat16), _routing(15, n, k, e)
    got = np.asarray(api.moe_experts(x, ids, gu, dn, backend="pallas", interpret=True),
                     np.float32)
    ref = np.asarray(moe_experts_reference(x, ids, gu, dn), np.float32)
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.parametrize("form", [api.moe_experts_xla_few, api.moe_experts_xla_blocks,
                                  api.moe_experts_xla_ragged])
@pytest.mark.parametrize("n,k,e,kind", [(1, 8, 64, "distinct"), (4, 2, 8, "repeats"),
                                        (37, 6, 8, "distinct"), (37, 3, 64, "skewed")])
def test_xla_forms_match_reference(form, n, k, e, kind):
    gu, dn = _weights(10, e, 32, 16)
    x, ids = _x(11, n, 32), _routing(12, n, k, e, kind)
    np.testing.assert_allclose(np.asarray(jax.jit(form)(x, ids, gu, dn)),
                               np.asarray(moe_experts_reference(x, ids, gu, dn)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [2, 40])  # few-pairs and grouped forms of the xla backend
def test_experts_module_weighted_sum(n):
    e, h, i, k = 8, 32, 16, 2
    mod = Experts(e, h, i, jnp.float32, backend="xla")
    gu, dn = _weights(13, e, h, i)
    mod.gate_up_proj[...], mod.down_proj[...] = gu, dn
    x, ids = _x(14, n, h), _routing(15, n, k, e)
    w = jnp.asarray(np.random.default_rng(16).random((n, k)), jnp.float32)
    want = np.einsum("nkh,nk->nh", _numpy_experts(x, ids, gu, dn), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, *a: m(*a))(mod, x, ids, w)), want,
                               rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise():
    gu, dn = _weights(0, 4, 32, 16)
    x, ids = _x(0, 3, 32), _routing(0, 3, 2, 4)
    with pytest.raises(ValueError, match="backend 'triton'"):
        api.moe_experts(x, ids, gu, dn, backend="triton")
    with pytest.raises(ValueError, match="rows"):
        api.moe_experts(x[:2], ids, gu, dn)
    with pytest.raises(ValueError, match="do not fit"):
        api.moe_experts(x, ids, gu, dn[:, :16])
    with pytest.raises(ValueError, match="gu_bk=48"):
        moe_experts_pallas(x, ids, gu, dn, tiles=TILES_16._replace(gu_bk=48), interpret=True)


@pytest.mark.parametrize("shape,n,bm", [(A3B, 1, 16), (A3B, 4, 16), (A3B, 512, 16),
                                        (A3B, 8192, 128), (FLASH, 1, 16), (FLASH, 4, 16),
                                        (FLASH, 64, 16), (FLASH, 4096, 64)])
def test_triton_lowering_real_shapes(shape, n, bm):
    """The kernels lower for CUDA at the real shapes, with the default tiles of each regime."""
    e, k, h, i = shape["e"], shape["k"], shape["h"], shape["i"]
    args = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.int32),
            jax.ShapeDtypeStruct((e, 2 * i, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((e, h, i), jnp.bfloat16))
    text = lower_for_cuda(lambda *a: moe_experts_pallas(*a), *args)
    assert text.count("moe_gate_up") >= 1 and text.count("moe_down") >= 1
    assert default_tiles(n * k, e, h, i).bm == bm  # each regime's tiles are the ones lowered


def test_flash_next_moe_block_lowers(monkeypatch):
    """Qwen3.8-Flash-Next's MoE block (512 experts, top 10, H 2560, I 640, shared expert 640)
    with the ``pallas`` backend lowers for CUDA: the router kernel for 1 and 4 tokens (their
    experts take XLA's gather-reduce form, fewer pairs than experts), the router and the
    grouped kernels for 64 tokens (640 pairs)."""
    from types import SimpleNamespace

    from mtp_jax.models.layers.mlp import SparseMoE

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels, not interpreted
    e, k, h, i = FLASH["e"], FLASH["k"], FLASH["h"], FLASH["i"]
    cfg = SimpleNamespace(hidden_size=h, num_experts=e, num_experts_per_tok=k,
                          norm_topk_prob=True, moe_intermediate_size=i,
                          shared_expert_intermediate_size=i)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: SparseMoE(cfg, jnp.bfloat16, "pallas")))
    for n in (1, 4, 64):
        text = lower_for_cuda(lambda s, x: nnx.merge(graphdef, s)(x), state,
                              jax.ShapeDtypeStruct((n, h), jnp.bfloat16))
        assert "moe_route_topk" in text and ("moe_gate_up" in text) == (n * k >= e), n


@pytest.mark.gpu
@pytest.mark.parametrize("shape,n", [(A3B, 1), (A3B, 4), (A3B, 37), (A3B, 512), (A3B, 4096),
                                     (FLASH, 1), (FLASH, 64)])
def test_gpu_pallas_and_xla_match_reference(shape, n):
    e, k, h, i = shape["e"], shape["k"], shape["h"], shape["i"]
    kg, kd = jax.random.split(jax.random.key(20))  # on device: the weights are GBs
    gu = (jax.random.normal(kg, (e, 2 * i, h)) * h ** -0.5).astype(jnp.bfloat16)
    dn = (jax.random.normal(kd, (e, h, i)) * i ** -0.5).astype(jnp.bfloat16)
    x, ids = _x(21, n, h, jnp.bfloat16), _routing(22, n, k, e)
    chunk = 4 if n % 4 == 0 else 1  # the reference gathers [chunk, k, 2I, H] float32 weights
    ref = jax.lax.map(lambda a: moe_experts_reference(a[0], a[1], gu, dn),
                      (x.reshape(-1, chunk, h), ids.reshape(-1, chunk, k))).reshape(n, k, h)
    ref = np.asarray(ref, np.float32)
    for backend in ("pallas", "xla"):
        got = jax.jit(lambda *a: api.moe_experts(*a, backend=backend))(x, ids, gu, dn)
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, rtol=2e-2, atol=2e-2,
                                   err_msg=backend)
