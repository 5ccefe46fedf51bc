"""min-p (``SamplingParams.min_p``): the filtered distribution against a float64 re-derivation
from the definition (keep ``p_i >= min_p * p_max`` of the temperature-scaled softmax, after
top-k / top-p, renormalised), draws against it (chi-square), logprobs, the static
``filtering`` flag and the checks of the value; the server's and the CLI's min-p and
penalty fields (the penalties' engine tests: tests/speculative/test_penalties.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from mtp_jax.sampling import SamplingParams, SamplingTensors, filtered_logprobs, filtered_probs
from mtp_jax.sampling import sample
from tests.sampling.test_sampling import reference_filtered

V = 32
MIN_PS = [0.0, 1e-3, 0.05, 0.3, 0.9, 1.0]
TEMPS = [0.0, 0.5, 1.0, 2.0]
TOPKS = [-1, 3, 20]
TOPPS = [1.0, 0.9, 0.5]


def reference_min_p(logits, temperature, top_k, top_p, min_p):
    """float64: the top-k / top-p distribution (``reference_filtered``, first candidate) with
    the ids below ``min_p`` times the most likely probability dropped, renormalised; and
    whether some id lies within 1e-6 of the min-p boundary (float32 may round it either way)."""
    base = np.asarray(reference_filtered(logits, temperature, top_k, top_p)[0])
    if temperature == 0 or min_p <= 0:
        return base, False
    x = np.asarray(logits, np.float64)
    ratio = np.exp((x - x.max()) / temperature)  # p_i / p_max of the unfiltered softmax
    near = bool(np.any((np.abs(ratio - min_p) < 1e-6 * min_p + 1e-12) & (x < x.max())))
    kept = np.where(ratio >= min_p, base, 0.0)
    return kept / kept.sum(), near


def _rows(seed):
    rng = np.random.default_rng(seed)
    combos = [(t, k, p, m) for t in TEMPS for k in TOPKS for p in TOPPS for m in MIN_PS]
    logits = np.stack([rng.normal(size=V) * rng.choice([0.5, 2.0, 5.0]) for _ in combos])
    return combos, logits.astype(np.float32)


def test_min_p_matches_the_float64_definition():
    combos, logits = _rows(0)
    t, k, p, m = (np.asarray([c[i] for c in combos], dt) for i, dt in
                  enumerate((np.float32, np.int32, np.float32, np.float32)))
    got = np.asarray(jax.jit(filtered_probs)(logits, t, k, p, m))
    checked = cut = 0
    for i, (ti, ki, pi, mi) in enumerate(combos):
        want, near = reference_min_p(logits[i], ti, ki, float(np.float32(pi)),
                                     float(np.float32(mi)))
        if near:
            continue
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"row {i}: {combos[i]}")
        np.testing.assert_allclose(got[i], want, atol=2e-6, rtol=1e-5, err_msg=f"row {i}")
        checked += 1
        cut += int((want > 0).sum() < (np.asarray(reference_filtered(
            logits[i], ti, ki, float(np.float32(pi)))[0]) > 0).sum())
    assert checked > 0.95 * len(combos) and cut > 40, (checked, cut)  # min-p really cut rows


def test_min_p_off_and_greedy_rows_are_unchanged_and_ties_at_the_max_stay():
    _, logits = _rows(1)
    logits = logits[:8]
    t = np.full(8, 0.7, np.float32)
    k, p = np.full(8, -1, np.int32), np.ones(8, np.float32)
    base = np.asarray(filtered_probs(logits, t, k, p))
    np.testing.assert_array_equal(np.asarray(filtered_probs(logits, t, k, p, np.zeros(8))), base)
    greedy = np.asarray(filtered_probs(logits, np.zeros(8), k, p, np.full(8, 0.5)))
    np.testing.assert_array_equal(greedy, np.asarray(filtered_probs(logits, np.zeros(8), k, p)))
    tied = np.array([[1.0, 3.0, 3.0, 2.999, -1.0]], np.float32)
    got = np.asarray(filtered_probs(tied, 1.0, -1, 1.0, 1.0))[0]
    np.testing.assert_allclose(got, [0, 0.5, 0.5, 0, 0], atol=1e-7)
    lp = np.asarray(filtered_logprobs(tied, 1.0, -1, 1.0, 1.0))[0]
    assert np.isneginf(lp[[0, 3, 4]]).all() and np.allclose(lp[[1, 2]], math.log(0.5))


def test_draws_follow_the_min_p_distribution():
    n = 6000
    row = np.array([2.0, 1.6, 1.0, 0.2, -0.5, 1.9, 0.0, -2.0], np.float32)
    t, mp = 0.8, 0.25
    want, near = reference_min_p(row, t, -1, 1.0, mp)
    assert not near and 2 < (want > 0).sum() < len(row)
    params = SamplingTensors.from_params([(t, -1, 1.0, s, mp) for s in range(n)])
    logits = jnp.asarray(np.broadcast_to(row, (n, len(row))))
    tok = np.asarray(jax.jit(sample)(logits, params, jnp.full((n,), 5, jnp.int32)))
    counts = np.bincount(tok, minlength=len(row))
    assert not counts[want == 0].any(), f"drew ids that min_p drops: {counts}"
    res = stats.chisquare(counts[want > 0], want[want > 0] * n)
    assert res.pvalue > 1e-3, (counts, want * n)


def test_filters_any_and_the_static_flag():
    rows = SamplingTensors.from_params([(0.7, -1, 1.0, 0), (0.0, -1, 1.0, 1, 0.5)], host=True)
    assert not rows.filters_any(V)  # the greedy row's min_p filters nothing
    rows = SamplingTensors.from_params([(0.7, -1, 1.0, 0, 0.1)], host=True)
    assert rows.filters_any(V)
    assert SamplingTensors.from_params([(0.7, -1, 1.0, 0)], host=True).min_p[0] == 0
    x = jnp.asarray(np.array([[2.0, 0.0, -3.0]], np.float32))
    on = np.asarray(filtered_probs(x, 1.0, -1, 1.0, 0.5, filtering=True))[0]
    off = np.asarray(filtered_probs(x, 1.0, -1, 1.0, 0.5, filtering=False))[0]
    assert on[1] == 0 and off[1] > 0  # False: the caller vouched that no row filters


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.1", True])
def test_bad_min_p_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"min_p .* must be a number in \[0, 1\]"):
        SamplingParams(min_p=bad)
    with pytest.raises(ValueError, match=r"row 0: min_p"):
        SamplingTensors.from_params([(1.0, -1, 1.0, 0, bad)])


def test_server_body_and_cli_flags_carry_min_p_and_the_penalties(capsys):
    from mtp_jax.generate import main
    from mtp_jax.serve.errors import APIError
    from mtp_jax.serve.protocol import ChatBody, CompletionBody, parse_body, sampling_params

    body = parse_body({"prompt": "hi", "min_p": 0.05, "temperature": 0.6}, CompletionBody)
    assert sampling_params(body, 8).min_p == 0.05
    chat = parse_body({"messages": [{"role": "user", "content": "hi"}], "min_p": 0}, ChatBody)
    assert sampling_params(chat, 8).min_p == 0
    with pytest.raises(APIError, match=r"min_p 1\.5 must be a number in \[0, 1\]") as e:
        sampling_params(parse_body({"prompt": "hi", "min_p": 1.5}, CompletionBody), 8)
    assert e.value.param == "min_p" and e.value.status == 400
    assert main(["--min-p", "1.5"]) == 2
    assert "min_p (--min-p) 1.5 must be a number in [0, 1]" in capsys.readouterr().err
    body = parse_body({"prompt": "hi", "presence_penalty": 1.5, "frequency_penalty": None},
                      CompletionBody)  # null, as some clients send it: off
    got = sampling_params(body, 8)
    assert (got.presence_penalty, got.frequency_penalty, got.penalizes) == (1.5, 0.0, True)
    with pytest.raises(APIError, match=r"frequency_penalty -3.0 must be a number in \[-2, 2\]"):
        sampling_params(parse_body({"prompt": "hi", "frequency_penalty": -3}, CompletionBody), 8)
    assert main(["--presence-penalty", "2.5"]) == 2
    assert "presence_penalty (--presence-penalty) 2.5 must be" in capsys.readouterr().err
