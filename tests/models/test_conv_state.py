"""The GDN conv state as a ring keyed by position (:mod:`mtp_jax.models.layers.conv_state`)
against a numpy history of the raw inputs: however the rows arrive (decode steps, committed
verify windows of any accepted length, prefill chunks), the ring read at the next position is
the last K-1 inputs (zeros before position 0), and the ring itself is the same array."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.models.layers.conv_state import (advance, is_ring, ordered_window, store_rows,
                                              window_before)

K, C = 4, 6


def _feed(chunks, rows):
    """Ring after feeding ``rows [B, L, C]`` in chunks of the given lengths per step (``[B]``
    each; each call pads to the longest chunk, like the engine's buckets)."""
    b = rows.shape[0]
    ring = jnp.zeros((b, C, K), jnp.float32)
    pos = np.zeros(b, np.int32)
    for length in chunks:
        length = np.asarray(length, np.int32)
        t = max(int(length.max()), 1) + 1  # one padding row past the longest
        block = np.zeros((b, t, C), np.float32)
        for i in range(b):
            block[i, :length[i]] = rows[i, pos[i]:pos[i] + length[i]]
            block[i, length[i]:] = 99.0  # padding rows must not reach the ring
        ring = advance(ring, K, jnp.asarray(block), jnp.asarray(length), jnp.asarray(pos))
        pos = pos + length
    return ring, pos


def _want_window(rows, pos):
    """The K-1 inputs before ``pos`` per request, oldest first; zeros before position 0."""
    padded = np.concatenate([np.zeros((rows.shape[0], K - 1, C), np.float32), rows], axis=1)
    return np.stack([padded[i, p:p + K - 1].T for i, p in enumerate(pos)])


@pytest.mark.parametrize("seed", [0, 1])
def test_ring_is_the_same_however_rows_arrive(seed):
    rng = np.random.default_rng(seed)
    b, total = 3, 11
    rows = rng.standard_normal((b, 2 * total, C)).astype(np.float32)
    steps = [np.ones(b, np.int32)] * total
    windows = [rng.integers(0, 5, b) for _ in range(6)]  # verify windows, 0..4 accepted
    chunks = [np.array([5, 2, 7]), np.array([6, 9, 0]), np.array([0, 0, 4])]
    rings = {name: _feed(plan, rows) for name, plan in
             (("decode", steps), ("verify", windows), ("prefill", chunks))}
    for name, (ring, pos) in rings.items():
        np.testing.assert_array_equal(np.asarray(ordered_window(ring, jnp.asarray(pos))),
                                      _want_window(rows, pos), err_msg=name)
        assert 99.0 not in np.asarray(ring), name
    # Fed to the same positions, the rings are one array, whatever the path.
    ring_d, pos_d = _feed([np.array([10, 9, 11])], rows)
    ring_s, pos_s = _feed([np.array([1, 1, 1])] * 9 + [np.array([1, 0, 2])], rows)
    assert np.array_equal(pos_d, pos_s)
    np.testing.assert_array_equal(np.asarray(ring_d), np.asarray(ring_s))


def test_store_rows_keeps_columns_no_row_reaches():
    ring = jnp.asarray(np.arange(2 * C * K, dtype=np.float32).reshape(2, C, K))
    rows = jnp.full((2, 3, C), -1.0)
    out = np.asarray(store_rows(ring, rows, jnp.asarray([2, 0]), jnp.asarray([7, 1])))
    want = np.asarray(ring).copy()
    want[0][:, [3, 0]] = -1.0  # positions 7 and 8
    np.testing.assert_array_equal(out, want)


def test_layouts_and_refusals():
    shift = jnp.zeros((2, C, K - 1))
    assert not is_ring(shift, K) and is_ring(jnp.zeros((2, C, K)), K)
    assert window_before(shift, K, None) is shift
    with pytest.raises(ValueError, match="5 columns; a conv of kernel 4 keeps 3"):
        is_ring(jnp.zeros((2, C, 5)), K)
    with pytest.raises(ValueError, match="pass the rows' first position"):
        window_before(jnp.zeros((2, C, K)), K, None)


def test_layer_refuses_a_ring_without_a_start_of_shape_b():
    from tests.helpers.paths import fixture_path
    from mtp_jax.models.loader import load_model

    from flax import nnx

    loaded = load_model(fixture_path("tiny_dense"), "float32", with_mtp=False)
    model = nnx.merge(loaded.graphdef, loaded.params)
    layer = next(m.linear_attn for m in model.layers if m.layer_type != "full_attention")
    x = jnp.zeros((2, 1, model.cfg.hidden_size))
    conv_dim = model.cfg.linear_conv_dim
    state = (jnp.zeros((2, layer.hv, layer.dk, layer.dv)), jnp.zeros((2, conv_dim, K)))
    valid = jnp.ones((2, 1), bool)
    for start in (None, jnp.zeros((2, 1), jnp.int32)):
        with pytest.raises(ValueError, match=r"pass `start \[B=2\]`"):
            layer.decode(x, state, valid, start=start)
