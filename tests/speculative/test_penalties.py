"""Presence and frequency penalties (``SamplingParams.presence_penalty`` /
``frequency_penalty``) in the engine, against a float64 numpy re-derivation: greedy decoding
where each step takes ``argmax(x - f * c - p * (c > 0))`` over the research forward's logits
(``c``: the output's counts so far). Plain decoding, MTP rounds with the trained fixture's head
(drafts accepted) and an external proposer that drafts the reference's own tokens (every draft
accepted) reproduce it, in batches mixing penalised and unpenalised requests and reusing slots;
penalised sampling follows the penalised distribution (chi-square)."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.sampling import SamplingTensors
from mtp_jax.sampling.penalties import (add_tokens, draft_penalty, first_counts,
                                        verify_penalties)
from mtp_jax.train.synthetic import motif_prompts
from tests.helpers.paths import fixture_path
from tests.speculative.test_mtp_sampling import _chisq

K = 3
NEW = 16
LEN = 48  # the reference's fixed forward length (one compile)
PENALTIES = [(0.0, 0.0), (1.5, 0.0), (0.0, 0.8), (0.6, 0.6), (-1.0, 0.0), (-0.5, -0.5)]


@pytest.fixture(scope="module")
def trained():
    return load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)


def _logits(model, ids):
    """float64 logits after ``ids`` (the research forward, padded to :data:`LEN`)."""
    x = np.zeros((1, LEN), np.int64)
    x[0, :len(ids)] = ids
    return np.asarray(model.forward(x)[0], np.float64)[0, len(ids) - 1]


def reference(model, prompt, pres, freq, n=NEW):
    """Greedy decoding with the penalties, step by step from the definition."""
    out = []
    for _ in range(n):
        x = _logits(model, prompt + out)
        c = np.bincount(np.asarray(out, np.int64), minlength=len(x)).astype(np.float64)
        out.append(int(np.argmax(x - freq * c - pres * (c > 0))))
    return out


def _cases(model, prompts, penalties):
    """``(requests, expected outputs)``; test design: some penalty changes the output."""
    want = [reference(model, p, *pen) for p, pen in zip(prompts, penalties)]
    changed = sum(w != reference(model, p, 0.0, 0.0) for w, p, pen in
                  zip(want, prompts, penalties) if pen != (0.0, 0.0))
    assert changed >= 2, f"test design: the penalties change {changed} greedy outputs"
    reqs = [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=list(p),
                    params=SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True,
                                          presence_penalty=pres, frequency_penalty=freq),
                    seed=i)
            for i, (p, (pres, freq)) in enumerate(zip(prompts, penalties))]
    return reqs, want


def _engine(model, algo, proposer=None, running=2, **cfg):
    cfg = {"enable_prefix_cache": False, **cfg}
    return Engine(model, EngineConfig(max_running_requests=running, dtype="float32",
                                      max_model_len=64, page_size=4, **cfg),
                  SpeculativeConfig(algorithm=algo, num_steps=K), proposer=proposer)


@pytest.mark.parametrize("fixture,algo", [("tiny_dense", "none"), ("tiny_dense", "external"),
                                          ("tiny_qwen4_exp", "external")])
def test_greedy_penalties_equal_the_reference(fixture, algo):
    """Two slots for six requests (slots reused after penalised ones), small prefill chunks;
    the external proposer drafts the reference's own next tokens, so every draft of every
    round but the last is accepted: the verify rows' penalties count the drafts before them."""
    model = load_model(fixture_path(fixture), "float32")
    prompts = motif_prompts(len(PENALTIES), seed=11, min_len=6, max_len=16)
    reqs, want = _cases(model, prompts, PENALTIES)
    by_id = {r.request_id: r.prompt_ids + w for r, w in zip(reqs, want)}

    def proposer(request_id, ids, k):
        full = by_id[request_id]
        return (full[len(ids):len(ids) + k] + [0] * k)[:k]

    eng = _engine(model, algo, proposer if algo == "external" else None,
                  chunked_prefill_size=8, enable_prefix_cache=algo == "external")
    done = eng.run(reqs)
    assert [r.output_ids for r in done] == want
    if algo == "external":  # every round accepts all its drafts: (NEW - 1) / (K + 1) rounds
        rounds = -(-(NEW - 1) // (K + 1))
        assert [r.num_accepted_tokens for r in done] == [NEW - 1 - rounds] * len(done)


def test_mtp_drafts_follow_the_penalties(trained):
    """With the trained head drafting (its drafts penalised as the target's rows are), the
    outputs equal the reference on two prompts where the penalty changes the greedy text,
    and drafts are accepted."""
    pool = motif_prompts(60, seed=11, min_len=6, max_len=16)
    prompts = [pool[16], pool[54], pool[1]]
    penalties = [(2.0, 0.0), (1.0, 1.0), (0.0, 0.0)]
    reqs, want = _cases(trained, prompts, penalties)
    done = _engine(trained, "mtp", enable_prefix_cache=True).run(reqs)
    assert [r.output_ids for r in done] == want
    assert sum(r.num_accepted_tokens for r in done) >= 4


def test_verify_rows_count_the_drafts_before_them():
    """float64 check of one verify: row j is penalised over the slot's counts plus drafts
    d_1..d_j; the commit adds the emitted tokens; a final prefill row resets its slot."""
    rng = np.random.default_rng(0)
    v, k = 9, 3
    logits = rng.normal(size=(2, k + 1, v)).astype(np.float32)
    counts = np.zeros((3, v), np.int32)
    counts[1, [2, 5, 5]] = [1, 1, 1]
    counts[1, 5] = 2
    drafts = np.array([[5, 7, 7], [0, 1, 2]], np.int32)
    rows = SamplingTensors.from_params([(0.0, -1, 1.0, 0, 0.0, 0.5, 0.25),
                                        (0.0, -1, 1.0, 0, 0.0, 0.0, 0.0)], host=True)
    got = np.asarray(verify_penalties(logits, counts[[1, 2]], drafts, rows))
    for j in range(k + 1):
        c = counts[1].astype(np.float64) + np.bincount(drafts[0, :j], minlength=v)
        np.testing.assert_allclose(got[0, j], logits[0, j] - 0.25 * c - 0.5 * (c > 0),
                                   rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[1], logits[1])  # penalties off: unchanged
    emitted = np.array([[5, 7, -1, -1], [3, -1, -1, -1]], np.int32)
    after = np.asarray(add_tokens(jnp.asarray(counts), np.array([1, 0]), emitted,
                                  np.array([[True] * 4, [False] * 4]) & (emitted >= 0)))
    want = counts.copy()
    want[1, 5] += 1
    want[1, 7] += 1
    np.testing.assert_array_equal(after, want)  # the padding row (slot 0, not live) adds none
    reset = np.asarray(first_counts(jnp.asarray(after), np.array([1, 2]), np.array([4, 6]),
                                    np.array([True, False])))
    np.testing.assert_array_equal(reset[1], np.eye(v, dtype=np.int32)[4])
    np.testing.assert_array_equal(reset[2], after[2])


class _FixedDraft:
    """A stand-in model whose MTP step keeps its hidden and whose draft logits are always
    ``LOGITS`` (over ``hot`` ids when given): the draft chain's choices are then its penalties'
    alone."""

    LOGITS = np.array([3.0, 2.9, 2.5, 0.0, 2.0, -1.0], np.float32)

    def __init__(self, hot=None):
        self.hot = None if hot is None else jnp.asarray(hot, jnp.int32)
        self.cfg = type("Cfg", (), {"vocab_size": 6})()
        self.embed_tokens = None

    def mtp(self, embed, z, tokens, batch, kv, step=0):
        return z, kv

    def draft_logits(self, z):
        cols = self.LOGITS if self.hot is None else self.LOGITS[np.asarray(self.hot)]
        return jnp.broadcast_to(jnp.asarray(cols), (z.shape[0], len(cols))), self.hot

    def draft_greedy(self, z):
        return jnp.full((z.shape[0],), int(np.argmax(self.LOGITS)), jnp.int32)


@pytest.mark.parametrize("hot", [None, [0, 1, 2, 4]])
def test_draft_chain_penalises_each_draft_over_the_ones_before_it(hot):
    from mtp_jax.speculative.mtp import chain_drafts, draft_token

    model, k = _FixedDraft(hot), 4
    counts = jnp.asarray([[0, 0, 1, 0, 0, 0]], jnp.int32)  # id 2 is in the output already
    rows = SamplingTensors.from_params([(0.0, -1, 1.0, 0, 0.0, 0.2, 0.3)])
    z, limit = jnp.zeros((1, 2)), jnp.asarray([0])
    got = []
    for greedy_only in (True, False):
        pen = draft_penalty(counts, [], rows)
        tok, q = draft_token(model, z, rows, jnp.zeros(1, jnp.int32), 0, greedy_only, None,
                             pen)
        drafts, _, _ = chain_drafts(model, None, z, tok, q, jnp.zeros(1, jnp.int32), None,
                                    limit, rows, jnp.zeros(1, jnp.int32), k, greedy_only,
                                    None, counts)
        got.append(np.asarray(drafts)[0].tolist())
    ids = np.arange(6) if hot is None else np.asarray(hot)
    c, want = np.asarray(counts[0], np.float64), []
    for _ in range(k):  # float64: argmax over the (hot) ids of x - f c - p (c > 0)
        x = _FixedDraft.LOGITS.astype(np.float64) - 0.3 * c - 0.2 * (c > 0)
        want.append(int(ids[np.argmax(x[ids])]))
        c[want[-1]] += 1
    assert got == [want, want] and len(set(want)) > 1, (got, want)


@pytest.mark.parametrize("bad", [2.5, -2.01, float("nan"), "1", None])
def test_bad_penalties_are_refused_naming_them(bad):
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match=rf"{name} .* must be a number in \[-2, 2\]"):
            SamplingParams(**{name: bad})


def test_sampled_rounds_follow_the_penalised_distribution(trained):
    """400 seeded MTP requests at temperature 3 with both penalties, on a prompt whose greedy
    output repeats its first token: the token at output index 1, after the most common first
    token, follows ``softmax((x - f c - p (c > 0)) / T)`` (chi-square)."""
    n, temp, pres, freq = 400, 3.0, 1.5, 0.5
    prompt = motif_prompts(1, seed=11, min_len=6, max_len=16)[0]
    assert reference(trained, prompt, 0.0, 0.0, n=2)[:1] * 2 == reference(
        trained, prompt, 0.0, 0.0, n=2), "test design: the greedy output does not repeat"
    params = SamplingParams(temperature=temp, max_tokens=6, ignore_eos=True,
                            presence_penalty=pres, frequency_penalty=freq)
    reqs = [Request(request_id=f"s{i}", index=i, prompt=None, prompt_ids=list(prompt),
                    params=params, seed=500 + i) for i in range(n)]
    _engine(trained, "mtp", running=16).run(reqs)
    assert sum(r.num_accepted_tokens for r in reqs) > n // 4, "drafts were hardly accepted"
    outs = np.asarray([r.output_ids for r in reqs])
    first = int(np.bincount(outs[:, 0]).argmax())
    got = outs[outs[:, 0] == first, 1]
    x = _logits(trained, list(prompt) + [first])
    c = np.bincount([first], minlength=len(x)).astype(np.float64)
    softmax = lambda z: np.exp(z - z.max()) / np.exp(z - z.max()).sum()  # noqa: E731
    p = softmax((x - freq * c - pres * (c > 0)) / temp)
    assert np.abs(p - softmax(x / temp)).max() > 0.05, "test design: the penalties barely act"
    assert len(got) >= 50, len(got)
    _chisq(got, p, f"output index 1 after {first}")
