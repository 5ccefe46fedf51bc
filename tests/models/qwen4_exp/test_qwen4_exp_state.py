"""qwen4_exp per-request slot states: the QSA open index group (group ring) and the shift
registers, checked against plain numpy re-derivations from the whole row sequence; the open group
is what decoding reads (corrupting it changes the logits, the pages never hold an open block);
a slot state without a verify handler is a config-time error."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import ConfigError
from mtp_jax.models.qwen4_exp import load_qwen4_exp, slot_states
from mtp_jax.models.qwen4_exp.slot_states import (ring_commit, ring_flush, ring_positions,
                                                  ring_verify, shift_register_commit,
                                                  token_register_commit)
from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_exp")


def _ref_open_group(raw: np.ndarray, n: int, r: int) -> np.ndarray:
    """Open group after ``n`` tokens from the whole raw-key sequence ``raw [S, d]``."""
    out = np.zeros((r, raw.shape[1]), raw.dtype)
    start = (n // r) * r
    out[:n - start] = raw[start:n]
    return out


@pytest.mark.parametrize("r,t", [(2, 1), (3, 4), (4, 9), (4, 3)])
def test_group_ring_verify_commit_matches_whole_sequence(r, t):
    """Verify k+1 = t rows from several lengths, commit 0..t of them: the committed open group
    and the rows flushed to the pages equal a re-derivation from the whole sequence."""
    rng = np.random.default_rng(r * 10 + t)
    d, b = 5, 3
    raw = rng.standard_normal((b, 40, d)).astype(np.float32)
    lengths = np.array([0, r + 1, 3 * r - 1])[:b]
    live = jnp.asarray(np.stack([_ref_open_group(raw[i], int(n), r)
                                 for i, n in enumerate(lengths)]))
    rows = jnp.asarray(np.stack([raw[i, n:n + t] for i, n in enumerate(lengths)]))
    before = np.asarray(live).copy()
    ring = ring_verify(live, rows)
    np.testing.assert_array_equal(np.asarray(live), before)  # verify leaves the live group
    pos = np.asarray(ring_positions(jnp.asarray(lengths), r, t))
    for acc in range(t + 1):
        accepted = jnp.full((b,), acc, jnp.int32)
        got = np.asarray(ring_commit(ring, jnp.asarray(lengths), accepted, r))
        flush = np.asarray(ring_flush(jnp.asarray(lengths), accepted, r, t))
        for i, n in enumerate(lengths):
            n_end = int(n) + acc
            np.testing.assert_array_equal(got[i], _ref_open_group(raw[i], n_end, r),
                                          err_msg=f"r={r} len={n} accepted={acc}")
            written = sorted(pos[i][flush[i]].tolist())
            assert written == list(range((n // r) * r, (n_end // r) * r)), (n, acc, written)
            np.testing.assert_array_equal(np.asarray(ring)[i][flush[i]],
                                          raw[i, pos[i][flush[i]]])


def test_shift_register_hooks_match_whole_sequence():
    rng = np.random.default_rng(0)
    b, c, L, t = 2, 3, 4, 5
    seq = rng.standard_normal((b, 20, c)).astype(np.float32)
    n = 7
    live = jnp.asarray(np.swapaxes(seq[:, n - L:n], 1, 2))  # [B, C, L], time last
    for acc in range(t + 1):
        got = shift_register_commit(live, jnp.asarray(seq[:, n:n + t]), None,
                                    jnp.full((b,), acc, jnp.int32))
        np.testing.assert_array_equal(np.asarray(got),
                                      np.swapaxes(seq[:, n + acc - L:n + acc], 1, 2))
    toks = rng.integers(0, 50, (2, 12))
    for acc in range(4):
        got = token_register_commit(toks[:, 3:5], toks[:, 5:8], None, np.array([acc, 3 - acc]))
        assert got.tolist() == [toks[0, 3 + acc:5 + acc].tolist(),
                                toks[1, 6 - acc:8 - acc].tolist()]


def test_every_slot_state_declares_a_handler_and_a_missing_one_is_a_config_error(
        monkeypatch, tmp_path):
    from mtp_jax.models import registry
    from mtp_jax.models.qwen4_exp import entry

    states = slot_states.check_slot_states()
    assert {s.name for s in states} == {"gdn_recurrent", "gdn_conv", "ple_conv",
                                        "ngram_context", "qsa_open_group"}
    assert slot_states.by_name("qsa_open_group").kind == "group_ring"
    assert {s.name for s in registry.REGISTRY["qwen4_exp"].slot_states} == {s.name for s in states}
    bad = dataclasses.replace(slot_states.by_name("qsa_open_group"), handler=None)
    with pytest.raises(ConfigError, match="qsa_open_group.*no usable verify handler"):
        slot_states.check_slot_states(states[:-1] + (bad,))
    no_hook = dataclasses.replace(slot_states.by_name("ple_conv"), commit=None)
    monkeypatch.setattr(slot_states, "SLOT_STATES", states[:2] + (no_hook,))
    with pytest.raises(ConfigError, match="ple_conv"):
        entry.make_entry()
    # Refused before any weight is read: the folder's weight file is not even a safetensors file.
    (tmp_path / "config.json").write_text(open(os.path.join(FIX, "config.json")).read())
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="ple_conv"):
        load_qwen4_exp(str(tmp_path), "float32")


def test_open_group_is_the_decode_state():
    """After an odd-length prefill the pages hold only complete blocks and the open group holds
    the rest; decoding continues from the open group (golden logits), and a corrupted open group
    changes the logits once its block is scored."""
    g = np.load(os.path.join(FIX, "golden.npz"))
    m = load_qwen4_exp(FIX, "float32")  # as test_qwen4_exp: the compiled programs are shared
    cfg = m.cfg
    r = cfg.indexer_compress_ratio
    ids, greedy = g["input_ids"], g["greedy_tokens"]
    t = ids.shape[1]
    assert t % r == 1, "the fixture prompt should leave one row in the open group"

    def prefill():
        cache = m.new_cache(ids.shape[0], t + greedy.shape[1] + 1)  # as test_qwen4_exp
        m.extend(cache, ids)
        return cache

    cache = prefill()
    table = np.asarray(cache.page_table)
    for q in range(len(cfg.full_layer_ids)):
        pages = np.asarray(cache.paged.idx[q])
        group = np.asarray(cache.slots.open_idx[q])
        for b in range(ids.shape[0]):
            rows = pages[table[b]].reshape(-1, pages.shape[-1])
            assert np.abs(rows[:t - 1]).min() > 0  # complete blocks written
            assert not rows[t - 1:].any()  # the open block is not in the pages
            assert np.abs(group[b, 0]).min() > 0 and not group[b, 1:].any()
    # Decoding from the open group reproduces HF (two steps: the open block completes).
    for n in range(2):
        step = np.asarray(m.extend(cache, greedy[:, n:n + 1]))[:, 0]
        np.testing.assert_allclose(step, g["decode_logits"][:, n], atol=1e-4, rtol=1e-4)
    # The completed block's first row came from the open group, not from a re-derivation.
    bad = prefill()
    st = bad.slots
    noise = np.random.default_rng(0).standard_normal(st.open_idx[0].shape).astype(np.float32)
    bad.slots = dataclasses.replace(st, open_idx=tuple(o + noise for o in st.open_idx))
    diff = 0.0
    for n in range(3):
        step = np.asarray(m.extend(bad, greedy[:, n:n + 1]))[:, 0]
        diff = max(diff, float(np.abs(step - g["decode_logits"][:, n]).max()))
    assert diff > 1e-3, diff

