"""Helpers shared by the engine scheduling tests (overlap, multi-step): requests from
``(prompt, SamplingParams)`` pairs, random prompts, a whole run on a fresh engine, and a count
of the commits programs trace."""

import numpy as np

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams


def make_requests(specs, seed=100):
    """``specs``: (prompt, SamplingParams) pairs -> requests with distinct seeds from ``seed``."""
    return [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=seed + i) for i, (p, sp) in enumerate(specs)]


def run_engine(model, specs, k, *, seed=100, running=2, prefix=False, num_pages=None, **cfg):
    """Serve ``specs`` to completion on a fresh float32 engine (``max_model_len`` 96, snapshots
    every page; ``cfg``: more ``EngineConfig`` fields), MTP with ``k`` drafts or plain decoding
    for k = 0. Checks that nothing is left running and every slot is free. Returns
    ``([(output_ids, finish_reason)], engine)``."""
    eng = Engine(model, EngineConfig(max_running_requests=running, dtype="float32",
                                     max_model_len=96, num_pages=num_pages,
                                     enable_prefix_cache=prefix, snapshot_interval_pages=1,
                                     **cfg),
                 SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3))
    reqs = eng.run(make_requests(specs, seed))
    assert not eng.has_work() and eng.book.slots.num_free == eng.book.slots.size - 1
    return [(r.output_ids, r.finish_reason) for r in reqs], eng


def random_prompts(n, seed, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 300, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def greedy_requests(prompts, tags, max_tokens):
    """Greedy requests (EOS ignored, seed 0) of ``prompts`` with request ids ``tags``."""
    params = greedy(max_tokens)
    return [Request(request_id=tag, index=i, prompt=None, prompt_ids=list(p), params=params,
                    seed=0) for i, (tag, p) in enumerate(zip(tags, prompts))]


def run_per_round(engine, reqs):
    """Run ``reqs`` on ``engine`` (one round per call, overlap off, so that every round is
    seen); returns per request id the ``(num_draft_tokens, num_accepted_tokens)`` totals after
    each of its rounds."""
    seen = {r.request_id: [] for r in reqs}

    def on_round(rs):
        for r in rs:
            if r.num_rounds > len(seen[r.request_id]):
                assert r.num_rounds == len(seen[r.request_id]) + 1, "a round went unseen"
                seen[r.request_id].append((r.num_draft_tokens, r.num_accepted_tokens))

    engine.run(reqs, on_round=on_round)
    return seen


def trace_commits(monkeypatch, model_class) -> list:
    """Count ``model_class.commit`` calls (one entry per call, made while a program traces):
    the list the patched method appends to. Keeps the programs off the executable cache's
    disk, whose key does not see a patched class attribute, so every run traces."""
    from mtp_jax.engine import executable_cache

    monkeypatch.setattr(executable_cache, "cache_dir", lambda: None)
    calls: list = []
    original = model_class.commit
    monkeypatch.setattr(model_class, "commit",
                        lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    return calls
