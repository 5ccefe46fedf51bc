"""Multi-step scheduling (``num_scheduler_steps``): several rounds per program call give the
same tokens as one round per call, greedy and sampled, with and without speculation, through
stops inside a call, slot and page reuse, prefix-cache snapshot boundaries and a tight page
pool; the settings are checked before anything runs."""

import pytest

from mtp_jax.checks import check_settings
from mtp_jax.config import MAX_SCHEDULER_STEPS, ConfigError, EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import SamplingParams
from mtp_jax.models.loader import load_model
from tests.helpers.engine_runs import greedy, make_requests, random_prompts, run_engine
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_dense")


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


def _run(model, specs, k, steps, **kw):
    out, eng = run_engine(model, specs, k, seed=200, num_scheduler_steps=steps, **kw)
    # no page kept (trash aside)
    assert eng.book.pages.num_free == eng.book.pages.size - 1 or eng.prefix
    return out, eng


def test_warmup_covers_multistep_calls(model):
    """After ``warmup()``, serving with multi-step calls (with and without the snapshot
    replay) compiles nothing. (The first test here: ``run_engine``'s settings with the prefix
    cache and the automatic rounds per call, 4, those of
    ``test_multistep_with_prefix_cache_snapshots``, which then runs on the programs compiled
    here; chunks of 16 tokens, the snapshot interval, which no chunk crosses with the cache.)"""
    from mtp_jax.engine.variants import RoundVariant
    from mtp_jax.engine.warmup import batch_buckets, prefill_buckets, round_variants

    eng = Engine(model, EngineConfig(max_running_requests=2, dtype="float32",
                                     max_model_len=96, enable_prefix_cache=True,
                                     chunked_prefill_size=16, snapshot_interval_pages=1),
                 SpeculativeConfig(algorithm="none"))
    assert eng.rounds_per_call == 4  # automatic: 2 * 4 * 1 tokens <= the 16-token interval
    assert round_variants(eng.scheduler) == [RoundVariant(0, "none", rounds=4),
                                             RoundVariant(0, "none", rounds=4, snapshot=True)]
    assert prefill_buckets(16, eng.max_model_len) == [16]
    assert batch_buckets(eng.book.max_requests) == [1, 2]
    eng.warmup(sampled=False)
    before = eng.compiled_program_count()
    got = eng.run(make_requests([(p, greedy(20)) for p in random_prompts(3, seed=3, lo=20,
                                                                         hi=30)], seed=200))
    assert eng.compiled_program_count() == before
    assert all(len(r.output_ids) == 20 for r in got)
    assert eng.stats.round_calls < eng.stats.rounds  # calls did run several rounds


@pytest.mark.parametrize("k", [0, 3])
def test_multistep_equals_single_rounds(model, k):
    """Five requests through two slots, lengths that are not multiples of the steps, one stop
    id inside a call, and (k = 0) one sampled request, whose draws come from streams keyed by
    the generated-token count that advances on the device inside a call: the tokens and finish
    reasons equal one round per call, and the greedy ones plain decoding's."""
    prompts = random_prompts(5, seed=30 + k)
    plain, _ = _run(model, [(p, greedy(23)) for p in prompts], 0, steps=1)
    stop_id = plain[1][0][6]
    specs = [(p, greedy(5 + 3 * i)) for i, p in enumerate(prompts)]
    specs[1] = (prompts[1], greedy(20, stop_token_ids=[stop_id]))
    if not k:
        specs[3] = (prompts[3], SamplingParams(temperature=0.8, top_p=0.9, top_k=20,
                                               max_tokens=14, ignore_eos=True))
    want, one = _run(model, specs, k, steps=1)
    got, eng = _run(model, specs, k, steps=4)
    assert got == want
    assert eng.stats.round_calls < eng.stats.rounds  # calls did run several rounds
    assert one.stats.round_calls == one.stats.rounds
    first_stop = plain[1][0].index(stop_id)
    assert got[1] == (plain[1][0][:first_stop + 1], "stop")
    for i, (out, reason) in enumerate(got):
        if i != 1 and (k or i != 3):
            assert out == plain[i][0][:len(out)] and reason == "length" and len(out) == 5 + 3 * i
    if not k:
        assert len(got[3][0]) == 14 and got[3][0] != plain[3][0][:14]  # it did sample


def test_multistep_with_prefix_cache_snapshots(model):
    """Snapshot boundaries every 16 tokens, 4 decode steps per call: each call saves the
    boundary it reaches from whichever of its steps commits past it, so every one is saved.
    A second pass hits the cache and gives the same tokens, and follow-ups whose prompts
    hold a first turn's prompt and output reuse the snapshots taken while decoding (the
    deepest boundary of the output)."""
    base = random_prompts(1, seed=5, lo=40, hi=41)[0]
    specs = [(p, greedy(30)) for p in (base + [7, 8, 9], base[:33], base)]

    want, _ = _run(model, specs, 0, steps=1, prefix=True)
    got, eng = _run(model, specs, 0, steps=None, prefix=True, max_prefix_snapshots=32)
    assert got == want and eng.stats.round_calls < eng.stats.rounds
    again = eng.run(make_requests(specs, seed=200))
    assert [(r.output_ids, r.finish_reason) for r in again] == want
    assert sum(r.cached_tokens for r in again) > 0
    follow = [(p + out + [5, 6], greedy(6)) for (p, _), (out, _) in zip(specs, want)]
    turns = eng.run(make_requests(follow, seed=200))
    for (p, _), (out, _), r in zip(specs, want, turns):
        assert r.cached_tokens == (len(p) + len(out) - 1) // 16 * 16 > len(p)
    plain, _ = _run(model, follow, 0, steps=1)
    assert [(r.output_ids, r.finish_reason) for r in turns] == plain


def test_each_decode_boundary_is_carried_by_one_call(model):
    """A plain call commits one token a round, so the call in flight is sure to reach a
    boundary within its rounds: the next call does not carry that boundary too (one
    snapshot-variant call per boundary while decoding, not two), and every boundary
    is still saved: a follow-up turn reuses the deepest. (The engine settings of
    ``test_warmup_covers_multistep_calls``: its programs are compiled.)"""
    eng = Engine(model, EngineConfig(max_running_requests=2, dtype="float32",
                                     max_model_len=96, enable_prefix_cache=True,
                                     chunked_prefill_size=16, snapshot_interval_pages=1),
                 SpeculativeConfig(algorithm="none"))
    calls = []
    dispatch = eng.device.round
    eng.device.round = lambda b, v: calls.append((v.snapshot, b.snap_at.copy())) or dispatch(b, v)
    prompt = random_prompts(1, seed=8, lo=5, hi=6)[0]
    [req] = eng.run(make_requests([(prompt, greedy(70))], seed=200))
    carried = [int(at[0]) for snap, at in calls if snap]
    # 80 lies past the request's end (75 tokens): a call may carry a boundary it never reaches
    assert carried in ([16, 32, 48, 64], [16, 32, 48, 64, 80])
    [turn] = eng.run(make_requests([(prompt + req.output_ids + [5], greedy(2))], seed=200))
    assert turn.cached_tokens == 64


def test_multistep_under_page_pressure(model):
    """A pool of about two requests' pages: every call takes pages for all of its rounds, and
    pages of a finished request are not handed out while a call that writes them runs.
    (The reference: one round per call in the default pool, the settings of
    ``test_multistep_equals_single_rounds[3]``, whose programs are compiled already.)"""
    specs = [(p, greedy(18)) for p in random_prompts(4, seed=21, lo=20, hi=30)]
    want, _ = _run(model, specs, 3, steps=1)
    got, _ = _run(model, specs, 3, steps=4, num_pages=8)
    assert got == want


@pytest.mark.parametrize("bad", [0, -1, MAX_SCHEDULER_STEPS + 1, True, 2.0, "4", "auto"])
def test_num_scheduler_steps_checked(bad):
    with pytest.raises(ConfigError, match="num_scheduler_steps"):
        EngineConfig(num_scheduler_steps=bad).validate()


def test_external_proposer_refuses_multistep():
    with pytest.raises(ConfigError, match=r"num_scheduler_steps \(--num-scheduler-steps\) 2 "
                                          "needs drafts made on the device"):
        check_settings(SpeculativeConfig(algorithm="external", num_steps=2),
                       EngineConfig(num_scheduler_steps=2), has_proposer=True)


def test_warns_when_calls_would_pass_snapshot_boundaries(model):
    """2 N (k + 1) tokens (two overlapped calls) against the snapshot interval: 2 * 10 * 4 = 80
    > 64 warns (a call saves only the first boundary it reaches); 2 * 4 * 4 = 32 <= 64 does
    not, nor the automatic choice (4 there, 2 with 16-token intervals), nor the cache off."""
    from mtp_jax.engine.engine import MultiStepWarning

    def make(k, steps, prefix=True, interval=4):
        return Engine(model, EngineConfig(max_running_requests=1, dtype="float32",
                                          max_model_len=64, enable_prefix_cache=prefix,
                                          snapshot_interval_pages=interval,
                                          num_scheduler_steps=steps),
                      SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3))

    with pytest.warns(MultiStepWarning, match=r"num_scheduler_steps 10 with 3 drafts.*commit "
                                              r"80 tokens, more than the 64 between"):
        make(3, 10)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", MultiStepWarning)
        make(3, 4)
        assert make(3, None).rounds_per_call == 4 and make(3, None, interval=1).rounds_per_call == 2
        assert make(0, None, prefix=False).rounds_per_call == 4
        make(3, 10, prefix=False)


def test_auto_rounds_per_call():
    from mtp_jax.engine.rounds import auto_rounds_per_call

    assert [auto_rounds_per_call(k, "mtp", 64) for k in (0, 1, 3, 7, 40)] == [4, 4, 4, 4, 1]
    assert [auto_rounds_per_call(k, "mtp", 16) for k in (0, 1, 3)] == [4, 4, 2]
    assert auto_rounds_per_call(3, "mtp", None) == 4
    assert auto_rounds_per_call(3, "external", None) == 1


def test_cli_flag_takes_auto_and_ints():
    """``--num-scheduler-steps``: ``auto`` (the default) is the engine's choice (None), an int
    is passed on (checked later with the settings), other text is refused by the parser."""
    from mtp_jax.generate import build_parser, llm_kwargs

    p = build_parser()
    assert llm_kwargs(p.parse_args([]))["num_scheduler_steps"] is None
    assert llm_kwargs(p.parse_args(["--num-scheduler-steps", "auto"]))["num_scheduler_steps"] is None
    assert llm_kwargs(p.parse_args(["--num-scheduler-steps", "3"]))["num_scheduler_steps"] == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--num-scheduler-steps", "four"])
