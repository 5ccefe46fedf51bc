"""Sampling with accepted drafts on qwen4_exp: with the trained draft of
tests/fixtures/tiny_qwen4_trained, the tokens MTP rounds emit at temperature > 0 follow the
target's filtered distribution: chi-square at output index 1 (the first token a round decides)
and 2, each conditional on the tokens before it, against float64 numpy probabilities from the
research forward (as test_mtp_sampling.py does for qwen3_5). Drafts must be accepted for the test
to mean anything (checked)."""

import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from tests.fixtures.make_qwen4_trained_fixture import fixture_prompts
from tests.helpers.paths import fixture_path
from tests.speculative.test_mtp_sampling import _chisq, _filtered

N = 400


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.25, 2, 1.0)])
def test_qwen4_exp_mtp_rounds_sample_the_target_distribution(temperature, top_k, top_p):
    model = load_model(fixture_path("tiny_qwen4_trained"), "float32", with_mtp=True)
    prompt = fixture_prompts(model.cfg.vocab_size)[0]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=4,
                            ignore_eos=True)
    reqs = [Request(request_id=f"s{i}", index=i, prompt=None, prompt_ids=list(prompt),
                    params=params, seed=1000 + i) for i in range(N)]
    Engine(model, EngineConfig(max_running_requests=16, dtype="float32", max_model_len=32,
                               page_size=4, enable_prefix_cache=False),
           SpeculativeConfig(algorithm="mtp", num_steps=3)).run(reqs)
    accepted = sum(r.num_accepted_tokens for r in reqs)
    assert accepted > N // 2, f"drafts were accepted {accepted} times in {N} requests"
    outs = np.asarray([r.output_ids for r in reqs])
    for index in (1, 2):
        prefixes, inverse, counts = np.unique(outs[:, :index], axis=0, return_inverse=True,
                                              return_counts=True)
        top = int(np.argmax(counts))
        rows = outs[inverse.reshape(-1) == top, index]
        assert len(rows) >= 100, f"index {index}: {len(rows)} samples after the top prefix"
        logits, _ = model.forward(np.asarray([prompt + prefixes[top].tolist()]))
        probs = _filtered(np.asarray(logits)[0, -1], temperature, top_k, top_p)
        _chisq(rows, probs, f"output index {index} after {prefixes[top].tolist()}")
