"""Scheduler behaviour against runs that do not use the feature: batching, chunked prefill,
page clamping and boundaries, stops, and the compiled-program count."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.cache.paged import PagedKV
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.speculative.clamp import clamp_num_draft
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_dense")
MAX_LEN = 64


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


def _req(tag, prompt, max_tokens=8, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(request_id=tag, index=0, prompt=None, prompt_ids=list(prompt), params=params,
                   seed=0)


def _engine(model, algo="mtp", k=2, running=4, chunk=2048, proposer=None, num_pages=None,
            max_len=MAX_LEN, tokenizer=None):
    return Engine(model, EngineConfig(max_running_requests=running, dtype="float32",
                                      max_model_len=max_len, chunked_prefill_size=chunk,
                                      num_pages=num_pages),
                  SpeculativeConfig(algorithm=algo, num_steps=k), proposer=proposer,
                  tokenizer=tokenizer)


def _prompts(n, seed=0, lo=2, hi=30):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 300, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def solo(model):
    """Plain greedy outputs of 9 prompts, each run alone."""
    prompts = _prompts(9)
    outs = []
    for i, p in enumerate(prompts):
        r = _req(f"s{i}", p, max_tokens=6 + i)
        _engine(model, "none", running=1).run([r])
        outs.append(r.output_ids)
    return prompts, outs


def _nan_pools(eng):
    nan = lambda pages: pages.at[1:].set(jnp.nan)
    kv = eng.pools.kv
    dk = eng.pools.draft_kv
    eng.device.pools = dataclasses.replace(
        eng.pools, kv=PagedKV(tuple(map(nan, kv.k)), tuple(map(nan, kv.v))),
        draft_kv=PagedKV(tuple(map(nan, dk.k)), tuple(map(nan, dk.v))))
    taken = set()
    orig = eng.book.pages.take

    def take(n=1):
        ids = orig(n)
        taken.update(ids)
        return ids

    eng.book.pages.take = take
    return taken


@pytest.mark.parametrize("n", [1, 4, 9])
def test_batch_equivalence_with_mixed_acceptance(model, solo, n):
    prompts, ref = solo
    k = 3
    j_of = {f"b{i}": i % (k + 1) for i in range(n)}

    def proposer(rid, ids, kk):
        i = int(rid[1:])
        done = len(ids) - len(prompts[i])
        truth = (ref[i] + [0] * 8)[done:done + kk]
        return [t if m < j_of[rid] else (t + 1) % 300 for m, t in enumerate(truth)]

    eng = _engine(model, "external", k=k, running=4, proposer=proposer, num_pages=40)
    taken = _nan_pools(eng)
    reqs = [_req(f"b{i}", prompts[i], max_tokens=6 + i) for i in range(n)]
    accepted = []
    orig_collect = eng.scheduler.collect

    def spy(f, later=None):
        before = {r: r.num_accepted_tokens for r in f.rows}
        out = orig_collect(f, later)
        accepted.extend(r.num_accepted_tokens - before[r] for r in f.rows)
        return out

    eng.scheduler.collect = spy
    eng.run(reqs)
    for i, r in enumerate(reqs):
        assert r.output_ids == ref[i], r.request_id
    assert accepted and all(0 <= a <= k for a in accepted)
    untouched = [p for p in range(1, eng.book.pages.size) if p not in taken]
    assert untouched, "the test needs pages that were never handed out"
    for pages in eng.pools.kv.k + eng.pools.kv.v + eng.pools.draft_kv.k + eng.pools.draft_kv.v:
        assert np.isnan(np.asarray(pages)[untouched]).all()
    assert not any(np.isnan(np.asarray(pages)[0]).any() for pages in eng.pools.kv.k)
    eng.flush_cache()
    assert eng.book.pages.num_free == eng.book.pages.size - 1 and eng.book.slots.num_free == 4


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_equals_one_shot(model, chunk):
    prompt = _prompts(1, seed=3, lo=21, hi=22)[0]  # 21 tokens: chunk 5 leaves a last chunk of 1
    states = {}
    for c in (2048, chunk):
        eng = _engine(model, "mtp", k=2, running=1, chunk=c)
        r = _req("c", prompt, max_tokens=4)
        r.slot = eng.book.slots.take()[0]
        while r.prefilled < len(prompt):
            eng.scheduler.prefill_chunk(r, c)
        slot = r.slot
        pools = eng.pools
        states[c] = dict(
            out=list(r.output_ids),
            next_tokens=np.asarray(pools.next_tokens[slot]),
            rec=[np.asarray(a[slot]) for a in pools.gdn.recurrent],
            conv=[np.asarray(a[slot]) for a in pools.gdn.conv])
        # KV and draft KV of the prompt positions, read through the page table.
        table = eng.book.table([r])[0]
        pos = np.arange(len(prompt))
        where = table[pos // eng.page_size], pos % eng.page_size
        states[c]["kv"] = [np.asarray(a)[where] for a in pools.kv.k + pools.kv.v]
        states[c]["draft"] = [np.asarray(a)[where] for a in pools.draft_kv.k + pools.draft_kv.v]
        # The whole generation too.
        full = _req("f", prompt, max_tokens=6)
        _engine(model, "mtp", k=2, running=1, chunk=c).run([full])
        states[c]["generated"] = full.output_ids
    a, b = states[2048], states[chunk]
    assert a["out"] == b["out"] and a["generated"] == b["generated"]
    assert a["next_tokens"][1] == b["next_tokens"][1]  # the first draft token
    for key in ("rec", "conv", "kv", "draft"):
        for x, y in zip(a[key], b[key]):
            np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-5, err_msg=key)


def test_first_verify_crosses_a_page_and_max_model_len_finishes(model, solo):
    prompts, ref = solo
    # 15 prompt tokens: the pending token sits at position 15, the last slot of page 0, so the
    # first verify window (15..18) crosses into the next page.
    # Both speculative runs use one engine configuration (max_model_len 24), so its programs
    # compile once: the first finishes on max_tokens (15 + 8 < 24), the second on the length.
    p = (prompts[0] * 10)[:15]
    plain = _req("p", p, max_tokens=12)
    _engine(model, "none", running=1).run([plain])
    spec = _req("s", p, max_tokens=8)
    _engine(model, "mtp", k=3, running=1, max_len=24).run([spec])
    assert spec.output_ids == plain.output_ids[:8] and spec.finish_reason == "length"
    long = _req("l", p, max_tokens=100)
    _engine(model, "mtp", k=3, running=1, max_len=24).run([long])
    assert long.finish_reason == "length" and len(p) + len(long.output_ids) == 24
    assert long.output_ids == plain.output_ids[:9]


# Three of the `solo` requests (prompts of 20, 25 and 21 tokens) and a KV pool just big enough
# for their guaranteed pages (2 + 3 + 3, plus the trash page).
CLAMP_ROWS = (3, 4, 6)


def _clamp_requests(prompts):
    return [_req(f"b{i}", prompts[i], max_tokens=6 + i) for i in CLAMP_ROWS]


def _clamp_pool():
    need = sum(-(-(len(r.prompt_ids) + r.params.max_tokens) // 16)
               for r in _clamp_requests(_prompts(9)))
    return need + 1


def test_no_compile_after_warmup(model):
    # The engine settings of test_k_is_clamped_when_pages_run_out (k = 3, 3 slots, its tight
    # pool; chunks of at most 32 tokens, so longer prompts are prefilled in pieces), which runs
    # after this test on the programs compiled here. 50 requests of varied lengths through the
    # 8-page pool: batches of 1 to 3 rows (buckets 1, 2, 4), drafts clamped for lack of pages.
    eng = _engine(model, "mtp", k=3, running=3, chunk=32, num_pages=_clamp_pool())
    eng.warmup(sampled=False)  # greedy requests only
    before = eng.compiled_program_count()
    reqs = [_req(f"r{i}", p, max_tokens=int(3 + i % 7))
            for i, p in enumerate(_prompts(50, seed=10, lo=2, hi=60))]
    eng.run(reqs)
    assert all(r.finished for r in reqs)
    assert eng.compiled_program_count() == before


def test_k_is_clamped_when_pages_run_out(model, solo):
    prompts, ref = solo
    # A pool just big enough for the guaranteed pages: drafts must be clamped, output unchanged.
    reqs = _clamp_requests(prompts)
    assert _clamp_pool() == 9
    eng = _engine(model, "mtp", k=3, running=3, num_pages=_clamp_pool())
    eng.run(reqs)
    for i, r in zip(CLAMP_ROWS, reqs):
        assert r.output_ids == ref[i]
    assert clamp_num_draft(3, 30, 32, 0, 100, 10, 100) == 1
    assert clamp_num_draft(3, 10, 64, 5, 6, 10, 100) == 0
    assert clamp_num_draft(3, 10, 64, 0, 100, 10, 14) == 3
    assert clamp_num_draft(3, 10, 64, 0, 100, 10, 13) == 2


class _CharTokenizer:
    """Detokenizer double for stop strings: token t is the letter chr(97 + t % 26)."""

    eos_token_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stops_inside_an_accepted_chunk(model, solo):
    prompts, ref = solo
    truth = ref[5]  # 11 tokens

    def all_right(rid, ids, k):
        done = len(ids) - len(prompts[5])
        return (truth + [0] * 8)[done:done + k]

    def run(**kw):
        # The settings of test_batch_equivalence_with_mixed_acceptance (its programs are
        # compiled already); one request at a time.
        eng = _engine(model, "external", k=3, running=4, proposer=all_right, num_pages=40,
                      tokenizer=_CharTokenizer())
        r = _req("x", prompts[5], **kw)
        eng.run([r])
        return r

    # EOS as the 2nd token of the first fully accepted chunk (tokens 1..4 come in round 1).
    eos = truth[2]
    first = truth.index(eos)
    r = run(max_tokens=11, stop_token_ids=[eos])
    assert r.output_ids == truth[:first + 1] and r.finish_reason == "stop"
    # max_tokens ending inside a chunk.
    r = run(max_tokens=3)
    assert r.output_ids == truth[:3] and r.finish_reason == "length"
    # A stop string whose letters span two rounds (round 1 ends after token 4).
    text = _CharTokenizer().decode(truth)
    stop = text[3:6]
    r = run(max_tokens=11, stop=[stop])
    assert r.finish_reason == "stop"
    assert r.output_ids == truth[:text.index(stop) + len(stop)]
    assert r.stop_text_len == text.index(stop)


def test_greedy_round_program_has_no_host_synchronising_control_flow(model):
    """On a GPU each `while` iteration or `conditional` predicate is a device-to-host round trip
    that also splits XLA's command buffers; the greedy round (verify, accept, commit, snapshot
    replay, draft chain) must have none. (The sampling variant keeps the top-k/top-p filter's
    skip and, on CPU, threefry's round loop.)"""
    from mtp_jax.engine.packing import pack
    from mtp_jax.engine.variants import RoundVariant
    from mtp_jax.engine.warmup import padding_round_batch

    eng = _engine(model, "mtp", k=3, running=2)
    buf, layout = pack(padding_round_batch(2, 3, eng.max_pages_per_req))
    hlo = eng.device.programs.round_jit.lower(
        eng.device.leaves, eng.pools, buf, layout=layout,
        variant=RoundVariant(k=3, proposer="mtp", greedy_only=True, snapshot=True)).as_text()
    for op in ("stablehlo.while", "stablehlo.case", "stablehlo.if"):
        assert op not in hlo
