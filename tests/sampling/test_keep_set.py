"""The top-k / top-p kept set from per-chunk candidates (mtp_jax.sampling.keep_set) against the whole-row
sort and against the float64 reference of the sampling definition."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.sampling import keep_set
from mtp_jax.sampling import filtered_probs
from tests.sampling.test_sampling import assert_matches_reference


def _rows(rng, n, v, ties: bool):
    """bf16-rounded logits (as the LM head gives them): ties in the tail; with ``ties``
    logits on a grid of 0.5, so that every value above the median is shared by a few ids or
    more and kept sets end inside tie groups."""
    if ties:
        x = np.floor(rng.normal(size=(n, v)) * 3) * 0.5
    else:
        x = rng.normal(size=(n, v)) * rng.choice([0.5, 2.0, 6.0], size=(n, 1))
        hot = rng.integers(0, v, size=(n, 12))
        x[np.arange(n)[:, None], hot] += rng.uniform(4, 12, size=(n, 12))
    return np.array(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _args(x, t, k, p):
    v = x.shape[-1]
    k_eff = np.where((k <= 0) | (k >= v), v, k).astype(np.int32)
    return (jnp.asarray(x), jnp.max(jnp.asarray(x), -1, keepdims=True), jnp.asarray(t, jnp.float32),
            jnp.asarray(k_eff), jnp.asarray(p, jnp.float32), jnp.asarray(p >= 1))


@pytest.mark.parametrize("ties", [False, True])
def test_candidates_equal_the_sort_where_valid_and_prefix_end_everywhere(ties):
    rng = np.random.default_rng(int(ties))
    n, v = 96, 2048
    x = _rows(rng, n, v, ties)
    t = rng.choice([0.3, 0.7, 1.0, 2.0], size=n)
    k = rng.choice([-1, 1, 3, 40, 150, 400, 2048], size=n)
    p = rng.choice([1.0, 0.3, 0.9, 0.99, 0.9999], size=n)
    args = _args(x, t, k, p)
    v_s, i_s = jax.jit(keep_set.prefix_end_sorted)(*args)
    v_c, i_c, valid = jax.jit(lambda *a: keep_set.prefix_end_candidates(
        *a, num_chunks=32, per_chunk=4))(*args)
    valid = np.asarray(valid)
    # both outcomes occur, so both branches are exercised
    assert 0 < valid.sum() < n, valid.sum()
    np.testing.assert_array_equal(np.asarray(v_c)[valid], np.asarray(v_s)[valid])
    np.testing.assert_array_equal(np.asarray(i_c)[valid], np.asarray(i_s)[valid])
    # keep_mask: the candidates where valid, the sort elsewhere; equal to the sort's mask
    x32 = np.asarray(args[0])
    want = (x32 > np.asarray(v_s)[:, None]) | ((x32 == np.asarray(v_s)[:, None])
                                                & (np.arange(v) <= np.asarray(i_s)[:, None]))
    got = jax.jit(lambda *a: keep_set.keep_mask(
        *a, jnp.ones(n, bool), num_chunks=32, per_chunk=4, min_vocab=0))(*args)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_validity_is_not_claimed_when_the_answer_is_outside_the_candidates():
    # A flat row: top-p 0.9 keeps most ids, far below every chunk's candidates; top_k above the
    # candidate count; a tie at the candidates' threshold.
    v = 1024
    x = np.zeros((3, v), np.float32)
    x[0] = np.linspace(0, 1e-3, v)
    x[1] = np.linspace(1, 0, v)
    x[2, :] = 1.0
    args = _args(x, np.ones(3), np.array([-1, 200, 3]), np.array([0.9, 1.0, 1.0]))
    *_, valid = keep_set.prefix_end_candidates(*args, num_chunks=16, per_chunk=4)
    assert not np.asarray(valid).any()


def test_rows_outside_filtered_keep_every_id():
    # Row 1 (no filter) is not valid for the candidates; it keeps every id, and row 0 keeps
    # its candidates' answer.
    v = 1024
    x = np.stack([np.linspace(1, 0, v), np.zeros(v)]).astype(np.float32)
    x[0, 5] = 30.0
    args = _args(x, np.ones(2), np.array([-1, -1]), np.array([0.5, 1.0]))
    *_, valid = keep_set.prefix_end_candidates(*args, num_chunks=16, per_chunk=4)
    assert bool(valid[0]) and not bool(valid[1])
    got = np.asarray(keep_set.keep_mask(*args, jnp.array([True, False]), num_chunks=16,
                                        per_chunk=4, min_vocab=0))
    np.testing.assert_array_equal(got[0], np.arange(v) == 5)
    assert got[1].all()
    # the same rows with row 1 filtered too: the sort is needed and gives row 1's answer
    got2 = np.asarray(keep_set.keep_mask(*_args(x, np.ones(2), np.array([-1, -1]),
                                                np.array([0.5, 0.5])),
                                         jnp.array([True, True]), num_chunks=16, per_chunk=4,
                                         min_vocab=0))
    np.testing.assert_array_equal(got2[0], got[0])
    assert got2[1].sum() == v // 2  # zeros: the first half of the ids by id order


def test_filtered_probs_on_a_full_size_vocabulary_matches_the_float64_reference():
    # Above MIN_VOCAB filtered_probs takes the candidates; rows chosen so that some need the
    # sort (flat logits with top_p 0.999, top_k beyond the candidates) and some do not.
    rng = np.random.default_rng(7)
    v = keep_set.MIN_VOCAB + 1000
    x = _rows(rng, 6, v, ties=False)
    x[3] = np.asarray(jnp.asarray(rng.normal(size=v) * 0.1, jnp.float32).astype(jnp.bfloat16))
    t = np.array([0.7, 1.0, 0.5, 1.0, 1.3, 0.0], np.float32)
    k = np.array([-1, 50, -1, -1, 5000, -1], np.int32)
    p = np.array([0.9, 0.95, 1.0, 0.999, 0.8, 0.9], np.float32)
    got = np.asarray(jax.jit(filtered_probs)(x, t, k, p))
    for i in range(len(x)):
        assert_matches_reference(got[i], x[i], float(t[i]), int(k[i]), float(p[i]), f"row {i}")


def test_too_few_ids_per_chunk_is_refused():
    args = _args(np.zeros((1, 20), np.float32), np.ones(1), np.array([-1]), np.array([0.5]))
    with pytest.raises(ValueError, match="per_chunk=16"):
        keep_set.prefix_end_candidates(*args, num_chunks=4, per_chunk=16)
