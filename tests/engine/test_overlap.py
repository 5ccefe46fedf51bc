"""Overlap scheduling: a round dispatched before the previous round's result is read gives
the same tokens as rounds that wait for each other (and, greedy, as plain decoding), through
stops mid-round, slot and page reuse by queued requests, sampling, and prefix-cache snapshot
boundaries; the device's draft clamp equals the host's."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import ConfigError, EngineConfig
from mtp_jax.speculative.clamp import clamp_drafts, clamp_num_draft
from mtp_jax.engine.requests import SamplingParams
from mtp_jax.models.loader import load_model
from tests.helpers.engine_runs import greedy, make_requests, random_prompts, run_engine
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_dense")


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


def _run(model, specs, k, overlap, **kw):
    return run_engine(model, specs, k, overlap_schedule=overlap, **kw)


@pytest.mark.parametrize("k", [0, 3])
def test_overlap_equals_waiting_rounds_greedy(model, k):
    """Five requests through two slots (admission and slot reuse while rounds are in flight),
    different lengths; one stops on a stop id that plain decoding emits mid-output."""
    prompts = random_prompts(5, seed=k)
    plain, _ = _run(model, [(p, greedy(24)) for p in prompts], 0, overlap=False)
    stop_id = plain[2][0][7]  # request 2 stops at its 8th token (inside a round for k = 3)
    specs = [(p, greedy(5 + 4 * i)) for i, p in enumerate(prompts)]
    specs[2] = (prompts[2], greedy(20, stop_token_ids=[stop_id]))
    want, _ = _run(model, specs, k, overlap=False)
    got, eng = _run(model, specs, k, overlap=True)
    assert got == want
    assert eng.stats.chained_rounds > 0  # rounds did overlap
    first_stop = plain[2][0].index(stop_id)
    assert got[2] == (plain[2][0][:first_stop + 1], "stop")
    for i, (out, reason) in enumerate(got):  # greedy speculative == plain decoding
        if i != 2:
            assert out == plain[i][0][:len(out)] and reason == "length" and len(out) == 5 + 4 * i


def test_overlap_equals_waiting_rounds_sampled(model):
    """Sampled rows draw from per-request streams keyed by the generated-token count, which
    the device now advances: the tokens must not depend on overlap."""
    prompts = random_prompts(4, seed=11)
    sp = [SamplingParams(temperature=t, top_p=tp, top_k=tk, max_tokens=14, ignore_eos=True)
          for t, tp, tk in ((0.8, 0.9, 0), (1.0, 1.0, 20), (0, 1.0, 0), (0.6, 0.5, 5))]
    specs = list(zip(prompts, sp))
    want, _ = _run(model, specs, 3, overlap=False)
    got, eng = _run(model, specs, 3, overlap=True)
    assert got == want and eng.stats.chained_rounds > 0


def test_overlap_with_prefix_cache_snapshots(model):
    """Snapshot boundaries every page (16 tokens): rounds that may reach one wait for the round
    in flight; a second pass over the same prompts hits the cache and gives the same tokens."""
    base = random_prompts(1, seed=5, lo=40, hi=41)[0]
    prompts = [base + [7, 8, 9], base[:33], base]
    specs = [(p, greedy(24)) for p in prompts]
    want, _ = _run(model, specs, 3, overlap=False, prefix=True)
    got, eng = _run(model, specs, 3, overlap=True, prefix=True)
    assert got == want and eng.stats.chained_rounds > 0
    plain, _ = _run(model, specs, 0, overlap=False)
    assert got == plain
    again = eng.run(make_requests(specs))
    assert [(r.output_ids, r.finish_reason) for r in again] == want
    assert sum(r.cached_tokens for r in again) > 0


def test_overlap_under_page_pressure(model):
    """A KV pool that fits about two requests: pages freed by a finished request must not be
    handed out while a round that still writes them is in flight."""
    prompts = random_prompts(4, seed=21, lo=20, hi=30)
    specs = [(p, greedy(18)) for p in prompts]
    want, _ = _run(model, specs, 3, overlap=False, running=3, num_pages=9)
    got, eng = _run(model, specs, 3, overlap=True, running=3, num_pages=9)
    assert got == want and eng.stats.chained_rounds > 0


def test_device_clamp_equals_host_clamp():
    rng = np.random.default_rng(0)
    n = 500
    k = rng.integers(0, 6, n)
    prompt_len = rng.integers(1, 50, n)
    emitted = rng.integers(1, 40, n)
    position = prompt_len + emitted - 1
    limit = position + rng.integers(-3, 12, n)
    max_tokens = emitted + rng.integers(-2, 8, n)
    max_model_len = prompt_len + emitted + rng.integers(-2, 8, n)
    max_step = np.minimum(max_tokens, max_model_len - prompt_len)
    for kk in range(6):
        rows = k == kk
        got = np.asarray(clamp_drafts(kk, jnp.asarray(position[rows]),
                                      jnp.asarray(emitted[rows]), jnp.asarray(limit[rows]),
                                      jnp.asarray(max_step[rows])))
        want = [clamp_num_draft(kk, int(p), int(lim), int(e), int(mt), int(pl), int(mml))
                for p, lim, e, mt, pl, mml in zip(position[rows], limit[rows], emitted[rows],
                                                  max_tokens[rows], prompt_len[rows],
                                                  max_model_len[rows])]
        np.testing.assert_array_equal(got, want)


def test_overlap_flag_checked():
    with pytest.raises(ConfigError, match="overlap_schedule 'yes'"):
        EngineConfig(overlap_schedule="yes").validate()
