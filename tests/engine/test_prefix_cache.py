"""Prefix cache: a request sharing a prefix with an earlier one gives the same output with the
cache on and off, with speculation on and off; reuse happens exactly where a GDN snapshot and
the draft lookahead (with MTP) allow it; eviction and flush return every page."""

import jax
import numpy as np
import pytest

from mtp_jax.cache.radix import RadixCache
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.train.synthetic import motif_prompts
from tests.helpers.paths import fixture_path

PAGE, INTERVAL = 4, 2  # snapshots every 8 tokens


@pytest.fixture(scope="module")
def model():
    return load_model(fixture_path("tiny_dense"), "float32", with_mtp=True)


def _req(tag, prompt, max_tokens=6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=tag, index=0, prompt=None, prompt_ids=list(prompt), params=params,
                   seed=0)


def _engine(model, algo, cache, num_pages=None):
    return Engine(model, EngineConfig(max_running_requests=2, dtype="float32", page_size=PAGE,
                                      max_model_len=64, enable_prefix_cache=cache,
                                      snapshot_interval_pages=INTERVAL, num_pages=num_pages),
                  SpeculativeConfig(algorithm=algo, num_steps=2))


def _pair(share, vocab=300):
    rng = np.random.default_rng(share)
    a = rng.integers(2, vocab, 30).tolist()
    b = a[:share] + [(t + 7) % (vocab - 2) + 2 for t in rng.integers(2, vocab, 25 - share)]
    assert len(share and b[:share] or []) == share and (share >= 25 or b[share] != a[share])
    return a, b


def _expected_reuse(share: int) -> int:
    """Tokens reused by a prompt sharing ``share`` tokens with a cached one: up to the deepest
    snapshot boundary (every 8) within the share, a boundary at exactly ``share`` included.
    With MTP the page before that boundary holds a draft-KV row that read the cached prompt's
    next token; the engine copies the page and rewrites that row
    (:func:`test_a_share_ending_on_a_boundary_rewrites_its_draft_row` checks the rows)."""
    return share // (PAGE * INTERVAL) * PAGE * INTERVAL


@pytest.mark.parametrize("algo", ["none", "mtp"])
def test_shared_prefix_same_output_cache_on_and_off(model, algo):
    # shares: 1 token, below / at / above a page boundary (12) and snapshot boundaries (8, 16,
    # 24; b is 25 tokens, so 24 leaves it one token to prefill)
    for share in (1, 7, 8, 9, 12, 15, 16, 17, 24):
        reuse = _expected_reuse(share)
        a, b = _pair(share)
        outs = {}
        for cache in (False, True):
            eng = _engine(model, algo, cache)
            ra, rb = _req("a", a), _req("b", b)
            eng.run([ra])
            eng.run([rb])
            outs[cache] = (ra.output_ids, rb.output_ids, rb.cached_tokens)
            if cache:
                eng.flush_cache()
                assert eng.book.pages.num_free == eng.book.pages.size - 1
                ids = eng.prefix.snapshot_ids
                assert ids.num_free == ids.size - 1
        assert outs[True][:2] == outs[False][:2], share
        assert outs[True][2] == reuse, (share, outs[True][2])


@pytest.mark.parametrize("algo", ["none", "mtp"])
def test_prompts_sharing_a_prefix_in_one_batch_compute_it_once(model, algo):
    """Two prompts sharing 20 tokens, submitted together: the second waits for the first's
    prefill and reuses 16 (the boundary at 16); a third sharing less than a boundary (6) and a
    fourth sharing nothing do not wait. Outputs equal cache-off runs."""
    rng = np.random.default_rng(9)
    base = rng.integers(2, 300, 20).tolist()
    prompts = [base + [3, 4, 5], base + [6, 7], base[:6] + [8, 9, 10], [11, 12, 13, 14]]
    outs = {}
    for cache in (False, True):
        eng = _engine(model, algo, cache)
        reqs = [_req(str(i), p) for i, p in enumerate(prompts)]
        eng.run(reqs)
        outs[cache] = [r.output_ids for r in reqs]
        if cache:
            assert [r.cached_tokens for r in reqs] == [0, 16, 0, 0]
    assert outs[True] == outs[False]


def _draft_rows(eng, pages, n):
    """The draft KV (every leaf of every MTP layer: K, V and, for qwen4_exp, index keys, side
    by side) of positions ``0..n-1`` held in ``pages``: ``[n, X]``."""
    leaves = jax.tree_util.tree_leaves(eng.device.pools.draft_kv)
    return np.concatenate([np.asarray(a)[pages].reshape(len(pages) * a.shape[1], -1)[:n]
                           for a in leaves], axis=-1)


def _capture_prefill(eng, store):
    """Record each request's prompt draft rows when its prefill completes (before any round)."""
    sch = eng.scheduler
    real = sch.finish_prefill

    def wrapped(req):
        store[req.request_id] = (_draft_rows(eng, list(req.pages), len(req.prompt_ids)),
                                 list(req.pages))
        real(req)
    sch.finish_prefill = wrapped


@pytest.mark.parametrize("family", ["qwen3_5", "qwen4_exp"])
def test_a_share_ending_on_a_boundary_rewrites_its_draft_row(model, family):
    """MTP on, a prompt sharing exactly 8 / 16 / 24 tokens (snapshot boundaries) with a cached
    one whose next token differs: it reuses them all, and its draft KV after prefill equals a
    cache-off prefill's, row ``share - 1`` (rewritten from the snapshot's hidden) included;
    the cached prompt's page, copied rather than written, keeps its own row. qwen4_exp (its
    prefill chunks end on boundaries; its draft KV holds index keys too) at share 16."""
    shares, vocab = (8, 16, 24), 300
    if family == "qwen4_exp":
        model = load_model(fixture_path("tiny_qwen4_exp"), "float32", with_mtp=True)
        shares, vocab = (16,), model.cfg.vocab_size
    for share in shares:
        a, b = _pair(share, vocab)
        rows = {}
        for cache in (False, True):
            eng = _engine(model, "mtp", cache)
            got = {}
            _capture_prefill(eng, got)
            ra, rb = _req("a", a, max_tokens=1), _req("b", b, max_tokens=1)
            eng.run([ra])
            eng.run([rb])
            rows[cache] = got
            if cache:
                assert rb.cached_tokens == share
                a_pages = got["a"][1][:share // PAGE]
                assert got["b"][1][:share // PAGE - 1] == a_pages[:-1]  # shared as they are
                assert got["b"][1][share // PAGE - 1] != a_pages[-1]  # the last one copied
                np.testing.assert_array_equal(_draft_rows(eng, a_pages, share),
                                              got["a"][0][:share])
        np.testing.assert_allclose(rows[True]["b"][0], rows[False]["b"][0], rtol=1e-5,
                                   atol=1e-5, err_msg=f"share {share}")
        np.testing.assert_allclose(rows[True]["a"][0], rows[False]["a"][0], rtol=1e-5,
                                   atol=1e-5)
        assert not np.allclose(rows[False]["a"][0][share - 1], rows[False]["b"][0][share - 1])


def _decoded_boundary_rows(model, a, tail):
    """Draft rows after prefill of ``b``: ``a``'s prompt and output up to 16 (a boundary its
    rounds committed), another token 16, then ``tail``; the prefix cache on, then off.
    Returns ``(rows on, rows off, b's cached tokens)``."""
    rows, cached = {}, None
    for cache in (True, False):
        eng = _engine(model, "mtp", cache)
        ra = _req("a", a, max_tokens=14)
        eng.run([ra])
        seq = a + ra.output_ids
        b = seq[:16] + [(seq[16] + 5) % 250 + 2] + tail
        got = {}
        _capture_prefill(eng, got)
        rb = _req("b", b, max_tokens=1)
        eng.run([rb])
        rows[cache] = got["b"][0]
        cached = rb.cached_tokens if cache else cached
    return rows[True], rows[False], cached


def test_a_boundary_saved_while_decoding_rewrites_its_draft_row(model):
    """As above, with the boundary (16) committed by a decoding round: the snapshot's hidden
    comes from a verify row, and the rewritten row equals a cache-off prefill's. The trained
    head (tests/fixtures/tiny_trained) accepts drafts, so the boundary falls on verify rows
    past the first too."""
    trained = load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)
    rng = np.random.default_rng(5)
    cases = [(model, rng.integers(2, 250, 10).tolist())]
    cases += [(trained, p[:10]) for p in motif_prompts(3, seed=3)]
    for m, a in cases:
        on, off, cached = _decoded_boundary_rows(m, a, rng.integers(2, 250, 4).tolist())
        assert cached == 16
        np.testing.assert_allclose(on, off, rtol=1e-5, atol=1e-5)


def test_radix_lookahead_and_lru_eviction():
    rc = RadixCache(page_size=2, snapshot_interval_pages=1)
    held, owned, unused, freed = rc.insert([1, 2, 3, 4, 5], 4, [10, 11], {2: 100, 4: 101})
    assert owned == [10, 11] and unused == [] and freed == []
    rc.release(held)
    assert [n.page for n in rc.match([1, 2, 3, 4, 5, 6])] == [10, 11]
    assert [n.page for n in rc.match([1, 2, 3, 4, 9, 6])] == [10]  # lookahead 5 != 9
    assert rc.match([1, 2, 7, 4, 5]) == []  # page 0's lookahead is 3
    assert rc.match([1, 2, 3, 4]) == [rc.match([1, 2, 3])[0]]  # one token left to prefill
    held2, owned2, _, _ = rc.insert([1, 2, 8, 8, 8], 4, [13, 12], {})  # same page, other lookahead
    assert owned2 == [13, 12]
    rc.release(held2)
    pages, snaps = rc.evict(1)
    assert pages == [11] and snaps == [101]  # the older leaf goes first
    pages, snaps = rc.flush()
    assert sorted(pages) == [10, 12, 13] and snaps == [100]


def test_radix_lookup_ends_on_a_same_token_page_with_a_snapshot():
    """With lookahead keys: a walk that stops at a page whose tokens match but whose next
    token does not ends there (``redraft``) when that page holds a snapshot, else at the
    boundary below; a matched node without a snapshot takes its same-token sibling's."""
    rc = RadixCache(page_size=2, snapshot_interval_pages=1)
    held, _, _, _ = rc.insert([1, 2, 3, 4, 5], 4, [10, 11], {2: 100, 4: 101})
    rc.release(held)
    m = rc.lookup([1, 2, 3, 4, 9, 6])  # page 1's lookahead 5 != 9
    assert ([n.page for n in m.path], m.snapshot, m.redraft) == ([10, 11], 101, True)
    assert [n.page for n in rc.match([1, 2, 3, 4, 9, 6])] == [10]  # keyed only
    m = rc.lookup([1, 2, 3, 4, 5, 6])
    assert ([n.page for n in m.path], m.snapshot, m.redraft) == ([10, 11], 101, False)
    assert rc.lookup([1, 2, 3, 4]).path == rc.match([1, 2, 3])  # one token left to prefill
    # a second node of page 1's tokens (lookahead 9) without a snapshot: the sibling's serves
    held2, owned2, _, _ = rc.insert([1, 2, 3, 4, 9], 4, [10, 12], {})
    rc.release(held2)
    m = rc.lookup([1, 2, 3, 4, 9, 6])
    assert ([n.page for n in m.path], m.snapshot, m.redraft) == ([10, 12], 101, False)
    m = rc.lookup([1, 2, 3, 7, 5])  # page 1's tokens differ: the boundary below
    assert ([n.page for n in m.path], m.snapshot, m.redraft) == ([10], 100, False)
    no_snap = RadixCache(page_size=2, snapshot_interval_pages=1)
    no_snap.insert([1, 2, 3, 4, 5], 4, [10, 11], {2: 100})
    m = no_snap.lookup([1, 2, 3, 4, 9])  # same tokens, no snapshot at their end
    assert ([n.page for n in m.path], m.snapshot, m.redraft) == ([10], 100, False)


def test_radix_without_lookahead_keys_pages_by_their_tokens():
    """No draft KV in the pages: the token after a page is not part of its key, so a prompt
    that shares a page but not the token after it reuses the page, and a second insert of the
    same page under another next token finds the first node."""
    rc = RadixCache(page_size=2, snapshot_interval_pages=1, lookahead=False)
    held, owned, _, _ = rc.insert([1, 2, 3, 4, 5], 4, [10, 11], {2: 100, 4: 101})
    assert [n.page for n in rc.match([1, 2, 3, 4, 9, 6])] == [10, 11]
    assert [n.page for n in rc.match([1, 2, 7])] == [10]
    # the same tokens in other pages while a request uses the tree's: ours stay private
    held2, owned2, _, freed2 = rc.insert([1, 2, 3, 4, 8], 4, [13, 12], {})
    assert owned2 == freed2 == [] and [n.page for n in held2] == [10, 11]
    rc.release(held2)
    rc.release(held)
    # no request uses them: the tree takes ours and lets its own go (nothing pinned twice)
    held3, owned3, _, freed3 = rc.insert([1, 2, 3, 4, 8], 4, [13, 12], {})
    assert owned3 == [13, 12] and freed3 == [10, 11]
    assert [n.page for n in rc.match([1, 2, 3, 4, 9])] == [13, 12]


def test_eviction_under_page_pressure(model):
    # The default pool (37 pages: 2 requests of max_model_len 64 + the trash page) holds the
    # cached pages of about three of these requests (10 pages each): later ones must evict.
    # (It is the pool of the other cache-on engines here, so no program is compiled again.)
    eng = _engine(model, "mtp", True)
    rng = np.random.default_rng(5)
    reqs = [_req(f"r{i}", rng.integers(2, 300, 30).tolist(), max_tokens=8) for i in range(8)]
    for r in reqs:
        eng.run([r])
    assert all(r.finish_reason == "length" for r in reqs)
    assert sum(-(-(len(r.prompt_ids) + 8) // PAGE) for r in reqs) > eng.book.pages.size
    ref = _engine(model, "mtp", False)
    again = [_req(f"x{i}", r.prompt_ids, max_tokens=8) for i, r in enumerate(reqs)]
    ref.run(again)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in again]
    eng.flush_cache()
    assert eng.book.pages.num_free == eng.book.pages.size - 1


@pytest.mark.parametrize("algo", ["none", "mtp"])
def test_second_turn_reuses_the_first_turns_output(model, algo):
    """A follow-up whose prompt holds an earlier request's prompt and output (a chat's second
    turn) reuses pages and GDN snapshots taken while that output was decoded."""
    rng = np.random.default_rng(11)
    first = rng.integers(2, 300, 10).tolist()
    extra = rng.integers(2, 300, 5).tolist()
    outs = {}
    for cache in (False, True):
        eng = _engine(model, algo, cache)
        a = _req("a", first, max_tokens=20)
        eng.run([a])
        follow = first + a.output_ids + extra
        b = _req("b", follow, max_tokens=6)
        eng.run([b])
        outs[cache] = (a.output_ids, b.output_ids, b.cached_tokens, len(follow))
    assert outs[True][:2] == outs[False][:2]
    # the reuse reaches past the first prompt (10 tokens) into its output: snapshot boundaries
    # every 8 tokens; the follow-up has 35 tokens, the first request committed 29.
    assert outs[True][2] == 24, outs[True][2]


def test_snapshot_pool_exists_only_with_the_prefix_cache(model):
    """Without the prefix cache the pools hold no snapshot arrays at all (each pool array is an
    argument buffer of every program call); with it, ``num_snapshots + 1`` states per GDN
    layer (id 0 the trash snapshot)."""
    import jax

    off = _engine(model, "none", cache=False).pools
    assert off.snapshots.recurrent == () and off.snapshots.conv == ()
    on = _engine(model, "none", cache=True).pools
    layers = len(model.cfg.linear_layer_ids)
    assert len(on.snapshots.recurrent) == len(on.snapshots.conv) == layers > 0
    assert on.snapshots.recurrent[0].shape[0] == 4 * 2 + 1  # 4 per running request, + trash
    assert (len(jax.tree_util.tree_leaves(on)) - len(jax.tree_util.tree_leaves(off))
            == 2 * layers)


def test_multi_turn_chat_up_to_the_context_limit_keeps_its_page_guarantee(model):
    """Each turn's prompt is the previous prompt, its answer and new text, until the last turn
    nearly fills ``max_model_len`` in a pool of one request's pages. A turn re-prefills the
    tokens past its deepest snapshot into its own pages; the tree's copies of them must not stay
    pinned (they were counted as evictable in the turn's guarantee), or the turn runs out of
    pages mid-decode (it did: MemoryError)."""
    eng = Engine(model, EngineConfig(max_running_requests=1, dtype="float32", page_size=PAGE,
                                     max_model_len=64, snapshot_interval_pages=INTERVAL,
                                     num_pages=64 // PAGE + 1),
                 SpeculativeConfig(algorithm="none"))
    rng = np.random.default_rng(3)
    prompt, turns = rng.integers(2, 300, 5).tolist(), 0
    while len(prompt) + 6 <= 64:
        r = _req(f"t{turns}", prompt)
        eng.run([r])
        assert r.finish_reason == "length" and len(r.output_ids) == 6
        assert turns == 0 or r.cached_tokens > 0
        prompt = prompt + r.output_ids + rng.integers(2, 300, 3).tolist()
        turns += 1
    assert turns >= 5
