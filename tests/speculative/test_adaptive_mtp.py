"""MTP rounds around plain ones (adaptive speculation, mtp_jax.speculative.adaptive): with the
trained head (tests/fixtures/tiny_trained) and a scripted choice of each call's k, every round's
draft and accept counts equal what teacher-forced ``mtp_forward`` chains imply
(``expected_rounds`` with the plan, tests/helpers/mtp_oracle.py) when a plain round writes the
draft's KV of its committed row and marks its drafts stale: the first drafting round after
plain ones verifies no draft, the next ones accept as if no round had been plain. A plain round
that left the draft's KV unwritten would change the later drafts, and the counts would show it.
The qwen4_exp counterpart: test_qwen4_exp_mtp_accepts.py."""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.train.synthetic import motif_prompts
from tests.helpers.engine_runs import run_per_round
from tests.helpers.mtp_oracle import ScriptedAdaptive, expected_rounds, greedy_drafts
from tests.helpers.paths import fixture_path

K = 3
MAX_NEW = 40
# the k of each call: drafting, a run of plain rounds, drafting again, ...
PLAN = [K, 0, 0, 0, K, K, K, 0, K, K, 0, 0, 0, 0, 0, K, K, K, K, 0, K]


@pytest.fixture(scope="module")
def model():
    return load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)


def _engine(model, algo):
    return Engine(model, EngineConfig(max_running_requests=1, dtype="float32", page_size=4,
                                      max_model_len=96, enable_prefix_cache=False,
                                      chunked_prefill_size=16, overlap_schedule=False,
                                      num_scheduler_steps=1),
                  SpeculativeConfig(algorithm=algo, num_steps=K))


def _request(prompt):
    return Request(request_id="a", index=0, prompt=None, prompt_ids=list(prompt), seed=0,
                   params=SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))


@pytest.mark.parametrize("seed,prefill_drafts", [(21, True), (8, True), (21, False)])
def test_rounds_after_plain_rounds_accept_as_the_chain_implies(model, seed, prefill_drafts):
    """``prefill_drafts`` False: the prefill writes the draft KV over the prompt rows (the
    last paired with the first token) and drafts nothing (the prefill variant without drafts,
    Scheduler.prefill_drafts), so the first round verifies none and the later ones accept as
    the chain implies; a last prompt row left out of the draft KV changes the later drafts."""
    prompt = motif_prompts(1, seed=seed)[0]
    (ref,) = [_request(prompt)]
    _engine(model, "none").run([ref])
    seq = prompt + ref.output_ids
    drafts = greedy_drafts(model, np.asarray(seq, np.int32), K)
    want = [(room, n) for _, room, n in expected_rounds(drafts, seq, len(prompt), K, MAX_NEW,
                                                         PLAN, prefill_drafts)]
    assert sum(n for _, n in want[4:]) >= 4, "the fixture must accept drafts after plain rounds"
    assert want[0][0] == (K if prefill_drafts else 0)
    eng = _engine(model, "mtp")
    eng.scheduler.adaptive = ScriptedAdaptive(PLAN, K, prefill_drafts)
    variants = []
    prefill = eng.scheduler.device.prefill
    eng.scheduler.device.prefill = lambda b, v: variants.append(v) or prefill(b, v)
    req = _request(prompt)
    seen = run_per_round(eng, [req])["a"]
    assert req.output_ids == ref.output_ids
    got = np.diff([(0, 0)] + seen, axis=0).tolist()
    assert got == [list(w) for w in want]
    assert eng.stats.plain_rounds == PLAN.count(0)
    # chunks that end no prompt draft nothing; the one that ends it drafts as the policy says
    assert [v.drafts for v in variants] == [False] * (len(variants) - 1) + [prefill_drafts]
