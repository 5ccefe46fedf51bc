"""The MoE kernels that route inside themselves (pallas_kernels.moe.routed): the kernels
(interpreter) against a float64 numpy re-derivation of the whole block (softmax routing with
ties, renormalisation, the gated shared expert), the SparseMoE switch, bad input, the Triton
lowering at the released shapes, and (GPU) the compiled kernels against XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.models.layers import mlp
from pallas_kernels.moe.router import route_topk_reference
from pallas_kernels.moe.routed import (RoutedTiles, check_routed_tiles, default_routed_tiles,
                                       moe_routed)
from tests.helpers.triton_lowering import lower_for_cuda

E, H, I = 16, 64, 32
TILES = [RoutedTiles(8, 16, 16, 8),  # several steps of H and I per program
         RoutedTiles(32, 64, 64, 32, num_warps=2, num_stages=2)]  # one step each


def _numpy_block(x, logits, gu, dn, top_k, normalize, shared):
    """float64: softmax over the first E logits, the top_k (descending, ties to the lower id),
    optionally renormalised, each expert's SwiGLU, plus sigmoid(logit E) * expert E."""
    x, logits, gu, dn = (np.asarray(a, np.float64) for a in (x, logits, gu, dn))
    e, i = gu.shape[0] - int(shared), dn.shape[-1]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        z = logits[t, :e]
        p = np.exp(z - z.max())
        p /= p.sum()
        ids = sorted(range(e), key=lambda j: (-p[j], j))[:top_k]
        w = p[ids] / (p[ids].sum() if normalize else 1.0)
        pairs = list(zip(ids, w))
        if shared:
            pairs.append((e, 1.0 / (1.0 + np.exp(-logits[t, e]))))
        for j, wj in pairs:
            g, u = gu[j, :i] @ x[t], gu[j, i:] @ x[t]
            out[t] += wj * (dn[j] @ (g / (1 + np.exp(-g)) * u))
    return out


def _operands(seed, n, shared, e=E, h=H, i=I, dtype=jnp.float32):
    r = np.random.default_rng(seed)
    stored = e + int(shared)
    return (jnp.asarray(r.standard_normal((n, h)), dtype),
            jnp.asarray(r.standard_normal((n, stored + 3)), dtype),  # wider, as a merged proj
            jnp.asarray(r.standard_normal((stored, 2 * i, h)) * h ** -0.5, dtype),
            jnp.asarray(r.standard_normal((stored, h, i)) * i ** -0.5, dtype))


@pytest.mark.parametrize("n,top_k,normalize,shared,tiles", [
    (1, 4, True, True, TILES[0]), (3, 4, True, True, TILES[0]), (4, 2, False, True, TILES[1]),
    (2, 8, True, False, TILES[0]), (1, 1, False, False, None)])
def test_interpret_matches_float64(n, top_k, normalize, shared, tiles):
    x, logits, gu, dn = _operands(n * 10 + top_k, n, shared)
    got = moe_routed(x, logits, gu, dn, top_k=top_k, normalize=normalize, shared=shared,
                     tiles=tiles, interpret=True)
    want = _numpy_block(x, logits, gu, dn, top_k, normalize, shared)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_ties_route_to_the_lower_expert_as_the_router_does():
    """Equal logits: the kernels pick the lower ids, as ``route_topk`` does (a kernel that took
    the higher id would read other experts and give another output)."""
    x, logits, gu, dn = _operands(7, 2, shared=True)
    tied = logits.at[:, 3].set(logits[:, 9]).at[:, 5].set(logits[:, 9])  # three equal logits
    tied = tied.at[:, 9].set(jnp.max(tied[:, :E], axis=1) + 1.0)  # ... and the largest
    tied = tied.at[:, 3].set(tied[:, 9]).at[:, 5].set(tied[:, 9])
    _, ids = route_topk_reference(tied[:, :E], 2, True)
    assert np.array_equal(np.asarray(ids), [[3, 5], [3, 5]])
    got = moe_routed(x, tied, gu, dn, top_k=2, normalize=True, shared=True, interpret=True)
    np.testing.assert_allclose(np.asarray(got), _numpy_block(x, tied, gu, dn, 2, True, True),
                               rtol=1e-5, atol=1e-5)


def test_sparse_moe_switch_takes_the_kernels_for_few_tokens(monkeypatch):
    """With ROUTED_DECODE and the pallas backend, a folded block's decode rows run the routed
    kernels and give the gather-reduce form's output; prefill-sized calls keep the old path."""
    from types import SimpleNamespace

    from flax import nnx

    cfg = SimpleNamespace(hidden_size=H, num_experts=E, num_experts_per_tok=4,
                          norm_topk_prob=True, moe_intermediate_size=I,
                          shared_expert_intermediate_size=I)
    block = mlp.SparseMoE(cfg, jnp.float32, backend="pallas")
    r = np.random.default_rng(3)
    for _, v in nnx.iter_graph(block):
        if isinstance(v, nnx.Param):
            v[...] = jnp.asarray(r.standard_normal(v.shape) * 0.2, jnp.float32)
    block.merge_projections()
    assert block.shared_expert is None  # folded
    x = jnp.asarray(r.standard_normal((1, 2, cfg.hidden_size)), jnp.float32)
    monkeypatch.setattr(mlp, "ROUTED_DECODE", 0)
    want = block(x)
    monkeypatch.setattr(mlp, "ROUTED_DECODE", 1)
    text = str(jax.make_jaxpr(block.__call__)(x))
    assert "moe_routed_gate_up" in text and "moe_routed_down" in text
    np.testing.assert_allclose(np.asarray(block(x)), np.asarray(want), rtol=1e-5, atol=1e-5)
    many = jnp.zeros((1, cfg.num_experts, cfg.hidden_size), jnp.float32)
    assert "moe_routed" not in str(jax.make_jaxpr(block.__call__)(many))


def test_bad_input_raises():
    x, logits, gu, dn = _operands(1, 2, shared=True)
    with pytest.raises(ValueError, match="top_k=0"):
        moe_routed(x, logits, gu, dn, top_k=0, normalize=True, shared=True)
    with pytest.raises(ValueError, match="columns"):
        moe_routed(x, logits[:, :E], gu, dn, top_k=2, normalize=True, shared=True)
    with pytest.raises(ValueError, match="power-of-two expert count"):
        moe_routed(x, logits, gu[:-1], dn[:-1], top_k=2, normalize=True, shared=True)
    with pytest.raises(ValueError, match="do not fit"):
        moe_routed(x[:, :8], logits, gu, dn, top_k=2, normalize=True, shared=True)
    with pytest.raises(ValueError, match="gu_bn=64"):
        check_routed_tiles(TILES[0]._replace(gu_bn=64), H, I)


@pytest.mark.parametrize("e,k,h,i,n", [(256, 8, 2048, 512, 1), (256, 8, 2048, 512, 4),
                                       (512, 10, 2560, 640, 1)])
def test_triton_lowering_real_shapes(e, k, h, i, n):
    """Qwen3.6-35B-A3B (shared expert folded) and Flash-Next shapes lower for CUDA with their
    default tiles, which fill an H200 (>= 128 programs a kernel)."""
    t = default_routed_tiles(n, k + 1, h, i)
    assert n * (k + 1) * (i // t.gu_bn) >= 128 and n * (h // t.dn_bh) >= 128
    args = (jax.ShapeDtypeStruct((n, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((n, e + 1), jnp.bfloat16),
            jax.ShapeDtypeStruct((e + 1, 2 * i, h), jnp.bfloat16),
            jax.ShapeDtypeStruct((e + 1, h, i), jnp.bfloat16))
    text = lower_for_cuda(lambda *a: moe_routed(*a, top_k=k, normalize=True, shared=True,
                                                interpret=False), *args)
    assert "moe_routed_gate_up" in text and "moe_routed_down" in text


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4])
def test_gpu_routed_kernels_match_xla(n):
    from pallas_kernels.moe.api import moe_experts_weighted

    e, k, h, i = 256, 8, 2048, 512
    kg, kd, kx, kl = jax.random.split(jax.random.key(40), 4)
    gu = (jax.random.normal(kg, (e + 1, 2 * i, h)) * h ** -0.5).astype(jnp.bfloat16)
    dn = (jax.random.normal(kd, (e + 1, h, i)) * i ** -0.5).astype(jnp.bfloat16)
    x = jax.random.normal(kx, (n, h)).astype(jnp.bfloat16)
    logits = jax.random.normal(kl, (n, e + 1)).astype(jnp.bfloat16)
    got = jax.jit(lambda *a: moe_routed(*a, top_k=k, normalize=True, shared=True))(
        x, logits, gu, dn)
    w, ids = route_topk_reference(logits[:, :e], k, True)
    ids = jnp.concatenate([ids, jnp.full((n, 1), e, jnp.int32)], 1)
    w = jnp.concatenate([w, jax.nn.sigmoid(logits[:, e:].astype(jnp.float32))], 1)
    want = jax.jit(moe_experts_weighted)(x, ids, w, gu, dn)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_bench_routings_route_the_kernels_to_their_ids():
    """``python -m mtp_jax.bench moe``'s ``routed`` and ``xla_route`` variants get the router
    logits of its routings: their outputs equal the reference at the routings' ids and weights
    (interpret mode here; the bench runs them on a GPU)."""
    from mtp_jax.bench.ops import moe as bench_moe

    e, k, h, i, n = 16, 4, 64, 32, 3
    xs, idss, ws, lgs = bench_moe.routings(jax.random.key(2), n, e, k, h, 2)
    gu = jnp.asarray(np.random.default_rng(2).standard_normal((e, 2 * i, h)) * 0.1, jnp.bfloat16)
    dn = jnp.asarray(np.random.default_rng(3).standard_normal((e, h, i)) * 0.1, jnp.bfloat16)
    ref = bench_moe.reference(xs[1], idss[1], ws[1], gu, dn)
    got = {label: fn for label, fn, _, kind in bench_moe.cases(["xla_route", "routed"], n, e, k,
                                                              h, i, False) if kind == "logits"}
    assert sorted(got) == ["routed", "xla_route"]
    for fn in got.values():
        out = np.asarray(fn(xs[1], lgs[1], ws[1], gu, dn), np.float32)
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
