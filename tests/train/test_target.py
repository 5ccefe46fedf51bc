"""mtp_jax.train.target (next-token training of a target) and mtp_jax.train.synthetic (the motif
language of the trained fixtures)."""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax.train import synthetic
from mtp_jax.train.synthetic import motif_language, motif_prompts, motif_sequences
from mtp_jax.train.target import next_token_loss, train_target
from tests.helpers.paths import fixture_path

XLA = dict(attention_backend="xla", gdn_backend="xla", moe_backend="xla", norm_backend="xla",
           gemv_backend="xla")


# ---- next_token_loss ------------------------------------------------------------------------
def test_next_token_loss_matches_numpy_and_ignores_padding():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 5, 7)).astype(np.float32)
    ids = rng.integers(0, 7, size=(2, 5)).astype(np.int32)
    lengths = np.array([5, 3], np.int32)
    ces, hits = [], []
    for b in range(2):
        for t in range(lengths[b] - 1):
            row, label = logits[b, t].astype(np.float64), ids[b, t + 1]
            ces.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[label])
            hits.append(row.argmax() == label)
    loss, acc = next_token_loss(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(lengths))
    np.testing.assert_allclose(float(loss), np.mean(ces), rtol=1e-5)
    assert float(acc) == pytest.approx(np.mean(hits))
    # Rows past a length (and each row's last position) do not count.
    logits[1, 2:] = 100.0
    logits[0, 4] = -100.0
    ids[1, 3:] = 0
    again = next_token_loss(jnp.asarray(logits), jnp.asarray(ids), jnp.asarray(lengths))
    assert float(again[0]) == pytest.approx(float(loss))


# ---- train_target ---------------------------------------------------------------------------
def test_train_target_lowers_the_loss_and_keeps_frozen_params():
    model = mtp_jax.load_model(fixture_path("tiny_dense"), dtype="float32",
                               merge_projections=False, with_mtp=False, **XLA)
    ids = np.asarray(motif_sequences(4, 16, seed=5, vocab_size=300), np.int32)
    lengths = np.array([16, 16, 12, 9], np.int32)
    ids[np.arange(16)[None, :] >= lengths[:, None]] = 0
    before = float(next_token_loss(model.forward(ids)[0], jnp.asarray(ids),
                                   jnp.asarray(lengths))[0])
    logged = []
    params = train_target(model, [(ids, lengths)], steps=6, lr=1e-2, warmup=1,
                          trainable=lambda name: not name.startswith("embed_tokens"),
                          log_every=1, log=logged.append)
    after = float(next_token_loss(model.forward(ids, params=params)[0], jnp.asarray(ids),
                                  jnp.asarray(lengths))[0])
    assert after < 0.8 * before, (before, after)
    assert len(logged) == 6 and "step 6/6" in logged[-1]
    # Frozen parameters are the loaded ones; the model's own arrays survive the donated steps.
    np.testing.assert_array_equal(np.asarray(params["embed_tokens"]["weight"][...]),
                                  np.asarray(model.params["embed_tokens"]["weight"][...]))
    assert not np.array_equal(np.asarray(params["norm"]["weight"][...]),
                              np.asarray(model.params["norm"]["weight"][...]))


def test_train_target_refusals():
    model = mtp_jax.load_model(fixture_path("tiny_dense"), dtype="float32",
                               merge_projections=False, with_mtp=False, **XLA)
    with pytest.raises(ValueError, match="selected no parameter"):
        train_target(model, [], steps=1, trainable=lambda name: False)
    with pytest.raises(ValueError, match="ran out after 0 of 3 steps"):
        train_target(model, iter([]), steps=3)


# ---- the motif language ---------------------------------------------------------------------
def test_motif_data_is_deterministic_and_in_range():
    a = motif_sequences(8, 50, seed=3)
    assert a == motif_sequences(8, 50, seed=3)
    assert a != motif_sequences(8, 50, seed=4)
    assert a != motif_sequences(8, 50, seed=3, language_seed=1)
    assert all(len(s) == 50 for s in a)
    ids = np.concatenate(a + motif_prompts(20, seed=3))
    assert ids.min() >= synthetic.FIRST_ID > 1  # never 0, never eos id 1
    assert ids.max() < synthetic.FIRST_ID + synthetic.NUM_SYMBOLS
    with pytest.raises(ValueError, match="vocab_size 16 is too small"):
        motif_sequences(1, 10, seed=0, vocab_size=16)


def test_motif_language_needs_context_beyond_the_current_token():
    lang = motif_language(0)
    by_last = collections.defaultdict(set)
    for ctx, dist in lang.table.items():
        if len(dist) == 1:
            by_last[ctx[-1]].update(dist)
    determined = [ctx for ctx, dist in lang.table.items() if len(dist) == 1]
    ambiguous = sum(len(by_last[ctx[-1]]) > 1 for ctx in determined)
    assert ambiguous / len(determined) > 0.5  # the current token alone rarely decides
    branches = [dist for dist in lang.table.values() if len(dist) > 1]
    assert len(branches) == synthetic.NUM_BRANCHES
    for dist in branches:
        assert sorted(dist.values()) == [pytest.approx(0.25), pytest.approx(0.75)]


def test_motif_sequences_follow_the_table_and_branch_75_25():
    lang = motif_language(0)
    major = total = 0
    for seq in motif_sequences(200, 120, seed=7):
        for t in range(2, len(seq) - 1):
            dist = lang.next_tokens(seq[t - 2:t + 1])
            assert seq[t + 1] in dist
            if len(dist) > 1:
                total += 1
                major += dist[seq[t + 1]] == synthetic.P_MAJOR
    assert total > 500
    assert abs(major / total - 0.75) < 4 * np.sqrt(0.75 * 0.25 / total)


def test_motif_prompts_fix_their_greedy_continuation():
    lang = motif_language(0)
    prompts = motif_prompts(50, seed=1)
    assert prompts == motif_prompts(50, seed=1)
    assert {len(p) for p in prompts} <= set(range(3, 41)) and len({len(p) for p in prompts}) > 5
    for p in prompts:
        cont = lang.greedy(p, 30)
        assert cont == lang.greedy(p[-3:], 30)  # the last 3 tokens decide
        assert lang.determined(p + cont)[len(p):-1].sum() >= 20
