"""Errors inside ``Engine.step()``: the exception reaches the caller with its traceback, every
request the engine held is aborted (slots, KV pages and snapshot ids released, no queue holds
it, a round in flight is dropped unread), and the same ``LLM`` then generates what a fresh one
does. Also ``Engine.abort`` and a stream closed early.

One LLM for the module (tiny MoE, MTP k = 2, two slots, overlap and prefix cache on, as
test_llm.py's): failures are injected by wrapping a method the step calls so that it raises
once, at a chosen moment."""

import dataclasses

import jax
import numpy as np
import pytest

from mtp_jax import LLM
from tests.helpers.engine_runs import greedy, make_requests
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_moe_fused")


class InjectedError(RuntimeError):
    pass


def _prompts(n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 300, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


# Three short prompts through two slots (the third is admitted when the first finishes, while
# the second decodes); a 60-token one whose rounds reach the prefix cache's snapshot boundary
# at 64 (those rounds take snapshot ids and run unchained).
SHORT = (_prompts(3, 3, 9, seed=21), [greedy(6), greedy(12), greedy(9)])
LONG = ([_prompts(1, 60, 61, seed=22)[0], SHORT[0][0]], [greedy(10), greedy(8)])


def _free_counts(eng):
    return (eng.book.slots.num_free, eng.book.pages.num_free,
            eng.prefix.snapshot_ids.num_free if eng.prefix is not None else None)


@pytest.fixture(scope="module")
def llm():
    # one round per call: the failure scenarios below are timed in rounds
    return LLM(CKPT, dtype="float32", speculative_algorithm="mtp", speculative_num_steps=2,
               max_running_requests=2, num_scheduler_steps=1)


@pytest.fixture(scope="module")
def fresh(llm):
    """The fresh LLM's free counts and its greedy outputs of SHORT and LONG (the references)."""
    counts = _free_counts(llm.engine)
    want = {name: [o.token_ids for o in llm.generate(*prompts)]
            for name, prompts in (("short", SHORT), ("long", LONG))}
    return counts, want


class _Programs:
    """The engine's programs with attributes that may be replaced (``Programs`` is frozen)."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)


def _injected_failure(what):
    raise InjectedError(f"injected failure in {what}")


def fail_once(monkeypatch, obj, name, when, before=None):
    """Make ``obj.name`` raise ``InjectedError`` on its first call for which ``when(*args,
    **kwargs)`` holds (after ``before(*args, **kwargs)``, if given); returns a dict whose
    ``fired`` says whether it did."""
    real, state = getattr(obj, name), {"fired": False}

    def wrapper(*args, **kwargs):
        if not state["fired"] and when(*args, **kwargs):
            state["fired"] = True
            if before is not None:
                before(*args, **kwargs)
            _injected_failure(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return state


def _spy_requests(monkeypatch, eng):
    added, real = [], eng.add_request

    def spy(req):
        added.append(req)
        return real(req)

    monkeypatch.setattr(eng, "add_request", spy)
    return added


def assert_clean(eng, counts, requests=()):
    """Nothing queued, decoding or in flight; every request finished and holding nothing; after
    a cache flush, the free slots, pages and snapshot ids of a fresh engine, each id once."""
    assert not eng.has_work()
    sched = eng.scheduler
    assert not sched.waiting and not sched.prefilling and not sched.decoding
    assert sched.inflight is None
    for r in requests:
        assert r.finished and r.slot == 0 and r.pages == [] and r.prefix_nodes == []
        assert r.snapshots == {}
    eng.flush_cache()
    assert _free_counts(eng) == counts
    for fl in (eng.book.slots, eng.book.pages, eng.prefix and eng.prefix.snapshot_ids):
        if fl is not None:
            assert sorted(fl._free) == list(range(1, fl.size))


def _raised_here(excinfo):
    names = [e.name for e in excinfo.traceback]
    return "_injected_failure" in names and "step" in names


def _round_in_flight(eng):
    return lambda *a, **k: eng.scheduler.inflight is not None


def fails_then_serves(llm, monkeypatch, state, counts, added, want):
    """``generate(SHORT)`` raises the injected error from inside ``step()``, leaving the engine
    clean (:func:`assert_clean`); with the failure undone, the next call gives the fresh
    LLM's outputs."""
    with pytest.raises(InjectedError) as excinfo:
        llm.generate(*SHORT)
    assert state["fired"] and _raised_here(excinfo)
    assert_clean(llm.engine, counts, added)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]
    assert_clean(llm.engine, counts)


@pytest.mark.parametrize("where", ["dispatch", "collect"])
def test_round_failure_with_a_round_in_flight(llm, fresh, monkeypatch, where):
    """k = 2, overlap on: a chained round's dispatch (the program call) or the collect of the
    round before it (with the chained one in flight) raises."""
    counts, want = fresh
    eng = llm.engine
    llm.flush_cache()
    added = _spy_requests(monkeypatch, eng)
    if where == "dispatch":
        monkeypatch.setattr(eng.device, "programs", _Programs(eng.device.programs))
        state = fail_once(monkeypatch, eng.device.programs, "round", _round_in_flight(eng))
    else:
        state = fail_once(monkeypatch, eng.scheduler, "collect",
                          lambda f, later=None: later is not None
                          and eng.scheduler.inflight is later)
    fails_then_serves(llm, monkeypatch, state, counts, added, want)


def test_prefill_failure_while_another_request_decodes(llm, fresh, monkeypatch):
    """The third prompt's prefill (the first request finished, the second decoding) raises."""
    counts, want = fresh
    eng = llm.engine
    llm.flush_cache()
    added = _spy_requests(monkeypatch, eng)
    monkeypatch.setattr(eng.device, "programs", _Programs(eng.device.programs))
    rounds = eng.stats.rounds
    state = fail_once(monkeypatch, eng.device.programs, "prefill", lambda *a, **k: (
        eng.stats.rounds > rounds and any(not r.finished for r in eng.scheduler.decoding)))
    fails_then_serves(llm, monkeypatch, state, counts, added, want)


def test_round_failure_that_consumed_the_pools(llm, fresh, monkeypatch):
    """A round that saves a prefix-cache snapshot (snapshot ids taken for it) fails after its
    donated pools were consumed, as a device failure leaves them: the engine makes new pools
    (the prefix cache starts empty) and generates as before."""
    counts, want = fresh
    eng = llm.engine
    added = _spy_requests(monkeypatch, eng)
    monkeypatch.setattr(eng.device, "programs", _Programs(eng.device.programs))
    consume = lambda leaves, pools, batch, variant: jax.tree.map(lambda a: a.delete(), pools)
    state = fail_once(monkeypatch, eng.device.programs, "round",
                      lambda leaves, pools, batch, variant: variant.snapshot, before=consume)
    with pytest.raises(InjectedError) as excinfo:
        llm.generate(*LONG)
    assert state["fired"] and _raised_here(excinfo)
    assert not any(a.is_deleted() for a in jax.tree.leaves(eng.pools))
    assert_clean(eng, counts, added)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(*LONG)] == want["long"]
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]
    assert_clean(eng, counts)


def test_stream_closed_early_aborts_its_requests(llm, fresh, monkeypatch):
    counts, want = fresh
    eng = llm.engine
    added = _spy_requests(monkeypatch, eng)
    stream = llm.generate_stream(*SHORT)
    next(stream), next(stream)
    assert eng.has_work()
    stream.close()
    assert_clean(eng, counts, added)
    assert all(r.finish_reason == "abort" for r in added)
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]


def test_stream_left_open_is_aborted_by_the_next_call(llm, fresh, monkeypatch):
    """A stream neither read to its end nor closed (kept alive, as a traceback can keep it):
    the next call aborts its requests with a warning, and resuming it raises."""
    counts, want = fresh
    eng = llm.engine
    added = _spy_requests(monkeypatch, eng)
    stream = llm.generate_stream(*SHORT)
    next(stream)
    with pytest.warns(RuntimeWarning, match="left open"):
        assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]
    assert all(r.finish_reason == "abort" for r in added[:3])
    with pytest.raises(RuntimeError, match="left open"):
        next(stream)
    assert_clean(eng, counts, added)


def test_add_request_failure_aborts_the_calls_earlier_requests(llm, fresh, monkeypatch):
    counts, want = fresh
    eng = llm.engine
    added = _spy_requests(monkeypatch, eng)
    state = fail_once(monkeypatch, eng, "add_request", lambda r: len(added) == 1)
    with pytest.raises(InjectedError):
        llm.generate(*SHORT)
    assert state["fired"] and len(added) == 1
    assert_clean(eng, counts, added)
    monkeypatch.undo()
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]


def test_engine_abort_with_a_round_in_flight(llm, fresh):
    """Engine.abort of one of two requests while a round computes both: the other finishes with
    its own tokens; abort() of everything drops the round in flight and leaves the engine idle."""
    counts, want = fresh
    eng = llm.engine
    a, b = make_requests(list(zip(*SHORT))[1:3])
    eng.add_request(a)
    eng.add_request(b)
    while eng.scheduler.inflight is None:
        eng.step()
    assert eng.abort([a]) == [a] and a.finish_reason == "abort"
    while eng.has_work():
        eng.step()
    assert b.output_ids == want["short"][2] and b.finish_reason == "length"
    assert_clean(eng, counts, [a, b])

    a, b = make_requests(list(zip(*SHORT))[1:3])
    eng.run([a])  # not in the engine any more: abort leaves it as it is
    eng.add_request(b)
    while eng.scheduler.inflight is None:
        eng.step()
    assert eng.abort() == [b]
    assert eng.abort([a]) == [] and a.finish_reason == "length"
    assert b.finish_reason == "abort"
    assert_clean(eng, counts, [a, b])
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]


def test_resize_cache_failure_keeps_the_old_pools(llm, fresh, monkeypatch):
    """``resize_cache(num_pages=...)`` gives up the old KV pool before it makes the new one; when
    making it fails (as out of device memory would), the engine holds pools of the old sizes
    again and generates as before."""
    from types import SimpleNamespace

    from mtp_jax.models import registry

    counts, want = fresh
    eng = llm.engine
    llm.generate(*SHORT)  # something in the prefix cache
    sizes = (eng.book.pages.size, eng.book.slots.size)
    before = jax.tree_util.tree_structure(eng.pools)
    shapes = [a.shape for a in jax.tree.leaves(eng.pools)]
    entry = registry.entry_of(eng.model.cfg)  # the family's pools, made through its entry
    pools = SimpleNamespace(make=entry.make_pools)
    state = fail_once(monkeypatch, pools, "make", lambda *a, **k: True)
    monkeypatch.setitem(registry.REGISTRY, entry.model_type, dataclasses.replace(
        entry, make_pools=lambda *a, **k: pools.make(*a, **k)))
    with pytest.raises(InjectedError):
        eng.resize_cache(num_pages=eng.book.pages.size + 16)
    monkeypatch.undo()
    assert state["fired"] and (eng.book.pages.size, eng.book.slots.size) == sizes
    assert jax.tree_util.tree_structure(eng.pools) == before  # no field left None
    assert [a.shape for a in jax.tree.leaves(eng.pools)] == shapes
    assert_clean(eng, counts)
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]


def test_warmup_failure_that_consumed_the_pools(llm, fresh, monkeypatch):
    """A warm-up call that fails after its donated pools were consumed: new pools, then the
    same outputs."""
    counts, want = fresh
    eng = llm.engine
    monkeypatch.setattr(eng.device, "programs", _Programs(eng.device.programs))
    consume = lambda leaves, pools, batch, variant: jax.tree.map(lambda a: a.delete(), pools)
    state = fail_once(monkeypatch, eng.device.programs, "round", lambda *a, **k: True,
                      before=consume)
    with pytest.raises(InjectedError) as excinfo:
        eng.warmup(sampled=False, max_batch=1, max_prompt_len=16)
    assert state["fired"] and not getattr(excinfo.value, "__notes__", None)
    monkeypatch.undo()
    assert not any(a.is_deleted() for a in jax.tree.leaves(eng.pools))
    assert_clean(eng, counts)
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]


def test_interrupted_clean_up_is_finished_by_the_next_call(llm, fresh, monkeypatch):
    """A second failure inside a call's clean-up (its ``Engine.abort``, as a second Ctrl-C
    there) leaves the call's requests in the engine; the next call aborts them with a warning
    and generates what a fresh LLM does."""
    counts, want = fresh
    eng = llm.engine
    added = _spy_requests(monkeypatch, eng)
    stream = llm.generate_stream(*SHORT)
    next(stream), next(stream)
    state = fail_once(monkeypatch, eng, "abort", lambda *a, **k: True)
    with pytest.raises(InjectedError):
        stream.close()
    assert state["fired"] and eng.has_work()
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match="clean-up after an error was interrupted"):
        assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]
    assert all(r.finish_reason == "abort" for r in added)
    assert_clean(eng, counts, added)


def test_interrupted_recovery_is_finished_by_the_next_call(llm, fresh, monkeypatch):
    """A round fails after consuming its pools and the recovery fails while checking them: the
    error says so, and the next call makes new pools and generates what a fresh LLM does."""
    from mtp_jax.engine import abort as abort_mod

    counts, want = fresh
    eng = llm.engine
    monkeypatch.setattr(eng.device, "programs", _Programs(eng.device.programs))
    consume = lambda leaves, pools, batch, variant: jax.tree.map(lambda a: a.delete(), pools)
    fail_once(monkeypatch, eng.device.programs, "round", lambda *a, **k: True, before=consume)
    fail_once(monkeypatch, abort_mod, "pools_usable",  # in the recovery, not at call start
              lambda pools: any(a.is_deleted() for a in jax.tree.leaves(pools)))
    with pytest.raises(InjectedError) as excinfo:
        llm.generate(*SHORT)
    assert "could not recover" in " ".join(getattr(excinfo.value, "__notes__", []))
    monkeypatch.undo()
    assert any(a.is_deleted() for a in jax.tree.leaves(eng.pools))
    assert [o.token_ids for o in llm.generate(*SHORT)] == want["short"]
    assert_clean(eng, counts)


def test_stream_ends_a_request_aborted_between_steps(llm, fresh):
    """``Engine.abort`` of one request between two items of a stream: the stream yields a last
    item (``finished``, ``finish_reason`` ``"abort"``) for it after the next step, and the
    others end with their own tokens."""
    counts, want = fresh
    eng = llm.engine
    items = []
    for item in llm.generate_stream(*SHORT):
        items.append(item)
        if len(items) == 2:
            victim = items[0].request_id
            assert len(eng.abort([r for r in eng.scheduler.held() if r.request_id == victim])) == 1
    finals = {x.index: x for x in items if x.finished}
    assert sorted(finals) == [0, 1, 2]
    assert sum(x.finished for x in items) == 3
    # its last item comes after the next step, not at the end of the stream
    at = [n for n, x in enumerate(items) if x.finished]
    assert items[at[0]].request_id == victim and at[0] < 8
    for i, x in finals.items():
        if x.request_id == victim:
            assert x.output.finish_reason == "abort"
        else:
            assert x.output.token_ids == want["short"][i]
    assert_clean(eng, counts)
