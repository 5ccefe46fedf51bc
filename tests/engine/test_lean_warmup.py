"""Lean warm-up (``warmup_for(..., lean=True)``, what ``python -m mtp_jax.generate`` runs before
its prompts): one prefill and one batch bucket are compiled, every later call pads up to them,
nothing compiles while the run is served, and the tokens equal a run at each call's own
bucket."""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import SamplingParams
from mtp_jax.engine.rounds import ready_bucket
from mtp_jax.models.loader import load_model
from tests.helpers.engine_runs import make_requests
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_dense")
# Prompts of 5, 20 and 30 tokens (prefill buckets 16 and 32) ending after 4, 12 and 24 tokens,
# so the running requests drop from 3 (bucket 4) to 2 and then 1.
LENGTHS, MAX_TOKENS = (5, 20, 30), (4, 12, 24)


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=False)


def _engine(model):
    return Engine(model, EngineConfig(max_running_requests=4, dtype="float32",
                                      max_model_len=96, chunked_prefill_size=32,
                                      enable_prefix_cache=False),
                  SpeculativeConfig(algorithm="none"))


def _requests():
    rng = np.random.default_rng(11)
    return make_requests([(rng.integers(2, 200, n).tolist(),
                           SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
                          for n, m in zip(LENGTHS, MAX_TOKENS)], seed=300)


def _record_shapes(eng) -> dict:
    """Wrap the engine's program calls to record their batch widths and chunk lengths."""
    seen = {"round": [], "prefill": []}
    rnd, pre = eng.device.round, eng.device.prefill
    eng.device.round = lambda b, v: seen["round"].append(b.slot.shape[0]) or rnd(b, v)
    eng.device.prefill = lambda b, v: seen["prefill"].append(b.input_ids.shape[1]) or pre(b, v)
    return seen


def test_ready_bucket():
    assert ready_bucket(2, None) == 2  # no lean warm-up: each call's own bucket
    ready = {8}
    assert [ready_bucket(n, ready) for n in (1, 4, 8)] == [8, 8, 8] and ready == {8}
    assert ready_bucket(16, ready) == 16 and ready == {8, 16}  # compiled then, and kept
    assert ready_bucket(2, ready) == 8


def test_lean_warmup_compiles_one_bucket_each_and_pads_up_to_them(model):
    """The first test of the module (its compile counts start from a fresh model)."""
    eng = _engine(model)
    before = eng.compiled_program_count()
    assert eng.warmup_for(_requests(), lean=True) > 0
    # one prefill (bucket 32) and one round program (batch bucket 4, greedy, no snapshots)
    assert eng.compiled_program_count() - before == 2
    assert eng.scheduler.ready_batch == {4} and eng.scheduler.ready_prefill == {(1, 32)}
    seen = _record_shapes(eng)
    lean = eng.run(_requests())
    assert eng.compiled_program_count() - before == 2  # nothing compiled while serving
    assert set(seen["round"]) == {4} and set(seen["prefill"]) == {32}
    assert [len(r.output_ids) for r in lean] == list(MAX_TOKENS)

    ref = _engine(model)  # no warm-up: every call at its own bucket, compiled when first met
    seen = _record_shapes(ref)
    plain = ref.run(_requests())
    assert {1, 2} <= set(seen["round"]) and set(seen["prefill"]) == {16, 32}
    assert [r.output_ids for r in lean] == [r.output_ids for r in plain]

    # a full warm-up afterwards lets every call run at its own bucket again, and so does a
    # resize (new pool shapes: the lean programs no longer serve them)
    eng.warmup_for(_requests())
    assert eng.scheduler.ready_batch is None and eng.scheduler.ready_prefill is None
    eng.warmup_for(_requests(), lean=True)
    assert eng.scheduler.ready_batch == {4}
    eng.resize_cache(max_running_requests=2)
    assert eng.scheduler.ready_batch is None and eng.scheduler.ready_prefill is None


def test_background_build_order_and_variants_follow_the_run(model):
    """The round variants come in the order a fresh request needs them (what a background
    build follows): the k its first call runs first (k = 3 while a round's cost is below k + 1
    tokens), the snapshot replay after; where a round costs k + 1 or more no request can
    draft, so only the plain step is built; a warm-up for sampled requests only records no
    greedy round call (no call of theirs is all greedy rows). Recorded dry, nothing
    compiles."""
    from mtp_jax.engine.warmup import round_variants, warmup_calls

    mtp_model = load_model(CKPT, "float32", with_mtp=True)
    for cost, want in ((5.0, [(0, False), (0, True)]),
                       (1.5, [(3, False), (0, False), (3, True), (0, True)])):
        eng = Engine(mtp_model, EngineConfig(max_running_requests=2, dtype="float32",
                                             max_model_len=96, chunked_prefill_size=32),
                     SpeculativeConfig(algorithm="mtp", num_steps=3,
                                       adaptive_round_cost=cost))
        assert [(v.k, v.snapshot) for v in round_variants(eng.scheduler)] == want, cost
    table = eng.device.programs.executables
    for greedy in (True, False):
        with table.recording() as calls:
            warmup_calls(eng.scheduler, sampled=True, filtering=False, lean=True,
                         greedy=greedy)()
        rounds = [c.variant.greedy_only for c in calls if c.name == "round"]
        assert len(rounds) == 4 * (1 + greedy) and any(rounds) == greedy
