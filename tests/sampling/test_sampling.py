"""Tests for mtp_jax.sampling: the filtered distribution, sampling, keys and parameter validation."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mtp_jax.sampling import (
    SALT_ACCEPT,
    SALT_SAMPLE,
    SamplingTensors,
    filtered_probs,
    row_keys,
    sample,
)

ALPHA = 1e-3  # significance level of every statistical test (fixed seeds => deterministic)

_filtered_jit = jax.jit(filtered_probs)
_sample_jit = jax.jit(sample)


# --------------------------------------------------------------------------------------------
# Independent float64 reference, written from the definition with explicit loops.
# --------------------------------------------------------------------------------------------
def reference_filtered(logits, temperature, top_k, top_p, tol=1e-5):
    """All acceptable filtered distributions (float64) for one row.

    Returns a list of candidate probability vectors: normally one; two when a top-p cumulative sum
    lands within ``tol`` of ``top_p`` (float32 rounding may legitimately go either way there).
    """
    logits = [float(v) for v in logits]
    V = len(logits)
    if temperature == 0:
        best = 0
        for i in range(1, V):
            if logits[i] > logits[best]:
                best = i
        out = [0.0] * V
        out[best] = 1.0
        return [out]
    # Rank: logit descending, then index ascending.
    order = sorted(range(V), key=lambda i: (-logits[i], i))
    mx = max(logits)
    w = [math.exp((v - mx) / temperature) if v != -math.inf else 0.0 for v in logits]
    kk = V if (top_k <= 0 or top_k >= V) else top_k
    kept = order[:kk]
    mass = 0.0
    for i in kept:
        mass += w[i]
    candidates_len = []
    if top_p >= 1.0:
        candidates_len.append(len(kept))
    else:
        cum = 0.0
        n = 0
        for i in kept:
            cum += w[i] / mass
            n += 1
            if abs(cum - top_p) < tol and n < len(kept):
                candidates_len.append(n)       # crossing counted here...
                candidates_len.append(n + 1)   # ...or just after (rounding)
                break
            if cum >= top_p:
                candidates_len.append(n)
                break
        else:
            candidates_len.append(len(kept))
    outs = []
    for n in candidates_len:
        sel = kept[:n]
        tot = 0.0
        for i in sel:
            tot += w[i]
        out = [0.0] * V
        for i in sel:
            out[i] = w[i] / tot
        outs.append(out)
    return outs


def assert_matches_reference(got_row, logits_row, t, k, p, where=""):
    cands = reference_filtered(logits_row, t, k, p)
    errs = [float(np.max(np.abs(np.asarray(c) - got_row))) for c in cands]
    # Values close; tokens outside the reference support are exactly 0, and tokens inside it are
    # > 0 unless their float64 probability is below float32's range (underflow is allowed).
    def same_support(c):
        c = np.asarray(c)
        return not (got_row[c == 0] != 0).any() and not (got_row[c > 1e-30] == 0).any()

    ok = any(e < 2e-6 + 1e-5 * float(np.max(c)) and same_support(c) for e, c in zip(errs, cands))
    assert ok, (f"{where}: filtered_probs mismatch for T={t} top_k={k} top_p={p}\n"
                f"logits={np.asarray(logits_row)}\ngot={got_row}\nref={np.asarray(cands)}")


TEMPS = [0.0, 0.05, 0.5, 1.0, 2.0]
TOPKS = [-1, 0, 1, 2, 5, 32, 40]
TOPPS = [1.0, 0.999, 0.9, 0.5, 1e-6]


def _combo_batch(logits_fn, seed):
    combos = list(itertools.product(TEMPS, TOPKS, TOPPS))
    rng = np.random.default_rng(seed)
    logits = np.stack([logits_fn(rng) for _ in combos]).astype(np.float32)
    t = np.array([c[0] for c in combos], np.float32)
    k = np.array([c[1] for c in combos], np.int32)
    p = np.array([c[2] for c in combos], np.float32)
    return combos, logits, t, k, p


def test_filtered_probs_random_logits_match_reference():
    V = 32

    def gen(rng):
        x = rng.normal(size=V) * rng.choice([0.5, 2.0, 6.0])
        if rng.random() < 0.3:  # some masked-out vocabulary entries
            x[rng.choice(V, size=4, replace=False)] = -np.inf
        return x

    combos, logits, t, k, p = _combo_batch(gen, 0)
    got = np.asarray(_filtered_jit(logits, t, k, p))
    assert got.dtype == np.float32 and got.shape == logits.shape
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
    for i, (ti, ki, pi) in enumerate(combos):
        assert_matches_reference(got[i], logits[i], ti, ki, float(np.float32(pi)), f"row {i}")


def test_filtered_probs_ties_match_reference():
    V = 32

    def gen(rng):  # many exact ties
        return rng.integers(0, 4, size=V).astype(np.float64) * rng.choice([0.25, 1.0])

    combos, logits, t, k, p = _combo_batch(gen, 1)
    got = np.asarray(_filtered_jit(logits, t, k, p))
    for i, (ti, ki, pi) in enumerate(combos):
        assert_matches_reference(got[i], logits[i], ti, ki, float(np.float32(pi)), f"row {i}")


def test_ties_resolved_by_lowest_index():
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 3.0, -1.0]] * 4, np.float32)
    t = np.array([0.0, 1.0, 1.0, 1.0], np.float32)
    k = np.array([-1, 1, 2, -1], np.int32)
    p = np.array([1.0, 1.0, 1.0, 0.3], np.float32)
    got = np.asarray(_filtered_jit(logits, t, k, p))
    np.testing.assert_array_equal(got[0], [0, 1, 0, 0, 0, 0])  # greedy == jnp.argmax
    np.testing.assert_array_equal(got[1], [0, 1, 0, 0, 0, 0])  # top_k=1 == argmax
    np.testing.assert_allclose(got[2], [0, 0.5, 0, 0.5, 0, 0], atol=1e-7)
    # top_p 0.3: the first of the three tied maxima (~0.31 each) already crosses 0.3.
    np.testing.assert_array_equal(got[3], [0, 1, 0, 0, 0, 0])
    assert int(jnp.argmax(logits[0])) == 1


def test_greedy_is_onehot_argmax_and_filtering_off_is_softmax():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(8, 50)).astype(np.float32)
    logits[0, 7] = logits[0, 3] = logits[0].max() + 1.0  # tie at the max: index 3 wins
    zeros = np.zeros(8, np.float32)
    got = np.asarray(_filtered_jit(logits, zeros, np.full(8, 5, np.int32), zeros + 0.5))
    np.testing.assert_array_equal(got, np.eye(50, dtype=np.float32)[np.argmax(logits, -1)])
    assert got[0, 3] == 1.0
    got = np.asarray(_filtered_jit(logits, zeros + 1.0, np.full(8, -1, np.int32), zeros + 1.0))
    ref = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(got, ref / ref.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_params_broadcast_over_leading_dims_from_the_left():
    rng = np.random.default_rng(4)
    B, S, V = 4, 3, 16
    logits = rng.normal(size=(B, S, V)).astype(np.float32)
    t = np.array([0.0, 0.7, 1.0, 1.5], np.float32)
    k = np.array([-1, 3, 8, -1], np.int32)
    p = np.array([1.0, 1.0, 0.6, 0.8], np.float32)
    got = np.asarray(filtered_probs(logits, t, k, p))
    assert got.shape == (B, S, V)
    for b in range(B):
        for s in range(S):
            assert_matches_reference(got[b, s], logits[b, s], float(t[b]), int(k[b]),
                                     float(p[b]), f"[{b},{s}]")
    # Scalars broadcast everywhere.
    got_s = np.asarray(filtered_probs(logits, 0.7, 3, 1.0))
    np.testing.assert_allclose(got_s[1], got[1], atol=1e-7)


def test_filtered_probs_shape_errors():
    logits = jnp.zeros((4, 10))
    with pytest.raises(ValueError, match="temperature"):
        filtered_probs(logits, jnp.ones(3), -1, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        filtered_probs(logits, 1.0, jnp.ones((4, 2), jnp.int32), 1.0)
    with pytest.raises(ValueError, match="logits"):
        filtered_probs(jnp.zeros(()), 1.0, -1, 1.0)


# --------------------------------------------------------------------------------------------
# sample()
# --------------------------------------------------------------------------------------------
def _chisq_tokens(tokens, probs, what):
    """Chi-square goodness of fit of integer tokens to ``probs`` (float64); support checked exactly."""
    tokens = np.asarray(tokens)
    probs = np.asarray(probs, np.float64)
    V = probs.shape[0]
    counts = np.bincount(tokens, minlength=V)
    assert counts.shape[0] == V, f"{what}: token id out of range"
    outside = (probs == 0) & (counts > 0)
    assert not outside.any(), f"{what}: tokens outside the support drawn: {np.nonzero(outside)}"
    sup = probs > 0
    n = counts.sum()
    exp = n * probs[sup] / probs[sup].sum()
    assert exp.min() >= 5, f"{what}: test design error, expected count {exp.min()} < 5"
    if sup.sum() == 1:
        return 1.0
    res = stats.chisquare(counts[sup], exp)
    assert res.pvalue > ALPHA, (
        f"{what}: chi-square p={res.pvalue:.2e} < {ALPHA}; counts={counts} expected~{n * probs}")
    return res.pvalue


def test_sample_distribution_matches_filtered_probs():
    B, V = 20000, 8
    logits_row = np.array([2.0, 1.0, 0.5, 0.0, 1.5, -1.0, 0.7, 0.2], np.float32)
    logits = np.broadcast_to(logits_row, (B, V))
    # Half the rows: T=0.8 + top_k 5 + top_p 0.85; other half: plain T=1.3.
    half = B // 2
    params = SamplingTensors(
        temperature=jnp.asarray(np.r_[np.full(half, 0.8), np.full(half, 1.3)].astype(np.float32)),
        top_k=jnp.asarray(np.r_[np.full(half, 5), np.full(half, -1)].astype(np.int32)),
        top_p=jnp.asarray(np.r_[np.full(half, 0.85), np.full(half, 1.0)].astype(np.float32)),
        seed=jnp.arange(B, dtype=jnp.uint32),
    )
    tok = np.asarray(_sample_jit(logits, params, jnp.full((B,), 11, jnp.int32)))
    assert tok.dtype == np.int32
    p_filt = reference_filtered(logits_row, 0.8, 5, float(np.float32(0.85)))[0]
    assert sum(x > 0 for x in p_filt) == 4  # top_p actually removed a token inside the top-5
    _chisq_tokens(tok[:half], p_filt, "sample filtered")
    _chisq_tokens(tok[half:], reference_filtered(logits_row, 1.3, -1, 1.0)[0], "sample T=1.3")
    # Power check: the unfiltered distribution must be rejected by the same test.
    with pytest.raises(AssertionError):
        _chisq_tokens(tok[half:], reference_filtered(logits_row, 0.8, 5, 0.85)[0], "power")


def test_sample_reproducible_and_greedy_ignores_seed():
    B, V = 16, 40
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(B, V)).astype(np.float32))
    rows = [(1.0 if b % 2 else 0.0, -1, 1.0, 1000 + b) for b in range(B)]
    params = SamplingTensors.from_params(rows)
    step = jnp.full((B,), 3, jnp.int32)
    a = np.asarray(_sample_jit(logits, params, step))
    b_ = np.asarray(_sample_jit(logits, params, step))
    np.testing.assert_array_equal(a, b_)
    greedy = np.arange(B) % 2 == 0
    np.testing.assert_array_equal(a[greedy], np.argmax(np.asarray(logits), -1)[greedy])
    # Different seeds (and different steps) -> different draws for sampled rows; greedy unchanged.
    params2 = SamplingTensors.from_params([(t, k, p, s + 777) for t, k, p, s in rows])
    c = np.asarray(_sample_jit(logits, params2, step))
    d = np.asarray(_sample_jit(logits, params, step + 1))
    np.testing.assert_array_equal(c[greedy], a[greedy])
    np.testing.assert_array_equal(d[greedy], a[greedy])
    assert (c[~greedy] != a[~greedy]).any()
    assert (d[~greedy] != a[~greedy]).any()
    # A row's draw depends only on (its logits, params, seed, step), not on the rest of the batch.
    perm = np.roll(np.arange(B), 3)
    params_p = jax.tree_util.tree_map(lambda x: x[perm], params)
    e = np.asarray(_sample_jit(logits[perm], params_p, step))
    np.testing.assert_array_equal(e, a[perm])


def test_sample_all_greedy_fast_path_and_shape_errors():
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(5, 9)).astype(np.float32))
    params = SamplingTensors.greedy(5)
    tok = _sample_jit(logits, params, jnp.zeros(5, jnp.int32))
    np.testing.assert_array_equal(tok, np.argmax(np.asarray(logits), -1))
    with pytest.raises(ValueError, match="B=5"):
        sample(logits, SamplingTensors.greedy(4), jnp.zeros(5, jnp.int32))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample(logits[None], params, jnp.zeros(5, jnp.int32))


# --------------------------------------------------------------------------------------------
# keys and parameters
# --------------------------------------------------------------------------------------------
def test_row_keys_separate_salts_seeds_steps():
    seed = jnp.array([1, 1, 2], jnp.uint32)
    step = jnp.array([0, 1, 0], jnp.int32)
    k0 = jax.random.key_data(row_keys(seed, step, SALT_SAMPLE))
    k1 = jax.random.key_data(row_keys(seed, step, SALT_ACCEPT))
    assert k0.shape[0] == 3
    rows = {tuple(np.asarray(r).tolist()) for r in list(k0) + list(k1)}
    assert len(rows) == 6
    np.testing.assert_array_equal(k0, jax.random.key_data(row_keys(seed, step, SALT_SAMPLE)))
    # int32 seeds are reinterpreted as uint32 bits.
    k_i = jax.random.key_data(row_keys(jnp.array([-1], jnp.int32), jnp.array([0]), 0))
    k_u = jax.random.key_data(row_keys(jnp.array([2**32 - 1], jnp.uint32), jnp.array([0]), 0))
    np.testing.assert_array_equal(k_i, k_u)
    with pytest.raises(ValueError, match="seed and step"):
        row_keys(seed, step[:2], 0)


def test_sampling_tensors_from_params_and_pytree():
    st = SamplingTensors.from_params([(0.7, 20, 0.9, 5), (0, -1, 1.0, 2**32 - 1)], pad_to=4)
    assert st.temperature.dtype == jnp.float32 and st.top_k.dtype == jnp.int32
    assert st.top_p.dtype == jnp.float32 and st.seed.dtype == jnp.uint32
    np.testing.assert_array_equal(st.top_k, [20, -1, -1, -1])
    np.testing.assert_array_equal(st.is_greedy, [False, True, True, True])
    leaves, treedef = jax.tree_util.tree_flatten(st)
    assert len(leaves) == 7  # min_p and the two penalties: off (0) in 4-tuples and padding
    np.testing.assert_array_equal(st.min_p, 0)
    np.testing.assert_array_equal(st.presence_penalty, 0)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    for name in ("temperature", "top_k", "top_p", "seed"):
        np.testing.assert_array_equal(getattr(back, name), getattr(st, name))
    # Usable as a jit argument (a pytree of arrays, no static fields).
    assert int(jax.jit(lambda s: jnp.sum(s.top_k))(st)) == 20 - 3
    assert st.batch_size == 4


@pytest.mark.parametrize("row,match", [
    ((-0.1, -1, 1.0, 0), "temperature"),
    ((float("nan"), -1, 1.0, 0), "temperature"),
    ((1.0, 2.5, 1.0, 0), "top_k"),
    ((1.0, -1, 0.0, 0), "top_p"),
    ((1.0, -1, 1.5, 0), "top_p"),
    ((1.0, -1, 1.0, -3), "seed"),
    ((1.0, -1, 1.0, 2**32), "seed"),
    ((1.0, -1, 1.0), "tuple of 4 to 7 values"),
    ((1.0, -1, 1.0, 0, 0.0, 0.0, 0.0, 1), "tuple of 4 to 7 values"),
    (3.0, "tuple of 4 to 7 values"),
])
def test_sampling_tensors_validation(row, match):
    with pytest.raises(ValueError, match=match):
        SamplingTensors.from_params([row])


def test_sampling_tensors_top_k_beyond_int32_is_off_and_huge_temperature_refused():
    st = SamplingTensors.from_params([(1.0, 2**31, 1.0, 0), (1.0, 10**12, 1.0, 0),
                                      (1.0, 2**31 - 1, 1.0, 0), (1.0, 5, 1.0, 0)])
    np.testing.assert_array_equal(np.asarray(st.top_k), [-1, -1, 2**31 - 1, 5])
    with pytest.raises(ValueError, match="temperature"):
        SamplingTensors.from_params([(1e39, -1, 1.0, 0)])


def test_sampling_tensors_pad_too_small():
    with pytest.raises(ValueError, match="pad_to"):
        SamplingTensors.from_params([(0, -1, 1.0, 0)] * 3, pad_to=2)
