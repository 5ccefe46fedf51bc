"""Tests for mtp_jax.speculative.accept: greedy verify and exact speculative rejection sampling."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mtp_jax.sampling import SamplingTensors
from mtp_jax.speculative.accept import accept, greedy_accept, rejection_accept

ALPHA = 1e-3  # significance level of every statistical test (fixed seeds => deterministic)

_greedy_jit = jax.jit(greedy_accept)
_accept_jit = jax.jit(accept)
_reject_jit = jax.jit(rejection_accept)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------
def ref_filtered(logits, temperature, top_k, top_p):
    """Float64 filtered distribution from the definition (loops; no near-boundary cases used)."""
    logits = [float(v) for v in logits]
    V = len(logits)
    order = sorted(range(V), key=lambda i: (-logits[i], i))
    if temperature == 0:
        out = [0.0] * V
        out[order[0]] = 1.0
        return np.array(out)
    mx = max(logits)
    w = [math.exp((v - mx) / temperature) for v in logits]
    kk = V if (top_k <= 0 or top_k >= V) else top_k
    kept = order[:kk]
    mass = sum(w[i] for i in kept)
    sel, cum = [], 0.0
    for i in kept:
        sel.append(i)
        cum += w[i] / mass
        if top_p < 1.0:
            assert abs(cum - top_p) > 1e-4, "test design: top_p too close to a cumulative sum"
            if cum >= top_p:
                break
    out = [0.0] * V
    tot = sum(w[i] for i in sel)
    for i in sel:
        out[i] = w[i] / tot
    return np.array(out)


def chisq_tokens(tokens, probs, what):
    """Chi-square goodness of fit of ``tokens`` to ``probs`` (float64).

    Tokens outside the support (probs == 0) must never occur. Bins with expected count < 5 are
    pooled into one bin (standard validity rule).
    """
    tokens = np.asarray(tokens)
    probs = np.asarray(probs, np.float64)
    probs = probs / probs.sum()
    V = probs.shape[0]
    assert tokens.size > 0, f"{what}: no samples"
    assert tokens.min() >= 0 and tokens.max() < V, f"{what}: token ids out of range {tokens}"
    counts = np.bincount(tokens, minlength=V)
    outside = (probs == 0) & (counts > 0)
    assert not outside.any(), (
        f"{what}: tokens outside the support emitted: ids {np.nonzero(outside)[0]}")
    n = counts.sum()
    exp = n * probs
    sup = probs > 0
    big = sup & (exp >= 5)
    small = sup & ~big
    obs_b = list(counts[big])
    exp_b = list(exp[big])
    if small.any():
        obs_b.append(counts[small].sum())
        exp_b.append(exp[small].sum())
    if len(obs_b) < 2:
        return 1.0
    res = stats.chisquare(np.array(obs_b, np.float64), np.array(exp_b, np.float64))
    assert res.pvalue > ALPHA, (
        f"{what}: chi-square p={res.pvalue:.2e} < {ALPHA} (n={n})\n"
        f"counts={counts}\nexpected={exp}")
    return res.pvalue


def softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


V = 6
K = 3
N_TRIALS = 20000
# Context-independent, position-dependent target logits (row j = verify position j).
TARGET = np.array([
    [1.0, 0.5, 0.0, -0.5, 0.8, 0.2],
    [0.0, 1.2, 0.3, 0.35, -0.2, 0.6],
    [0.4, 0.0, 1.0, -0.3, 0.5, 0.1],
    [-0.2, 0.6, 0.1, 0.9, 0.0, 0.45],
], np.float32)
# Draft distributions, deliberately different from the targets (and with mass on tokens that
# filtering removes from the target).
DRAFT_Q = np.array([
    softmax([0.0, 1.0, 0.8, 0.5, -0.5, 0.3]),
    softmax([1.0, 0.0, 0.2, 0.9, 0.4, -0.3]),
    softmax([-0.5, 0.7, 0.0, 1.0, 0.2, 0.6]),
], np.float64)


def _run_case(temperature, top_k, top_p, num_draft, deterministic, seed):
    """Returns (n, emitted, drafts, p [K+1, V] float64) for N_TRIALS independent rows."""
    rng = np.random.default_rng(seed)
    B = N_TRIALS
    if deterministic:  # proposer is a deterministic function of the row: q is one-hot
        drafts = ((np.arange(B)[:, None] * 5 + 3 * np.arange(K)[None, :] + seed) % V)
        draft_probs = None
    else:
        drafts = np.stack([rng.choice(V, size=B, p=DRAFT_Q[j]) for j in range(K)], axis=1)
        draft_probs = jnp.asarray(np.broadcast_to(DRAFT_Q.astype(np.float32), (B, K, V)))
    drafts = jnp.asarray(drafts.astype(np.int32))
    logits = jnp.asarray(np.broadcast_to(TARGET, (B, K + 1, V)))
    params = SamplingTensors(
        temperature=jnp.full((B,), temperature, jnp.float32),
        top_k=jnp.full((B,), top_k, jnp.int32),
        top_p=jnp.full((B,), top_p, jnp.float32),
        seed=jnp.asarray((np.arange(B) + 1000 * seed).astype(np.uint32)),
    )
    step = jnp.full((B,), 17, jnp.int32)
    n, emitted = _accept_jit(logits, drafts, draft_probs, params, step, jnp.asarray(num_draft))
    p = np.stack([ref_filtered(TARGET[j], temperature, top_k, float(np.float32(top_p)))
                  for j in range(K + 1)])
    return np.asarray(n), np.asarray(emitted), np.asarray(drafts), p


def _check_structure(n, emitted, drafts, num_draft):
    B = n.shape[0]
    assert n.dtype == np.int32 and emitted.dtype == np.int32
    assert emitted.shape == (B, K + 1)
    assert (n >= 0).all() and (n <= num_draft).all()
    pos = np.arange(K + 1)[None, :]
    d_ext = np.concatenate([drafts, np.full((B, 1), -1)], axis=1)
    np.testing.assert_array_equal(np.where(pos < n[:, None], emitted, 0),
                                  np.where(pos < n[:, None], d_ext, 0))
    assert (emitted[pos == n[:, None]] >= 0).all()
    assert (emitted[pos > n[:, None]] == -1).all()


def _check_marginals(n, emitted, p, what):
    """Context-independent targets: the token emitted at position j (rows with n >= j) ~ p_j."""
    for j in range(K + 1):
        rows = n >= j
        chisq_tokens(emitted[rows, j], p[j], f"{what}: token at position {j}")


def _check_bonus(n, emitted, num_draft, p, what):
    """Rows that accepted every draft: the bonus at position num_draft ~ p_{num_draft}."""
    for c in range(K + 1):
        rows = (n == num_draft) & (num_draft == c)
        if rows.sum() >= 200:
            chisq_tokens(emitted[rows, c], p[c], f"{what}: bonus at position {c}")


# --------------------------------------------------------------------------------------------
# statistical exactness of rejection sampling
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 4, 0.8)],
                         ids=["unfiltered", "topk4_topp0.8_T0.7"])
def test_rejection_sampling_exact_dense_draft(temperature, top_k, top_p):
    num_draft = np.full(N_TRIALS, K, np.int32)
    n, emitted, drafts, p = _run_case(temperature, top_k, top_p, num_draft, False, seed=1)
    what = f"T={temperature},k={top_k},p={top_p}"
    if top_k > 0:
        assert ((p > 0).sum(-1) < V).all(), "filtering must be active in this case"
    _check_structure(n, emitted, drafts, num_draft)
    _check_marginals(n, emitted, p, what)
    _check_bonus(n, emitted, num_draft, p, what)
    # Residual samples: rows rejected at position j emit a token ~ norm(max(p_j - q_j, 0)).
    for j in range(K):
        rows = n == j
        resid = np.maximum(p[j] - DRAFT_Q[j], 0.0)
        chisq_tokens(emitted[rows, j], resid, f"{what}: residual at position {j}")
    # Number accepted: P(accept at j) = a_j = sum min(p_j, q_j), independently per position.
    a = np.minimum(p[:K], DRAFT_Q).sum(-1)
    pn = np.array([np.prod(a[:j]) * (1 - a[j]) for j in range(K)] + [np.prod(a)])
    chisq_tokens(n, pn, f"{what}: num_accepted")
    # Power check: the draft tokens themselves (~q) must fail the same test against p.
    with pytest.raises(AssertionError):
        chisq_tokens(drafts[:, 0], p[0], "power")


def test_rejection_sampling_exact_deterministic_proposer():
    """draft_probs=None: q_j is one-hot at the draft; drafts include filtered-out tokens."""
    num_draft = np.full(N_TRIALS, K, np.int32)
    n, emitted, drafts, p = _run_case(1.0, 5, 1.0, num_draft, True, seed=2)
    assert ((p > 0).sum(-1) == 5).all()
    _check_structure(n, emitted, drafts, num_draft)
    _check_marginals(n, emitted, p, "one-hot q")
    _check_bonus(n, emitted, num_draft, p, "one-hot q")
    # Acceptance prob of draft d at position 0 is exactly p_0(d); out-of-support drafts never pass.
    for v in range(V):
        rows = drafts[:, 0] == v
        acc = (n[rows] >= 1).astype(np.int64)
        if p[0, v] == 0:
            assert acc.sum() == 0
        else:
            chisq_tokens(acc, [1 - p[0, v], p[0, v]], f"one-hot q: accept rate of token {v}")
        # Residual after rejecting d: p_0 with d removed.
        resid = p[0].copy()
        resid[v] = 0.0
        chisq_tokens(emitted[rows & (n == 0), 0], resid, f"one-hot q: residual after {v}")


def test_rejection_sampling_exact_with_per_row_clamped_k():
    """num_draft in {0..k} per row: truncation keeps every emitted position ~ p_j."""
    rng = np.random.default_rng(3)
    num_draft = rng.integers(0, K + 1, size=N_TRIALS).astype(np.int32)
    n, emitted, drafts, p = _run_case(1.0, -1, 1.0, num_draft, False, seed=3)
    _check_structure(n, emitted, drafts, num_draft)
    _check_marginals(n, emitted, p, "clamped k")
    _check_bonus(n, emitted, num_draft, p, "clamped k")
    # num_draft == 0 is a plain decode step: nothing accepted, token ~ p_0 whatever the draft.
    assert (n[num_draft == 0] == 0).all()


# --------------------------------------------------------------------------------------------
# greedy
# --------------------------------------------------------------------------------------------
def _greedy_setup(seed=0, B=None, k=4, Vg=10):
    rng = np.random.default_rng(seed)
    B = B or (k + 2)
    logits = rng.normal(size=(B, k + 1, Vg)).astype(np.float32)
    top = logits.argmax(-1)
    return rng, logits, top


def test_greedy_accept_every_prefix_length():
    k, Vg = 4, 10
    rng, logits, top = _greedy_setup(k=k, Vg=Vg)
    B = logits.shape[0]
    drafts = np.empty((B, k), np.int32)
    expect_n = np.empty(B, np.int32)
    for b in range(B):  # row b: right for j = min(b, k) positions, then wrong
        j = min(b, k)
        expect_n[b] = j
        for i in range(k):
            if i < j:
                drafts[b, i] = top[b, i]
            else:
                drafts[b, i] = (top[b, i] + 1 + rng.integers(0, Vg - 1)) % Vg  # anything else
                if i > j:  # after the first miss, sometimes put correct tokens back
                    drafts[b, i] = top[b, i] if rng.random() < 0.5 else drafts[b, i]
    n, emitted = _greedy_jit(jnp.asarray(logits), jnp.asarray(drafts))
    n, emitted = np.asarray(n), np.asarray(emitted)
    np.testing.assert_array_equal(n, expect_n)
    for b in range(B):
        j = expect_n[b]
        want = list(drafts[b, :j]) + [top[b, j]] + [-1] * (k - j)
        np.testing.assert_array_equal(emitted[b], want)
    assert n.dtype == np.int32 and emitted.dtype == np.int32


def test_greedy_accept_all_right_all_wrong_ties_and_invalid():
    k, Vg = 3, 5
    logits = np.zeros((4, k + 1, Vg), np.float32)
    logits[:, :, 2] = 1.0
    logits[:, :, 4] = 1.0  # tie at the max: argmax is 2
    all_right = [2, 2, 2]
    all_wrong = [0, 1, 3]
    tie_other = [2, 4, 2]  # the other tied index is not the argmax -> rejected at 1
    invalid = [-1, 2, 2]
    drafts = np.array([all_right, all_wrong, tie_other, invalid], np.int32)
    n, emitted = _greedy_jit(jnp.asarray(logits), jnp.asarray(drafts))
    np.testing.assert_array_equal(n, [3, 0, 1, 0])
    np.testing.assert_array_equal(emitted, [[2, 2, 2, 2], [2, -1, -1, -1],
                                            [2, 2, -1, -1], [2, -1, -1, -1]])
    # Per-row clamp: all drafts right, but only num_draft are considered.
    n, emitted = greedy_accept(jnp.asarray(logits), jnp.asarray(np.array([all_right] * 4)),
                               num_draft=jnp.array([0, 1, 2, 3]))
    np.testing.assert_array_equal(n, [0, 1, 2, 3])
    np.testing.assert_array_equal(emitted, [[2, -1, -1, -1], [2, 2, -1, -1],
                                            [2, 2, 2, -1], [2, 2, 2, 2]])


def test_greedy_rows_in_mixed_batch_match_greedy_accept_and_ignore_rng():
    k, Vg, B = 4, 10, 12
    rng, logits, top = _greedy_setup(seed=5, B=B, k=k, Vg=Vg)
    # Drafts right with prob ~0.6 per position so all prefix lengths occur.
    drafts = np.where(rng.random((B, k)) < 0.6, top[:, :k], rng.integers(0, Vg, (B, k)))
    drafts = drafts.astype(np.int32)
    q = rng.dirichlet(np.ones(Vg), size=(B, k)).astype(np.float32)
    greedy = np.arange(B) % 3 == 0

    def params(seed_offset):
        return SamplingTensors.from_params(
            [(0.0 if greedy[b] else 0.9, -1 if b % 2 else 6, 1.0 if b % 4 else 0.9,
              b + seed_offset) for b in range(B)])

    args = (jnp.asarray(logits), jnp.asarray(drafts))
    ng, eg = (np.asarray(x) for x in _greedy_jit(*args))
    step = jnp.full((B,), 5, jnp.int32)
    outs = []
    for fn in (_accept_jit, _reject_jit):
        for so, st in ((0, step), (0, step), (99, step), (0, step + 1)):
            for dp in (jnp.asarray(q), None):
                n, e = (np.asarray(x) for x in fn(*args, dp, params(so), st))
                np.testing.assert_array_equal(n[greedy], ng[greedy])
                np.testing.assert_array_equal(e[greedy], eg[greedy])
                outs.append((fn, so, int(st[0]), dp is None, n, e))
    # Same seed/step -> identical; different seed or step -> sampled rows differ.
    by = {}
    for fn, so, st0, none, n, e in outs:
        key = (fn is _accept_jit, so, st0, none)
        if key in by:
            np.testing.assert_array_equal(by[key][1], e)
        by[key] = (n, e)
    for acc in (True, False):
        for none in (True, False):
            base = by[(acc, 0, 5, none)][1][~greedy]
            assert (by[(acc, 99, 5, none)][1][~greedy] != base).any()
            assert (by[(acc, 0, 6, none)][1][~greedy] != base).any()
            # accept() and rejection_accept() agree exactly on mixed batches.
            np.testing.assert_array_equal(by[(True, 0, 5, none)][1], by[(False, 0, 5, none)][1])


def test_all_greedy_batch_fast_path():
    k, Vg, B = 2, 7, 5
    rng, logits, top = _greedy_setup(seed=6, B=B, k=k, Vg=Vg)
    drafts = jnp.asarray(top[:, :k].astype(np.int32))
    n, e = _accept_jit(jnp.asarray(logits), drafts, None, SamplingTensors.greedy(B),
                       jnp.zeros(B, jnp.int32))
    ng, eg = _greedy_jit(jnp.asarray(logits), drafts)
    np.testing.assert_array_equal(n, ng)
    np.testing.assert_array_equal(e, eg)
    np.testing.assert_array_equal(n, [k] * B)


def test_k_zero_is_plain_decode():
    B, Vg = 6, 9
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(B, 1, Vg)).astype(np.float32))
    params = SamplingTensors.from_params([(0.0 if b < 3 else 1.0, 3, 1.0, b) for b in range(B)])
    n, e = accept(logits, jnp.zeros((B, 0), jnp.int32), None, params, jnp.zeros(B, jnp.int32))
    assert n.shape == (B,) and e.shape == (B, 1)
    np.testing.assert_array_equal(n, 0)
    top = np.asarray(logits)[:, 0].argmax(-1)
    np.testing.assert_array_equal(np.asarray(e)[:3, 0], top[:3])
    top3 = np.argsort(-np.asarray(logits)[:, 0], axis=-1, kind="stable")[:, :3]
    for b in range(3, B):
        assert int(e[b, 0]) in top3[b]


def test_shape_errors():
    logits = jnp.zeros((2, 4, 5))
    params = SamplingTensors.greedy(2)
    step = jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_accept(logits, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        greedy_accept(logits, jnp.zeros((2, 3), jnp.float32))
    with pytest.raises(ValueError, match="draft_probs"):
        accept(logits, jnp.zeros((2, 3), jnp.int32), jnp.zeros((2, 3, 6)), params, step)
    with pytest.raises(ValueError, match="target_logits"):
        rejection_accept(logits[0], jnp.zeros((2, 3), jnp.int32), None, params, step)
    with pytest.raises(ValueError, match="step"):
        rejection_accept(logits, jnp.zeros((2, 3), jnp.int32), None, params, step[:1])
    with pytest.raises(ValueError, match="num_draft"):
        accept(logits, jnp.zeros((2, 3), jnp.int32), None, params, step, jnp.zeros(3, jnp.int32))
