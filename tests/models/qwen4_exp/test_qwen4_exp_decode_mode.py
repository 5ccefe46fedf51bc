"""qwen4_exp's ``decode`` mode: a plain (k = 0) round advances every slot state by its row as a
prefill does (GDN step form, QSA open group, PLE conv, n-gram context) and runs no commit. The
reference is the same engine with the mode taken away (``gdn_modes`` without ``"decode"``):
verify + commit of the one row, the path plain rounds ran before. Same tokens, the same slot
states after every round, and prefix-cache snapshots saved from the decode form serve a later
request as the verify form's do."""

from __future__ import annotations

import jax
import numpy as np

from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_exp")


def _engine_run(m, prompts, max_tokens: int, follow_up: bool):
    from mtp_jax.config import EngineConfig, SpeculativeConfig
    from mtp_jax.engine.engine import Engine
    from mtp_jax.engine.requests import Request, SamplingParams

    eng = Engine(m, EngineConfig(max_running_requests=2, dtype="float32", overlap_schedule=False,
                                 page_size=4, snapshot_interval_pages=2, num_scheduler_steps=1),
                 SpeculativeConfig(algorithm="none"))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    make = lambda i, p: Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=p,
                                params=params, seed=0)
    reqs = [make(i, p) for i, p in enumerate(prompts)]
    states = {}

    def on_round(rs):
        for r in rs:
            if not r.finished and r.slot:
                states[r.request_id, r.position] = [np.asarray(a[r.slot])
                                                    for a in jax.tree.leaves(eng.pools.gdn)]

    eng.run(reqs, on_round=on_round)
    outs = [r.output_ids for r in reqs]
    if follow_up:  # a prompt past the first one's snapshots: served from one of them
        again = make(9, list(prompts[0]) + outs[0] + [7, 3])
        eng.run([again])
        outs.append(again.output_ids)
        assert again.cached_tokens > 0
    return outs, states


def test_plain_rounds_in_decode_mode_equal_verify_and_commit(monkeypatch):
    from mtp_jax.models.loader import load_model
    from mtp_jax.models.qwen4_exp.model import Qwen4ExpModel
    from tests.helpers.engine_runs import trace_commits

    calls = trace_commits(monkeypatch, Qwen4ExpModel)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 200, n).tolist() for n in (5, 11)]  # inside / on index blocks
    load = lambda: load_model(FIX, "float32", with_mtp=False, ple_backend="memory")
    out_d, st_d = _engine_run(load(), prompts, 12, follow_up=True)
    assert not calls  # no commit traced: the decode mode's rounds
    monkeypatch.setattr(Qwen4ExpModel, "gdn_modes", ("prefill", "verify"))
    out_v, st_v = _engine_run(load(), prompts, 12, follow_up=True)
    assert calls
    assert out_d == out_v
    assert st_d.keys() == st_v.keys() and len(st_d) >= 20
    for key in st_d:
        for a, c in zip(st_d[key], st_v[key]):
            np.testing.assert_allclose(a, c, atol=1e-5, rtol=0, err_msg=str(key))
