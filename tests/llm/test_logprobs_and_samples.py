"""SamplingParams.logprobs and n through LLM on the trained fixture (its MTP head is trained,
so drafts are accepted): each emitted token's log-probability and top alternatives equal a
float64 log-softmax of the research forward's logits (LoadedModel.forward on prompt +
output) at its position, greedy (with MTP on and off) and sampled (the filtered
distribution); n samples get seed + i, their own outputs, and share sample 0's prompt pages."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax import LLM, SamplingParams
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from tests.helpers.engine_runs import make_requests
from tests.helpers.paths import fixture_path
from tests.sampling.test_logprobs import numpy_logprobs

PROMPT = [5, 9, 30, 7, 200, 41, 3]
LONG = list(range(3, 40))  # 37 tokens: past two 16-token snapshot boundaries (page_size 4)


@pytest.fixture(scope="module")
def llm():
    return LLM(fixture_path("tiny_trained"), dtype="float32", speculative_num_steps=2,
               max_running_requests=4, page_size=4, max_model_len=96)


def reference(llm, prompt, tokens, t=0.0, k=-1, p=1.0):
    """float64 log-probabilities ``[len(tokens), V]`` of each output position from the
    research forward's logits."""
    ids = list(prompt) + list(tokens)
    ids = jnp.asarray([ids + [0] * (64 - len(ids))], jnp.int32)  # one shape: one compile
    logits = np.asarray(llm.model.forward(ids)[0][0], np.float64)
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    return np.stack([numpy_logprobs(r, t, k, p) for r in rows])


def check(out, ref, n_top):
    """Chosen logprobs and the top alternatives (sorted, as the reference ranks them)."""
    assert len(out.logprobs) == len(out.token_ids)
    for pos, (lp, tok) in enumerate(zip(out.logprobs, out.token_ids)):
        assert lp.token_id == tok and np.isfinite(lp.logprob)
        assert lp.logprob == pytest.approx(ref[pos, tok], abs=3e-5)
        ids = [i for i, _ in lp.top]
        vals = np.array([v for _, v in lp.top])
        assert len(ids) == n_top and np.all(np.diff(vals) <= 0)
        np.testing.assert_allclose(vals, np.sort(ref[pos])[::-1][:n_top], atol=3e-5)
        np.testing.assert_allclose(vals, ref[pos, ids], atol=3e-5)


def test_greedy_logprobs_with_mtp_equal_the_forward(llm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    out = llm.generate([PROMPT], params)[0]
    assert out.num_accepted_tokens > 0  # some tokens came from accepted drafts
    check(out, reference(llm, PROMPT, out.token_ids), 3)
    # greedy: each token is the forward's best (so the tokens are plain decoding's)
    assert all(lp.top[0][0] == lp.token_id for lp in out.logprobs)


def test_greedy_logprobs_without_mtp_equal_the_forward(llm):
    eng = Engine(llm.model, EngineConfig(max_running_requests=2, dtype="float32",
                                         max_model_len=96, enable_prefix_cache=False),
                 SpeculativeConfig(algorithm="none", num_steps=3))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4)
    (req,) = eng.run(make_requests([(PROMPT, params)]))
    out = llm._output(req)
    assert out.num_draft_tokens == 0
    check(out, reference(llm, PROMPT, out.token_ids), 4)


def test_sampled_logprobs_are_the_filtered_distribution(llm):
    """temperature 0.8, top_k 3 with MTP on: the sampled tokens' logprobs are those of the
    distribution they are drawn from; ids past the top-k are -inf."""
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=12, ignore_eos=True, seed=3,
                            logprobs=4)
    out = llm.generate([PROMPT], params)[0]
    ref = reference(llm, PROMPT, out.token_ids, t=0.8, k=3)
    check(out, ref, 4)
    assert all(lp.top[3][1] == -np.inf for lp in out.logprobs)


def test_n_samples_seeds_indices_and_shared_prompt(llm):
    llm.flush_cache()
    sampled = dict(temperature=0.8, top_k=3, max_tokens=6, ignore_eos=True, logprobs=4)
    outs = llm.generate([LONG], SamplingParams(seed=11, n=3, **sampled))
    assert [o.sample_index for o in outs] == [0, 1, 2]
    assert [o.cached_tokens for o in outs] == [0, 32, 32]  # the prompt's two snapshots
    solo = llm.generate([LONG], SamplingParams(seed=12, **sampled))[0]
    assert outs[1].token_ids == solo.token_ids  # sample 1 is seeded 11 + 1
    assert len({tuple(o.token_ids) for o in outs}) == 3
    check(outs[2], reference(llm, LONG, outs[2].token_ids, t=0.8, k=3), 4)


def test_stream_n_and_logprobs(llm):
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2, logprobs=4)
    got = {0: [], 1: []}
    lps = {0: [], 1: []}
    finals = {}
    for s in llm.generate_stream([PROMPT], params):
        assert s.index == s.sample_index
        got[s.index] += s.new_token_ids
        lps[s.index] += s.new_logprobs
        if s.finished:
            finals[s.index] = s.output
    for i in (0, 1):
        assert got[i] == finals[i].token_ids and lps[i] == finals[i].logprobs
    assert finals[0].token_ids == finals[1].token_ids  # greedy samples agree
