"""filtered_logprobs against a float64 numpy derivation of the sampler's definition, the
readback columns round trip, and the new SamplingParams fields."""

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.sampling import SamplingParams, SamplingTensors, filtered_logprobs, filtered_probs
from mtp_jax.sampling.logprobs import logprob_columns, split_logprob_columns, top_bucket


def numpy_logprobs(x, t, k, p):
    """float64: log softmax(x / t) over the top-k then top-p rank prefix (rank: logit
    descending, id ascending), renormalised; t = 0: log_softmax(x)."""
    x = np.asarray(x, np.float64)
    if t == 0:
        return x - x.max() - np.log(np.exp(x - x.max()).sum())
    order = np.lexsort((np.arange(x.size), -x))
    z = (x - x.max()) / t
    keep = np.zeros(x.size, bool)
    ranked = order[:k] if 0 < k < x.size else order
    e = np.exp(z[ranked])
    cum = np.cumsum(e) / e.sum()
    n = x.size if p >= 1 else int(np.searchsorted(cum, p) + 1)
    keep[ranked[:n]] = True
    zk = np.where(keep, z, -np.inf)
    return zk - np.log(np.exp(zk).sum())


ROWS = [(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.8), (0.5, 12, 0.9)]


def test_filtered_logprobs_equal_a_float64_derivation():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (len(ROWS), 64)).astype(np.float32)
    t, k, p = (np.asarray(c) for c in zip(*ROWS))
    got = np.asarray(filtered_logprobs(logits, t, k, p))
    for row, (ti, ki, pi) in enumerate(ROWS):
        ref = numpy_logprobs(logits[row], ti, ki, pi)
        assert np.array_equal(np.isinf(got[row]), np.isinf(ref)), row
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[row][fin], ref[fin], atol=2e-5)
    probs = np.asarray(filtered_probs(logits, t, k, p))  # the sampler's own distribution
    np.testing.assert_allclose(np.exp(got[1:]), probs[1:], atol=1e-6)


def test_columns_round_trip_sorted_top():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (2, 3, 40)), jnp.float32)
    tokens = jnp.asarray([[3, 7, -1], [0, 39, 5]], jnp.int32)
    s = SamplingTensors.from_params([(0.0, -1, 1.0, 0), (0.9, 6, 1.0, 1)])
    cols = np.asarray(logprob_columns(logits, tokens, s, 4))
    assert cols.shape == (2, 3 * 9) and cols.dtype == np.int32
    chosen, ids, vals = split_logprob_columns(cols, 4)
    lp = np.asarray(filtered_logprobs(logits, s.temperature[:, None], s.top_k[:, None],
                                      s.top_p[:, None]))
    np.testing.assert_array_equal(chosen[0, :2], lp[0, [0, 1], [3, 7]])
    assert np.all(np.diff(vals, axis=-1) <= 0)  # most likely first
    np.testing.assert_array_equal(np.take_along_axis(lp, ids, -1), vals)
    np.testing.assert_array_equal(ids[0, :, 0], np.argmax(np.asarray(logits[0]), -1))


def test_top_bucket_and_params():
    assert top_bucket([None, None]) == -1 and top_bucket([0, None]) == 0
    assert [top_bucket([n]) for n in (1, 2, 3, 5, 17, 20)] == [1, 2, 4, 8, 20, 20]
    assert SamplingParams(n=3, logprobs=20).n == 3
    for bad, field in [(dict(n=0), "n 0"), (dict(logprobs=21), "logprobs 21"),
                       (dict(logprobs=-1), "logprobs -1"), (dict(n=1.5), "n 1.5")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
