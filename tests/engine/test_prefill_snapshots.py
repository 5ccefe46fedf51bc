"""Prefix-cache snapshots inside prefill chunks: with the cache on, a prompt is prefilled in as
few calls as ``chunked_prefill_size`` allows (chunks are no longer cut at every snapshot
boundary), each call saves the GDN state at every boundary inside its chunk, and those states
equal an independent reference (a cache-off engine prefilling the prompt cut at the boundary);
a later prompt sharing a prefix resumes from the deepest boundary and gives cache-off output."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.models.loader import load_model
from tests.helpers.engine_runs import greedy_requests
from tests.helpers.paths import fixture_path

PAGE, INTERVAL = 16, 4  # the defaults: snapshots every 64 tokens


@pytest.fixture(scope="module")
def model():
    return load_model(fixture_path("tiny_dense"), "float32", with_mtp=True)


def _req(tag, prompt, max_tokens=4):
    return greedy_requests([prompt], [tag], max_tokens)[0]


def _engine(model, cache, chunk=256, algo="mtp"):
    return Engine(model, EngineConfig(max_running_requests=2, dtype="float32", page_size=PAGE,
                                      max_model_len=320, enable_prefix_cache=cache,
                                      snapshot_interval_pages=INTERVAL,
                                      chunked_prefill_size=chunk),
                  SpeculativeConfig(algorithm=algo, num_steps=2))


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(2, 295, n).tolist()


def _prefill_only(eng, req, budget):
    """Admit ``req`` and prefill its whole prompt in chunks of at most ``budget`` tokens (no
    round runs); returns the number of prefill calls."""
    eng.add_request(req)
    eng.scheduler.admit(req)
    calls = 0
    while req.prefilled < len(req.prompt_ids):
        eng.scheduler.prefill_chunk(req, budget)
        calls += 1
    return calls


def _slot_state(eng, slot):
    view = eng.pools.gdn.gather(jnp.asarray([slot], jnp.int32))
    return [np.asarray(a[0]) for a in view.recurrent + view.conv]


def _snapshot_state(eng, sid):
    view = eng.pools.snapshots.gather(jnp.asarray([sid], jnp.int32))
    return [np.asarray(a[0]) for a in view.recurrent + view.conv]


def test_cached_prompt_prefills_in_one_call(model):
    """200 tokens, chunked_prefill_size 256, prefix cache on: one prefill call (it was four,
    cut at 64, 128 and 192), and the prompt's three boundaries hold snapshots in the tree."""
    eng = _engine(model, cache=True)
    prompt = _prompt(200)
    eng.run([_req("a", prompt)])
    assert eng.stats.prefill_calls == 1
    assert eng.stats.prompt_tokens == 200
    path = eng.prefix.tree.match(prompt + [7])
    assert [n.depth_tokens for n in path if n.snapshot is not None] == [64, 128, 192]


@pytest.mark.parametrize("chunk,calls", [(256, 1), (100, 2)])
def test_snapshots_inside_a_chunk_equal_a_prefill_cut_at_the_boundary(model, chunk, calls):
    """Each snapshot saved inside a chunk (boundaries 64, 128, 192 of a 200-token prompt)
    equals, in float32, the GDN state (recurrent and conv ring) of a cache-off engine that
    prefilled only the prompt's first 64 / 128 / 192 tokens. Chunks of 100 start the second
    chunk off a boundary (at 100: boundaries at its rows 28 and 92)."""
    prompt = _prompt(200, seed=1)
    eng = _engine(model, cache=True, chunk=chunk)
    req = _req("a", prompt)
    assert _prefill_only(eng, req, chunk) == calls
    assert sorted(req.snapshots) == [64, 128, 192]
    for p, sid in sorted(req.snapshots.items()):
        ref = _engine(model, cache=False, chunk=256)
        cut = _req(f"cut{p}", prompt[:p])
        _prefill_only(ref, cut, 256)
        want = _slot_state(ref, cut.slot)
        got = _snapshot_state(eng, sid)
        for j, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5,
                                       err_msg=f"boundary {p}, state leaf {j}")


@pytest.mark.parametrize("algo", ["mtp", "none"])
def test_shared_prefix_hits_the_deepest_boundary_and_equals_cache_off(model, algo):
    """A second prompt sharing 130 tokens with a first (prefilled in one call) reuses 128
    tokens (the boundary below the share) and both outputs equal a cache-off engine's."""
    a = _prompt(200, seed=2)
    b = a[:130] + [2 if a[130] != 2 else 3] + _prompt(39, seed=3)
    assert b[130] != a[130]
    outs = {}
    for cache in (False, True):
        eng = _engine(model, cache, algo=algo)
        ra, rb = _req("a", a, 8), _req("b", b, 8)
        eng.run([ra])
        eng.run([rb])
        outs[cache] = (ra.output_ids, rb.output_ids)
        if cache:
            assert ra.cached_tokens == 0 and rb.cached_tokens == 128
            assert eng.stats.prefill_calls == 2  # one call per prompt
    assert outs[True] == outs[False]
