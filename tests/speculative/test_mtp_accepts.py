"""MTP rounds that accept drafts: with a trained head (tests/fixtures/tiny_trained, made by
``python -m mtp_jax.train_mtp``), the engine's accept counts per request and per round equal
what teacher-forced ``mtp_forward`` calls, chained as the round chains them, imply over the
plain greedy continuation (tests/helpers/mtp_oracle.py), and the tokens equal plain greedy
decoding: for k = 1..5, a batch of mixed prompt lengths, the prefix cache on and off, small
prefill chunks, overlap scheduling on and off and several rounds per call. A draft fed the wrong
hidden state drafts other tokens, and the counts show it.
"""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.train.synthetic import motif_prompts
from tests.helpers.engine_runs import run_per_round
from tests.helpers.mtp_oracle import expected_rounds, greedy_drafts
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_trained")
MAX_NEW = 24
KMAX = 5
PAGE = 4


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


@pytest.fixture(scope="module")
def prompts():
    ps = motif_prompts(6, seed=21)
    assert len({len(p) for p in ps}) >= 4  # mixed lengths
    return ps


def _requests(prompts, max_new=MAX_NEW, **params):
    sp = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, **params)
    return [Request(request_id=f"p{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=0) for i, p in enumerate(prompts)]


def _engine(model, algo, k=0, tokenizer=None, **cfg):
    """The engines of this file. The base settings (one request at a time, prompts prefilled in
    chunks of up to 16 tokens, no prefix cache) keep each k to three programs (two prefill
    buckets, one round); the settings that cost compiles (a batch, the prefix cache, several
    rounds per call) are tested at k = 3."""
    settings = dict(max_running_requests=1, dtype="float32", page_size=PAGE, max_model_len=96,
                    enable_prefix_cache=False, chunked_prefill_size=16)
    settings.update(cfg)
    return Engine(model, EngineConfig(**settings),
                  SpeculativeConfig(algorithm=algo, num_steps=k, adaptive=False),
                  tokenizer=tokenizer)


def _run(engine, reqs, per_round: bool):
    """Run; with ``per_round`` (one round per call, overlap off) returns per request the
    (num_draft_tokens, num_accepted_tokens) after each round."""
    if not per_round:
        engine.run(reqs)
        return None
    return run_per_round(engine, reqs)


@pytest.fixture(scope="module")
def plain(model, prompts):
    reqs = _requests(prompts)
    _engine(model, "none").run(reqs)
    return [r.output_ids for r in reqs]


@pytest.fixture(scope="module")
def drafts(model, prompts, plain):
    """Per prompt ``[T, KMAX]`` greedy drafts of the chain started at each row of prompt + plain
    continuation (one padded length for all: one compile)."""
    seqs = [p + o for p, o in zip(prompts, plain)]
    length = max(map(len, seqs))
    out = []
    for s in seqs:
        padded = np.zeros(length, np.int32)
        padded[:len(s)] = s
        out.append(greedy_drafts(model, padded, KMAX))
    return out


def _expected(prompts, plain, drafts, k, max_new=MAX_NEW):
    return [expected_rounds(d, p + o, len(p), k, max_new)
            for p, o, d in zip(prompts, plain, drafts)]


def _check(reqs, plain, expected, per_round=None):
    for i, r in enumerate(reqs):
        exp = expected[i]
        assert r.output_ids == plain[i][:len(r.output_ids)], r.request_id
        assert r.num_rounds == len(exp), r.request_id
        assert r.num_draft_tokens == sum(room for _, room, _ in exp), r.request_id
        assert r.num_accepted_tokens == sum(n for _, _, n in exp), r.request_id
        if per_round is not None:
            got = np.diff([(0, 0)] + per_round[r.request_id], axis=0).tolist()
            assert got == [[room, n] for _, room, n in exp], r.request_id


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_accept_counts_equal_the_teacher_forced_expectation(model, prompts, plain, drafts, k):
    expected = _expected(prompts, plain, drafts, k)
    accepted = sum(n for e in expected for _, _, n in e)
    assert accepted > 0 and any(n < room for e in expected for _, room, n in e), (
        "the fixture must give accepted and rejected drafts")
    reqs = _requests(prompts)
    _engine(model, "mtp", k).run(reqs)
    for i, r in enumerate(reqs):
        assert r.output_ids == plain[i] and r.finish_reason == "length"
    _check(reqs, plain, expected)


def test_the_fixture_drafts_well(prompts, plain, drafts):
    """The trained fixture's greedy accept length at k = 3 (tokens per round) is >= 2."""
    rounds = [r for e in _expected(prompts, plain, drafts, 3) for r in e]
    assert (MAX_NEW - 1) * len(prompts) / len(rounds) >= 2.0


@pytest.mark.parametrize("variant", [
    dict(max_running_requests=8, enable_prefix_cache=True, chunked_prefill_size=64),
    dict(chunked_prefill_size=5),
    dict(overlap_schedule=False, num_scheduler_steps=1),
    dict(num_scheduler_steps=3),
], ids=["batch-prefix-cache", "chunk-5", "no-overlap", "3-rounds-per-call"])
def test_accept_counts_under_engine_settings(model, prompts, plain, drafts, variant):
    k = 3
    reqs = _requests(prompts)
    per_round = variant.get("overlap_schedule") is False
    seen = _run(_engine(model, "mtp", k, **variant), reqs, per_round)
    _check(reqs, plain, _expected(prompts, plain, drafts, k), seen)


class _CharTokenizer:
    """Detokenizer double for stop strings: token t is the letter chr(97 + t % 26)."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def _inside_accepted_chunk(prompts, plain, drafts, k):
    """``(prompt index, output index)`` of a token emitted as the first of >= 2 accepted
    drafts of a round (more of the round's tokens follow it), whose id is not emitted before."""
    for i, rounds in enumerate(_expected(prompts, plain, drafts, k)):
        for p, _, n in rounds:
            j = p + 1 - len(prompts[i])  # output index of the round's first accepted draft
            if n >= 2 and plain[i][j] not in plain[i][:j]:
                return i, j
    raise AssertionError("no round accepts two drafts of a fresh token; change the prompts")


def test_stops_inside_an_accepted_mtp_chunk(model, prompts, plain, drafts):
    k = 3
    i, j = _inside_accepted_chunk(prompts, plain, drafts, k)
    engine = _engine(model, "mtp", k, tokenizer=_CharTokenizer())
    (r,) = _requests([prompts[i]], stop_token_ids=[plain[i][j]])
    engine.run([r])
    assert r.output_ids == plain[i][:j + 1] and r.finish_reason == "stop"
    assert r.num_accepted_tokens >= 1  # the stop came with an accepted draft
    # A stop string ending on the same token (its letters start one token earlier).
    text = _CharTokenizer().decode(plain[i])
    stop = text[j - 1:j + 1]
    first = text.index(stop)
    (r,) = _requests([prompts[i]], stop=[stop])
    engine.run([r])
    assert r.finish_reason == "stop" and r.stop_text_len == first
    assert r.output_ids == plain[i][:first + len(stop)]


@pytest.mark.parametrize("interval,rounds", [(2, 1), (4, 2)],
                         ids=["one-round-per-call", "2-rounds-per-call"])
def test_second_turn_reuses_snapshots_taken_inside_accepted_rounds(model, prompts, plain,
                                                                   drafts, interval, rounds):
    """A follow-up whose prompt holds a first request's prompt and output reuses the GDN
    snapshots taken while that output was decoded by MTP rounds; the snapshot boundaries fall
    on verify rows >= 1 of rounds that accepted drafts (checked from the expected rounds), and
    the follow-up's output equals plain decoding of its prompt. Snapshots every 8 tokens, the
    engine's automatic choice of one round per call; every 16, two rounds per call, where a
    boundary may fall in either round of a call."""
    k, i = 3, 0
    every = PAGE * interval
    first = prompts[i]
    follow = first + plain[i] + motif_prompts(1, seed=5)[0][:5]
    rows = [b - 1 - p for p, _, n in _expected(prompts, plain, drafts, k)[i]
            for b in range(every, len(first) + MAX_NEW + 1, every) if p <= b - 1 <= p + n]
    assert any(row >= 1 for row in rows), rows
    outs = {}
    for algo, kk in (("none", 0), ("mtp", k)):
        # num_pages: room for both turns (a pool of exactly max_model_len runs out of pages on
        # the follow-up with speculation off; reported in docs/benchmarks.md's open findings).
        engine = _engine(model, algo, kk, enable_prefix_cache=True,
                         snapshot_interval_pages=interval, num_pages=48,
                         chunked_prefill_size=64, max_prefix_snapshots=16)
        (a,) = _requests([first])
        engine.run([a])
        (b,) = _requests([follow], max_new=8)
        engine.run([b])
        outs[algo] = (a.output_ids, b.output_ids, b.cached_tokens)
        if algo == "mtp":
            assert engine.rounds_per_call == rounds  # automatic: 2 n (k + 1) <= every
            assert a.num_accepted_tokens > 0
    assert outs["mtp"][:2] == outs["none"][:2]
    # reuse reaches the last boundary of the decoded output
    assert outs["mtp"][2] == (len(first) + MAX_NEW - 1) // every * every > len(first), outs
