"""qwen4_exp MTP rounds that accept drafts: with a trained draft (tests/fixtures/
tiny_qwen4_trained, made by ``python -m tests.fixtures.make_qwen4_trained_fixture`` on the
prompts of its :func:`fixture_prompts`), the engine's output equals plain greedy decoding token
for token, and its accept counts per request, after every round, equal what teacher-forced
``mtp_forward`` calls chained as the round chains them imply over the plain greedy
continuation (tests/helpers/mtp_oracle.py): k = 1 and 3 one request at a time, and k = 3 with
all the prompts (mixed lengths) in one run through two slots. One engine per k (few compiles).

A draft fed the wrong hidden streams drafts other tokens, and the counts show it: with the
hidden rows that ``mtp_drafts`` gets rolled by one row (the name ``mtp_jax.engine.programs``
calls), the engine accepts 33 drafts instead of the expected 53 at k = 1 and 45 instead of 78
at k = 3, and every engine test here fails (the tokens stay equal to plain decoding).

The qwen3_5 counterpart: test_mtp_accepts.py.
"""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from tests.fixtures.make_qwen4_trained_fixture import MAX_NEW, fixture_prompts
from tests.helpers.engine_runs import run_per_round
from tests.helpers.mtp_oracle import (ScriptedAdaptive, chain_outputs, expected_rounds,
                                      greedy_drafts)
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_qwen4_trained")
KMAX = 3
PAGE = 4  # a multiple of indexer_compress_ratio (2)


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


@pytest.fixture(scope="module")
def prompts(model):
    ps = fixture_prompts(model.cfg.vocab_size)
    assert len({len(p) for p in ps}) >= 4 and min(map(len, ps)) <= 8  # mixed lengths
    return ps


def _requests(prompts, max_new=MAX_NEW):
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True)
    return [Request(request_id=f"p{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=0) for i, p in enumerate(prompts)]


def _engine(model, algo, k=0, **cfg):
    """One request at a time, prompts prefilled in chunks of up to 16 tokens, no prefix cache,
    one round per call, rounds observed one by one (overlap off)."""
    settings = dict(max_running_requests=1, dtype="float32", page_size=PAGE, max_model_len=96,
                    enable_prefix_cache=False, chunked_prefill_size=16, overlap_schedule=False,
                    num_scheduler_steps=1)
    settings.update(cfg)
    return Engine(model, EngineConfig(**settings), SpeculativeConfig(algorithm=algo, num_steps=k,
                                                                     adaptive=False))


@pytest.fixture(scope="module")
def plain(model, prompts):
    reqs = _requests(prompts)
    _engine(model, "none").run(reqs)
    for r in reqs:
        assert len(r.output_ids) == MAX_NEW and r.finish_reason == "length"
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def drafts(model, prompts, plain):
    """Per prompt ``[T, KMAX]`` greedy drafts of the chain started at each row of prompt +
    plain continuation (one padded length for all: one compile)."""
    seqs = [p + o for p, o in zip(prompts, plain)]
    length = max(map(len, seqs))
    out = []
    for s in seqs:
        padded = np.zeros(length, np.int32)
        padded[:len(s)] = s
        out.append(greedy_drafts(model, padded, KMAX))
    return out


def _expected(prompts, plain, drafts, k):
    return [expected_rounds(d, p + o, len(p), k, MAX_NEW)
            for p, o, d in zip(prompts, plain, drafts)]


def _check(reqs, plain, expected, per_round):
    for i, r in enumerate(reqs):
        exp = expected[i]
        assert r.output_ids == plain[i] and r.finish_reason == "length", r.request_id
        got = np.diff([(0, 0)] + per_round[r.request_id], axis=0).tolist()
        assert got == [[room, n] for _, room, n in exp], (
            f"{r.request_id}: per-round (drafts, accepted) {got} != expected "
            f"{[[room, n] for _, room, n in exp]}")
        assert r.num_rounds == len(exp), r.request_id
        assert r.num_draft_tokens == sum(room for _, room, _ in exp), r.request_id
        assert r.num_accepted_tokens == sum(n for _, _, n in exp), r.request_id


def test_the_fixture_drafts_well(prompts, plain, drafts):
    """The oracle's rounds on the trained head: accept length >= 2.5 tokens per round at k = 3,
    rounds that accept all drafts, some and none (the engine tests see each kind)."""
    rounds = [r for e in _expected(prompts, plain, drafts, 3) for r in e]
    assert (MAX_NEW - 1) * len(prompts) / len(rounds) >= 2.5
    assert any(n == room == 3 for _, room, n in rounds)
    assert any(0 < n < room for _, room, n in rounds)
    assert any(n == 0 for _, _, n in rounds)


@pytest.fixture(scope="module")
def engine_k3(model):
    """The k = 3 engine of both k = 3 tests: two slots (round programs for batch buckets 1 and
    2; six slots would compile four, about 20 s more on CPU)."""
    return _engine(model, "mtp", 3, max_running_requests=2)


@pytest.mark.parametrize("k", [1, 3])
def test_accept_counts_equal_the_teacher_forced_expectation(model, engine_k3, prompts, plain,
                                                            drafts, k):
    """One request at a time (each prompt its own ``run``)."""
    expected = _expected(prompts, plain, drafts, k)
    engine = engine_k3 if k == 3 else _engine(model, "mtp", k)
    reqs = _requests(prompts)
    seen = {}
    for r in reqs:
        seen.update(run_per_round(engine, [r]))
    _check(reqs, plain, expected, seen)
    assert sum(r.num_accepted_tokens for r in reqs) > 0
    if k >= 3:
        assert any(n >= 2 for e in expected for _, _, n in e)


def test_accept_counts_with_a_batch_of_mixed_lengths(engine_k3, prompts, plain, drafts):
    """All prompts in one ``run`` through two slots: rounds over two requests of different
    lengths, requests admitted (prefilled) while another one decodes."""
    reqs = _requests(prompts)
    seen = run_per_round(engine_k3, reqs)
    _check(reqs, plain, _expected(prompts, plain, drafts, 3), seen)
    assert sum(r.num_accepted_tokens for r in reqs) > 0
    assert max(r.num_rounds for r in reqs) > 1


def test_rounds_after_plain_rounds_accept_as_the_chain_implies(engine_k3, prompts, plain,
                                                               drafts):
    """Adaptive speculation's plain rounds (a scripted k per call, as in
    test_adaptive_mtp.py): each writes the draft's pages of its committed row
    (``MTPDraft.write_kv``: K/V and raw index keys) and leaves the drafts stale, so the
    drafting rounds after them accept what the oracle's chains imply with that plan. With the
    plain rounds writing no draft pages, 5 of the 6 prompts' counts differ (six plain rounds
    in a row: with fewer, the tiny head's drafts hardly notice the missing rows)."""
    plan = [3, 0, 0, 0, 0, 0, 0, 3, 3, 3]
    expected = [expected_rounds(d, p + o, len(p), 3, MAX_NEW, plan)
                for p, o, d in zip(prompts, plain, drafts)]
    after_plain = sum(n for e in expected for _, _, n in e[plan.index(0):])
    assert after_plain >= 8, "the fixture must accept drafts after plain rounds"
    reqs, seen, policy = _requests(prompts), {}, engine_k3.scheduler.adaptive
    try:
        for r in reqs:
            engine_k3.scheduler.adaptive = ScriptedAdaptive(plan, 3)
            seen.update(run_per_round(engine_k3, [r]))
    finally:
        engine_k3.scheduler.adaptive = policy
    _check(reqs, plain, expected, seen)


def test_reduced_draft_vocabulary_drafts_its_hot_ids(model, prompts, plain, drafts):
    """``draft_vocab_size=128`` (the 128 lowest ids): the draft's argmax over those ids only,
    so the accept counts equal the oracle's with its argmax restricted to them (fewer than the
    full head's), and the tokens stay plain decoding's."""
    n = 128
    seqs = [p + o for p, o in zip(prompts, plain)]
    length = max(map(len, seqs))
    expected = []
    for p, o, seq in zip(prompts, plain, seqs):
        padded = np.zeros(length, np.int32)
        padded[:len(seq)] = seq
        _, hidden = model.forward(padded[None])
        logits, _ = chain_outputs(model, np.asarray(hidden)[0], padded, 3)
        hot = np.argmax(logits[..., :n], -1).T.astype(np.int32)
        expected.append(expected_rounds(hot, seq, len(p), 3, MAX_NEW))
    engine = Engine(model, EngineConfig(max_running_requests=2, dtype="float32", page_size=PAGE,
                                        max_model_len=96, enable_prefix_cache=False,
                                        chunked_prefill_size=16, overlap_schedule=False,
                                        num_scheduler_steps=1),
                    SpeculativeConfig(algorithm="mtp", num_steps=3, draft_vocab_size=n,
                                      adaptive=False))
    reqs = _requests(prompts)
    _check(reqs, plain, expected, run_per_round(engine, reqs))
    accepted = sum(r.num_accepted_tokens for r in reqs)
    full = sum(n for e in _expected(prompts, plain, drafts, 3) for _, _, n in e)
    assert 0 < accepted < full


def test_overlapped_multi_step_rounds_accept_the_same(model, prompts, plain, drafts):
    """Rounds dispatched before the previous one is read (overlap on), two rounds per program
    call (``num_scheduler_steps=2``) and the prefix cache on: each round's PLE rows come from
    the host callback inside the program (the host never sees a round's tokens before the next
    one runs), and every request's tokens, rounds and accept totals equal the oracle's."""
    engine = _engine(model, "mtp", 3, max_running_requests=2, overlap_schedule=True,
                     num_scheduler_steps=2, enable_prefix_cache=True,
                     snapshot_interval_pages=16)
    reqs = _requests(prompts)
    engine.run(reqs)
    assert engine.stats.chained_rounds > 0 and engine.stats.round_calls < engine.stats.rounds
    for r, exp, out in zip(reqs, _expected(prompts, plain, drafts, 3), plain):
        assert r.output_ids == out and r.finish_reason == "length", r.request_id
        assert r.num_rounds == len(exp), r.request_id
        assert r.num_accepted_tokens == sum(n for _, _, n in exp), r.request_id
    assert sum(r.num_accepted_tokens for r in reqs) > 0


def test_int8_draft_layer(model, prompts, plain):
    """``speculative_draft_layer_dtype="int8"``: the draft's projections run from int8 rows
    (the hyper-connection mixers, attention, router and shared expert; not the routed
    experts), the tokens stay plain decoding's, the trained head still drafts right, and the
    bytes the memory plan adds equal the int8 rows and scales the model holds."""
    from flax import nnx

    from mtp_jax.engine.memory import planned_weights_bytes
    from mtp_jax.models.params import param_name

    spec = SpeculativeConfig(algorithm="mtp", num_steps=3, draft_layer_dtype="int8",
                             adaptive=False)
    engine = Engine(model, EngineConfig(max_running_requests=2, dtype="float32", page_size=PAGE,
                                        max_model_len=96, enable_prefix_cache=False),
                    spec)
    flat = {param_name(p): v[...] for p, v in nnx.to_flat_state(engine.model.params)}
    int8 = {n: a for n, a in flat.items() if a.dtype == np.int8}
    assert int8 and all(n.startswith("mtp.") and a.ndim == 2 for n, a in int8.items())
    held = sum(a.size + 4 * flat[n[:-len("weight")] + "scale"].size for n, a in int8.items())
    plain_spec = SpeculativeConfig(algorithm="mtp", num_steps=3, adaptive=False)
    assert (planned_weights_bytes(model.cfg, "float32", True, spec)
            - planned_weights_bytes(model.cfg, "float32", True, plain_spec)) == held
    reqs = _requests(prompts)
    engine.run(reqs)
    assert [r.output_ids for r in reqs] == plain
    assert sum(r.num_accepted_tokens for r in reqs) > 0
