"""The fused GDN decode step (one row per request: output and new state from one state read)
against float64 numpy and against verify + commit, at kernel, model and engine level.

CPU: Pallas interpret-mode numerics and the Triton lowering; GPU (``-m gpu``): the compiled
kernel at the Qwen3.6-27B shape (Hv 48, Hk 16, Dk = Dv = 128). Inputs are random like the
model's (q, k L2-normalised, q scaled by Dk**-0.5, g = -softplus, beta = sigmoid), with a
non-zero state and some rows not live (g = beta = 0, as the model masks padding rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import BACKENDS, api
from pallas_kernels.gdn.pallas import gdn_commit_pallas, gdn_decode_pallas, gdn_verify_pallas
from tests.helpers.model_backends import with_backend
from tests.helpers.paths import fixture_path
from tests.helpers.triton_lowering import lower_for_cuda


def _inputs(seed, b, h, dk, dv, hk=None, dead=()):
    """One row per request (``T = 1``), float32; q, k drawn at ``hk`` heads and repeated to
    ``h`` (the model's grouped heads); requests in ``dead`` get ``g = beta = 0``."""
    rng = np.random.default_rng(seed)
    hk = hk or h
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    l2 = lambda a: a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    q = np.repeat(l2(normal(b, 1, hk, dk)), h // hk, axis=2) * np.float32(dk ** -0.5)
    k = np.repeat(l2(normal(b, 1, hk, dk)), h // hk, axis=2)
    v = normal(b, 1, h, dv)
    g = -np.logaddexp(0.0, normal(b, 1, h)).astype(np.float32)
    beta = (1.0 / (1.0 + np.exp(-normal(b, 1, h)))).astype(np.float32)
    state = normal(b, h, dk, dv) * np.float32(0.3)
    for i in dead:
        g[i], beta[i] = 0.0, 0.0
    return tuple(jnp.asarray(a) for a in (q, k, v, g, beta, state))


def _numpy_decode(q, k, v, g, beta, s):
    """float64: S = S e^g; S += k (beta (v - S^T k))^T; o = S^T q (one row)."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s))
    s = s * np.exp(g[:, 0])[..., None, None]
    kv = np.einsum("bhkv,bhk->bhv", s, k[:, 0])
    s = s + k[:, 0][..., None] * ((v[:, 0] - kv) * beta[:, 0][..., None])[..., None, :]
    return np.einsum("bhkv,bhk->bhv", s, q[:, 0])[:, None], s


def _close(a, b, tol):
    """|a - b| <= tol * (|b| + 0.1): outputs o are ~1e-2, states ~1."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=0.1 * tol)


@functools.partial(jax.jit, static_argnames="backend")
def _decode(q, k, v, g, beta, state, *, backend):
    return api.gdn_decode(q, k, v, g, beta, state, backend=backend)


@functools.partial(jax.jit, static_argnames="backend")
def _verify_commit(q, k, v, g, beta, state, *, backend):
    return (api.gdn_verify(q, k, v, g, beta, state, backend=backend),
            api.gdn_commit(q, k, v, g, beta, state, backend=backend))


# ---- kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("b,h,dk,dv,block_v", [(3, 4, 128, 128, 32), (4, 3, 32, 64, 16)])
def test_kernel_matches_float64_and_verify_commit(b, h, dk, dv, block_v):
    args = _inputs(b * 10 + h, b, h, dk, dv, dead=(1,))
    o, s = gdn_decode_pallas(*args, block_v=block_v, interpret=True)
    assert o.shape == (b, 1, h, dv) and s.shape == (b, h, dk, dv)
    o64, s64 = _numpy_decode(*args)
    _close(o, o64, 1e-5)
    _close(s, s64, 1e-5)
    # The same per-row code and tiling as the verify and commit kernels.
    _close(o, gdn_verify_pallas(*args, block_v=block_v, interpret=True), 1e-6)
    assert np.array_equal(np.asarray(s),
                          np.asarray(gdn_commit_pallas(*args, block_v=block_v, interpret=True)))
    # A request that is not live keeps its state bit for bit.
    assert np.array_equal(np.asarray(s[1]), np.asarray(args[5][1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_api_decode_equals_verify_plus_commit(backend):
    args = _inputs(5, 4, 4, 64, 64, hk=2, dead=(0, 3))
    o, s = _decode(*args, backend=backend)
    o_vc, s_vc = _verify_commit(*args, backend=backend)
    _close(o, o_vc, 1e-6)
    assert np.array_equal(np.asarray(s), np.asarray(s_vc))
    o64, s64 = _numpy_decode(*args)
    _close(o, o64, 1e-5)
    _close(s, s64, 1e-5)
    for i in (0, 3):
        assert np.array_equal(np.asarray(s[i]), np.asarray(args[5][i]))


def test_decode_in_place_under_donation():
    """Jitted with the state donated, the call runs and gives the un-donated result."""
    args = _inputs(8, 2, 2, 32, 32)
    want = _decode(*args, backend="pallas")
    fn = jax.jit(lambda *a: api.gdn_decode(*a, backend="pallas"), donate_argnums=5)
    got = fn(*args[:5], jnp.copy(args[5]))
    for a, b in zip(got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_bad_input_errors():
    args = _inputs(0, 1, 2, 32, 32)
    two = tuple(jnp.concatenate([a, a], 1) for a in args[:5])
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="T=2 rows.*verify"):
            api.gdn_decode(*two, args[5], backend=backend)
    with pytest.raises(ValueError, match="'triton'.*xla.*pallas"):
        api.gdn_decode(*args, backend="triton")
    with pytest.raises(ValueError, match="state has shape"):
        api.gdn_decode(*args[:5], args[5][:, :1], backend="pallas")


@pytest.mark.parametrize("b", [1, 32])
def test_triton_lowering_real_shape(b):
    """27B shape: 48 value heads, Dk = Dv = 128; the state output aliases the state input."""
    h, d = 48, 128
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    args = (f32(b, 1, h, d), f32(b, 1, h, d), f32(b, 1, h, d), f32(b, 1, h), f32(b, 1, h),
            f32(b, h, d, d))
    text = lower_for_cuda(lambda *a: api.gdn_decode(*a, backend="pallas", interpret=False),
                          *args)
    assert "__gpu$xla.gpu.triton" in text
    assert "output_operand_aliases" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 32])
def test_gpu_real_shape(b):
    """Qwen3.6-27B GDN: Hv 48, Hk 16, Dk = Dv = 128; a quarter of the requests not live."""
    args = _inputs(11 + b, b, 48, 128, 128, hk=16, dead=range(0, b, 4))
    o, s = _decode(*args, backend="pallas")
    o64, s64 = _numpy_decode(*args)
    _close(o, o64, 1e-5)
    _close(s, s64, 1e-5)
    o_vc, s_vc = _verify_commit(*args, backend="pallas")
    _close(o, o_vc, 1e-6)
    _close(s, s_vc, 1e-6)
    o_x, s_x = _decode(*args, backend="xla")
    _close(o, o_x, 1e-5)
    _close(s, s_x, 1e-5)
    for i in range(0, b, 4):
        assert np.array_equal(np.asarray(s[i]), np.asarray(args[5][i]))


# ---- model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    from mtp_jax.models.loader import load_model

    return load_model(fixture_path("tiny_dense"), "float32", with_mtp=False, gdn_backend="xla")


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_decode_equals_verify_plus_commit(tiny, backend):
    """After a prefill, one decode-mode step gives the hidden states, KV and GDN states of a
    verify + commit of the valid row; requests whose row is not valid keep their GDN states."""
    from flax import nnx

    from mtp_jax.cache.paged import AttentionBatch
    from mtp_jax.cache.pools import make_pools

    model = with_backend(tiny, "gdn", backend)
    b, t = 4, 5
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(2, tiny.cfg.vocab_size, (b, t)), jnp.int32)
    pools = make_pools(tiny.cfg, num_pages=1 + b * 2, page_size=8, slots=b, k=0, mtp=False,
                       dtype=jnp.float32)
    table = jnp.asarray(1 + np.arange(b * 2).reshape(b, 2), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    _, kv, gdn = model(ids, AttentionBatch(pos, jnp.ones((b, t), bool), table), pools.kv,
                       pools.gdn, "prefill")
    tok = jnp.asarray(rng.integers(2, tiny.cfg.vocab_size, (b, 1)), jnp.int32)
    valid = jnp.asarray([[True], [False], [True], [False]])
    step = AttentionBatch(jnp.full((b, 1), t, jnp.int32), valid, table)
    graphdef, params = nnx.split(model)

    @jax.jit
    def decode(params, kv, gdn):
        return nnx.merge(graphdef, params)(tok, step, kv, gdn, "decode")

    @jax.jit
    def verify_commit(params, kv, gdn):
        m = nnx.merge(graphdef, params)
        h, kv, rows = m(tok, step, kv, gdn, "verify")
        return h, kv, m.commit(gdn, rows, jnp.sum(valid, 1).astype(jnp.int32))

    h_d, kv_d, gdn_d = decode(params, kv, gdn)
    h_v, kv_v, gdn_v = verify_commit(params, kv, gdn)
    # With the pallas backend a decode is one kernel (conv ring, gates, recurrence) and a verify
    # two; the interpreter's XLA orders their float32 sums differently (a few ulps per layer).
    tol = 1e-5 if backend == "pallas" else 1e-6
    _close(h_d, h_v, tol)
    for a, c in zip(jax.tree.leaves(kv_d), jax.tree.leaves(kv_v)):
        _close(a, c, tol)
    for a, c in zip(gdn_d.recurrent + gdn_d.conv, gdn_v.recurrent + gdn_v.conv):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), atol=tol, rtol=0)
    for a, c in zip(gdn_d.recurrent + gdn_d.conv, gdn.recurrent + gdn.conv):
        assert np.array_equal(np.asarray(a)[1::2], np.asarray(c)[1::2])  # not-valid rows
        assert not np.allclose(np.asarray(a)[0], np.asarray(c)[0])  # valid rows moved
    with pytest.raises(ValueError, match="T=5 rows"):
        model(ids, AttentionBatch(pos, jnp.ones((b, t), bool), table), kv, gdn, "decode")
    with pytest.raises(ValueError, match="gdn_mode 'commit'"):
        model(tok, step, kv, gdn, "commit")


# ---- engine -----------------------------------------------------------------------------


def _engine_run(m, prompts):
    from mtp_jax.config import EngineConfig, SpeculativeConfig
    from mtp_jax.engine.engine import Engine
    from mtp_jax.engine.requests import Request, SamplingParams

    eng = Engine(m, EngineConfig(max_running_requests=2, dtype="float32", overlap_schedule=False,
                                 enable_prefix_cache=False), SpeculativeConfig(algorithm="none"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reqs = [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=p, params=params,
                    seed=0) for i, p in enumerate(prompts)]
    states = {}

    def on_round(rs):
        for r in rs:
            if not r.finished and r.slot:
                g = eng.pools.gdn
                states[r.request_id, r.position] = [np.asarray(a[r.slot])
                                                    for a in g.recurrent + g.conv]

    eng.run(reqs, on_round=on_round)
    return [r.output_ids for r in reqs], states


def test_plain_round_skips_commit_and_falls_back_without_decode(monkeypatch):
    """A k = 0 round of a model with the decode mode traces no commit; a model without it
    (``gdn_modes`` lacking ``"decode"``) runs verify + commit. Both generate the same tokens
    and leave the same GDN states after every round."""
    from mtp_jax.models.loader import load_model
    from mtp_jax.models.qwen3_5.model import Qwen35Model
    from tests.helpers.engine_runs import trace_commits

    calls = trace_commits(monkeypatch, Qwen35Model)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 300, n).tolist() for n in (4, 9)]
    load = lambda: load_model(fixture_path("tiny_dense"), "float32", with_mtp=False,
                              gdn_backend="xla")
    out_d, st_d = _engine_run(load(), prompts)
    assert not calls
    monkeypatch.setattr(Qwen35Model, "gdn_modes", ("prefill", "verify"))
    out_v, st_v = _engine_run(load(), prompts)
    assert calls
    assert out_d == out_v
    assert st_d.keys() == st_v.keys() and st_d
    for key in st_d:
        for a, c in zip(st_d[key], st_v[key]):
            np.testing.assert_allclose(a, c, atol=1e-6, rtol=0, err_msg=str(key))
