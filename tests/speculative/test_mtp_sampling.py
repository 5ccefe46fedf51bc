"""Sampling with accepted drafts: with the trained fixture's MTP head (tests/fixtures/
tiny_trained), the tokens MTP rounds emit at temperature > 0 follow the target's filtered
distribution (with top-k, top-p and min-p), as plain sampling's do: chi-square at the first token a round decides and at a
later one, each conditional on the tokens before it, against float64 numpy probabilities from
the research forward. Drafts must be accepted for the test to mean anything (checked)."""

import numpy as np
import pytest
from scipy import stats

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.train.synthetic import motif_language, motif_prompts
from tests.helpers.paths import fixture_path

ALPHA = 1e-3
N = 400
MIN_P = 0.35  # between the trained head's two branches' ratios (0.43, 0.28 at T 0.8)


@pytest.fixture(scope="module")
def model():
    return load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)


def _prompt():
    """A prompt whose greedy continuation branches at output index 1 and at a later index
    (so both tested tokens have spread-out distributions): ``(prompt, later index)``."""
    lang = motif_language()
    for p in motif_prompts(400, seed=3, min_len=6, max_len=20):
        g = lang.greedy(p, 10)
        branches = [i for i in range(1, 10) if len(lang.next_tokens(p + g[:i])) > 1]
        if branches[:1] == [1] and len(branches) > 1:
            return p, branches[1]
    raise AssertionError("no prompt branches at index 1 and later")


def _filtered(logits, temperature, top_k, top_p, min_p=0.0):
    """float64 numpy reference of the sampling filter: softmax(logits / T), then the top-k
    tokens, then the smallest set of most likely tokens reaching mass top_p, then those at
    least min_p times as likely as the most likely."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, bool)
    if top_k > 0:
        keep[order[:top_k]] = True
    else:
        keep[:] = True
    q = np.where(keep, p, 0)
    q /= q.sum()
    cum = np.cumsum(q[order])
    cut = np.searchsorted(cum, top_p - 1e-12) + 1
    final = np.zeros_like(keep)
    final[order[:cut]] = True
    q = np.where(final & keep & (p >= min_p * p.max()), q, 0)
    return q / q.sum()


def _chisq(tokens, probs, what):
    """Chi-square of ``tokens`` against ``probs``; ids with expected count < 5 are pooled."""
    counts = np.bincount(tokens, minlength=len(probs))
    assert not ((probs == 0) & (counts > 0)).any(), f"{what}: a token outside the support"
    if (probs > 0).sum() == 1:  # a filter left one id: the support test above is the test
        assert len(tokens) >= 30, f"{what}: test design error, {len(tokens)} draws"
        return
    n = counts.sum()
    big = probs * n >= 5
    obs, exp = list(counts[big].astype(float)), list(probs[big] * n)
    rest_obs, rest_exp = n - sum(obs), n - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    elif obs:  # a tail too small for its own bin joins the smallest bin
        i = int(np.argmin(exp))
        obs[i] += rest_obs
        exp[i] += rest_exp
    assert len(obs) >= 2, f"{what}: test design error, one bin"
    res = stats.chisquare(obs, exp)
    assert res.pvalue > ALPHA, f"{what}: p={res.pvalue:.2e}; obs={obs} exp={np.round(exp, 1)}"


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.0, -1, 1.0, 0.0),
                                                           (0.8, 3, 0.95, MIN_P)])
def test_mtp_rounds_sample_the_target_distribution(model, temperature, top_k, top_p, min_p):
    prompt, later = _prompt()
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                            max_tokens=later + 1, ignore_eos=True)
    reqs = [Request(request_id=f"s{i}", index=i, prompt=None, prompt_ids=list(prompt),
                    params=params, seed=1000 + i) for i in range(N)]
    Engine(model, EngineConfig(max_running_requests=16, dtype="float32", max_model_len=32,
                               enable_prefix_cache=False),
           SpeculativeConfig(algorithm="mtp", num_steps=3)).run(reqs)
    accepted = sum(r.num_accepted_tokens for r in reqs)
    assert accepted > N, f"drafts were accepted {accepted} times in {N} requests"
    outs = np.asarray([r.output_ids for r in reqs])
    cuts = []
    for index in (1, later):
        prefixes, inverse, counts = np.unique(outs[:, :index], axis=0, return_inverse=True,
                                              return_counts=True)
        top = int(np.argmax(counts))
        rows = outs[inverse.reshape(-1) == top, index]
        logits, _ = model.forward(np.asarray([prompt + prefixes[top].tolist()]))
        probs = _filtered(np.asarray(logits)[0, -1], temperature, top_k, top_p, min_p)
        _chisq(rows, probs, f"output index {index} after {prefixes[top].tolist()}")
        no_min_p = _filtered(np.asarray(logits)[0, -1], temperature, top_k, top_p)
        cuts.append(((no_min_p > 0) & (probs == 0)).any())
    assert not min_p or any(cuts), "min_p dropped no id at the tested tokens: test design"
