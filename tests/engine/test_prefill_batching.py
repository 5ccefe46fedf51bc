"""Batched prefill (mtp_jax/engine/prefill_batch.py): several requests' prompt chunks in one
prefill call give what one request per call gives.

The policy's pure parts first (waves, shapes, packing). Then, on the trained fixtures (drafts
accepted, so the draft KV a prefill writes shows in the accept counts) of both families, MTP on
(k = 3) and off: one workload run with ``max_prefill_batch=1`` (one request per call, the
reference) and with the default, compared token for token, the log-probabilities equal (to
float32 rounding; the first token's come from the prefill call), the drafts accepted equal, the
prefix-cache reuse equal. The workload: mixed prompt lengths, one longer than ``chunked_prefill_size`` (its last chunk, starting at 64, shares a
call with other requests' first chunks), a prompt that resumes a cached prefix (with the draft
row rewritten: its token after the prefix differs), one that stops at its first token, one
sampled (seeded), and log-probabilities asked for. The batched run must make fewer prefill
calls for the same chunks, with calls of several rows and different starts: a silent fall back
to one request per call fails. qwen4_exp cuts its chunks at snapshot boundaries (every 16
tokens here), so a request takes several chunks in one step, in successive waves.

Teeth: with two rows' slots swapped in each batched call (``prefill_batch`` patched), every
exactness test here fails (tokens differ).
"""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.prefill_batch import (ChunkRow, call_shape, pack_rows, plan_waves,
                                          prefill_bucket)
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from tests.fixtures.make_qwen4_trained_fixture import fixture_prompts
from tests.helpers.paths import fixture_path

CHUNK = 64  # chunked_prefill_size: the top bucket; batched calls of B * T <= 64


def _fake(n, prefilled=0):
    return Request(request_id=f"n{n}", index=0, prompt=None, prompt_ids=[5] * n,
                   params=SamplingParams(), seed=0, prefilled=prefilled)


# ---- the policy -------------------------------------------------------------------------------
def test_waves_spend_the_budget_oldest_first_and_split_one_request_across_waves():
    a, b, c = _fake(70, prefilled=64), _fake(40), _fake(30)
    waves = plan_waves([a, b, c], 64, None, False)
    assert [[(r.req, r.start, r.length) for r in w] for w in waves] == [
        [(a, 64, 6), (b, 0, 40), (c, 0, 18)]]  # c gets what is left: the budget is spent
    assert [r.final for r in waves[0]] == [True, True, False]
    # chunks cut at boundaries (every 16 tokens): the i-th chunk of a request in wave i
    waves = plan_waves([_fake(40, prefilled=8), b], 64, 16, True)
    assert [[(r.start, r.length) for r in w] for w in waves] == [
        [(8, 8), (0, 16)], [(16, 16), (16, 16)], [(32, 8)]]


def test_call_shapes_bound_rows_and_padded_tokens():
    assert call_shape(3, 16, 8, 64, None) == (4, 16)  # B a power of two
    assert call_shape(2, 64, 8, 64, None) is None  # 128 padded tokens > the top bucket
    assert call_shape(1, 64, 8, 64, None) == (1, 64)
    assert call_shape(3, 16, 2, 64, None) is None  # max_prefill_batch 2
    ready = {(4, 16)}  # a lean warm-up's one shape: calls pad up to it
    assert call_shape(1, 16, 8, 64, ready) == call_shape(3, 16, 8, 64, ready) == (4, 16)
    assert call_shape(2, 32, 8, 64, ready) is None  # no ready shape holds it
    assert call_shape(1, 32, 8, 64, ready) == (1, 32)  # one row: its own shape (compiled)


def test_packing_keeps_short_chunks_apart_from_long_ones():
    rows = [ChunkRow(_fake(n), 0, n) for n in (300, 20, 12, 9, 30)]
    shape = lambda count, longest: call_shape(count, prefill_bucket(longest, 512), 8, 512, None)
    calls = pack_rows(rows, shape)
    assert [([r.length for r in rs], s) for rs, s in calls] == [
        ([300], (1, 512)), ([30, 20, 12, 9], (4, 32))]
    one = lambda count, longest: call_shape(count, prefill_bucket(longest, 512), 1, 512, None)
    assert [s for _, s in pack_rows(rows, one)] == [(1, 512), (1, 32), (1, 32), (1, 16), (1, 16)]


# ---- exactness --------------------------------------------------------------------------------
def _workload(vocab, trained=None):
    """``(prompt, SamplingParams)`` pairs in arrival order (see the module docstring);
    ``trained``: three prompts the draft was trained on (their drafts are accepted), in place
    of random ones of 10, 40 and 5 tokens."""
    rng = np.random.default_rng(5)
    text = lambda n: rng.integers(2, vocab, n).tolist()
    long = text(70)
    a, b, c = trained or (text(10), text(40), text(5))
    greedy = dict(temperature=0, ignore_eos=True, logprobs=2)
    return [(long, SamplingParams(max_tokens=10, **greedy)),
            (a, SamplingParams(max_tokens=14, **greedy)),
            (text(12), SamplingParams(max_tokens=1, **greedy)),  # stops at its first token
            (b, SamplingParams(max_tokens=12, **greedy)),
            # sampled (its seed's stream) in the prefill only: no sampled round to compile
            (text(25), SamplingParams(temperature=0.8, max_tokens=1, logprobs=2)),
            (long[:48] + text(9), SamplingParams(max_tokens=8, **greedy)),  # a cached prefix
            (c, SamplingParams(max_tokens=9, **greedy))]


def _serve(model, k, batch, slots, trained=None):
    """Serve :func:`_workload` on a fresh engine (``slots`` requests at once, pages of 4
    tokens, snapshots every 16 tokens, chunks of :data:`CHUNK`), MTP with ``k`` drafts (no
    adaptation) or plain for k = 0, at most ``batch`` requests per prefill call. Returns the
    requests, the engine and each prefill call's ``(live starts, live lengths)``."""
    eng = Engine(model, EngineConfig(max_running_requests=slots, dtype="float32", page_size=4,
                                     max_model_len=128, snapshot_interval_pages=4,
                                     chunked_prefill_size=CHUNK, max_prefill_batch=batch),
                 SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3,
                                   adaptive=False))
    calls, prefill = [], eng.device.prefill

    def spy(b, v):
        live = b.length > 0
        calls.append((b.start[live].tolist(), b.length[live].tolist(), len(b.start),
                      bool(b.redraft.any())))
        return prefill(b, v)

    eng.device.prefill = spy
    reqs = [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=40 + i) for i, (p, sp) in enumerate(_workload(model.cfg.vocab_size, trained))]
    eng.run(reqs)
    return reqs, eng, calls


def _assert_logprobs_close(got, ref, tag):
    """Log-probabilities of the same tokens and top alternatives, the values equal but for
    float32 rounding: XLA:CPU rounds a matmul of other row counts differently (B = 1 against
    B = 4 calls: about 1e-6 on these logits; a row mixed with another's would be off by far
    more)."""
    assert len(got) == len(ref) > 0, tag
    for g, r in zip(got, ref):  # got[0]: the first token's, from the prefill call
        assert (g.token_id, [i for i, _ in g.top]) == (r.token_id, [i for i, _ in r.top]), tag
        np.testing.assert_allclose([g.logprob] + [v for _, v in g.top],
                                   [r.logprob] + [v for _, v in r.top], rtol=0, atol=5e-5,
                                   err_msg=tag)


def _check_equal(model, k, slots, trained=None):
    ref, ref_eng, ref_calls = _serve(model, k, 1, slots, trained)
    got, eng, calls = _serve(model, k, 8, slots, trained)
    for r, g in zip(ref, got):
        assert g.output_ids == r.output_ids, r.request_id
        assert g.finish_reason == r.finish_reason
        _assert_logprobs_close(g.logprobs, r.logprobs, r.request_id)
        assert (g.num_draft_tokens, g.num_accepted_tokens) == (r.num_draft_tokens,
                                                               r.num_accepted_tokens)
        assert g.cached_tokens == r.cached_tokens
    assert len(ref[2].output_ids) == 1 and ref[5].cached_tokens == 48
    if k:
        assert sum(r.num_accepted_tokens for r in ref) > 0  # the trained drafts are accepted
    # the same chunks, in fewer calls; some call holds several requests at different starts
    chunks = lambda cs: sorted(s for c in cs for s in zip(*c[:2]))
    assert any(c[3] for c in calls) == any(c[3] for c in ref_calls) == bool(k)  # a redraft
    assert chunks(calls) == chunks(ref_calls)
    assert ref_eng.stats.prefill_calls == ref_eng.stats.prefill_chunks == len(ref_calls)
    assert eng.stats.prefill_chunks == ref_eng.stats.prefill_chunks
    assert eng.stats.prefill_calls == len(calls) < ref_eng.stats.prefill_calls
    assert any(len(starts) > 1 and len(set(starts)) > 1 for starts, *_ in calls)
    return calls


@pytest.fixture(scope="module")
def dense():
    return load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)


@pytest.fixture(scope="module")
def qwen4():
    return load_model(fixture_path("tiny_qwen4_trained"), "float32", with_mtp=True)


@pytest.mark.parametrize("k", [0, 3])
def test_batched_prefill_equals_one_request_per_call_qwen3_5(dense, k):
    calls = _check_equal(dense, k, slots=4)
    # the long prompt's last chunk (6 tokens from 64) shares a call with first chunks; a call
    # of 3 requests has a padding row
    assert any(64 in starts and 0 in starts for starts, *_ in calls)
    assert any(len(starts) == 3 and b == 4 for starts, _, b, _ in calls)


@pytest.mark.parametrize("k", [0, 3])
def test_batched_prefill_equals_one_request_per_call_qwen4_exp(qwen4, k):
    fp = fixture_prompts(qwen4.cfg.vocab_size)
    calls = _check_equal(qwen4, k, slots=2, trained=(fp[1], fp[0], fp[2]))
    assert max(max(lengths) for _, lengths, *_ in calls) <= 16  # chunks end on boundaries


def test_lean_warmup_compiles_one_batched_prefill_shape(dense):
    """A lean warm-up for 4 requests of up to 30 tokens (chunks of 64) compiles one prefill
    shape, the largest bucket (32) at the most rows its padded tokens allow (2 x 32 <= 64):
    every prefill call pads up to it, nothing compiles while serving, and the tokens equal a
    run at each call's own shape."""
    def engine():
        return Engine(dense, EngineConfig(max_running_requests=4, dtype="float32", page_size=4,
                                          max_model_len=128, chunked_prefill_size=CHUNK,
                                          enable_prefix_cache=False),
                      SpeculativeConfig(algorithm="none"))

    rng = np.random.default_rng(9)
    prompts = [rng.integers(2, 250, n).tolist() for n in (30, 7, 20, 6)]  # 63 tokens: one step
    reqs = lambda: [Request(request_id=f"l{i}", index=i, prompt=None, prompt_ids=p, seed=0,
                            params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                    for i, p in enumerate(prompts)]
    eng = engine()
    lean = reqs()
    eng.warmup_for(lean, lean=True)
    assert eng.scheduler.ready_prefill == {(2, 32)}
    before = eng.compiled_program_count()
    shapes, prefill = [], eng.device.prefill
    eng.device.prefill = lambda b, v: shapes.append(b.input_ids.shape) or prefill(b, v)
    eng.run(lean)
    assert eng.compiled_program_count() == before and set(shapes) == {(2, 32)}
    assert eng.stats.prefill_calls == 2 and eng.stats.prefill_chunks == 4
    assert [r.output_ids for r in engine().run(reqs())] == [r.output_ids for r in lean]
