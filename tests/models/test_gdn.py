"""Gated DeltaNet pieces against float64 numpy re-derivations, and the commit's replay rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.models.layers.conv_state import advance, advance_at
from mtp_jax.models.layers.gdn import GDNRows, commit, conv_window
from pallas_kernels.gdn.reference import (gdn_chunked_reference, gdn_chunked_states,
                                          gdn_recurrent_reference)


def _inputs(seed, b=2, t=70, h=3, dk=8, dv=6):
    r = np.random.default_rng(seed)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)
    q = unit(r.standard_normal((b, t, h, dk))) * dk ** -0.5
    k = unit(r.standard_normal((b, t, h, dk)))
    v = r.standard_normal((b, t, h, dv))
    g = -np.abs(r.standard_normal((b, t, h))) * 0.5
    beta = 1 / (1 + np.exp(-r.standard_normal((b, t, h))))
    s = r.standard_normal((b, h, dk, dv))
    return q, k, v, g, beta, s


def _numpy_gdn(q, k, v, g, beta, s):
    """float64 loop over time, heads: S = S e^g; S += k (beta (v - S^T k))^T; o = S^T q."""
    s = s.copy()
    o = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        kv = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        s = s + k[:, t][..., None] * ((v[:, t] - kv) * beta[:, t][..., None])[..., None, :]
        o[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return o, s


@pytest.mark.parametrize("form,chunk", [("recurrent", None), ("chunked", 128), ("chunked", 16)])
def test_gdn_forms_match_float64(form, chunk):
    """T = 70: one padded chunk at the default size, five (the last padded) at 16, so the
    scan carries the state across chunk boundaries."""
    args = _inputs(0)
    ref_o, ref_s = _numpy_gdn(*args)
    fn = (gdn_recurrent_reference if form == "recurrent" else
          lambda *a: gdn_chunked_reference(*a, chunk_size=chunk))
    o, s = fn(*(jnp.asarray(a, jnp.float32) for a in args))
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(s), ref_s, atol=2e-5, rtol=1e-4)


def test_commit_replays_accepted_rows_bitwise():
    """Committing the first n of T verify rows equals n single decode steps on the same inputs,
    bitwise, for every n in 0..T (masked rows leave the state untouched exactly)."""
    q, k, v, g, beta, s = (jnp.asarray(a, jnp.float32) for a in _inputs(1, b=3, t=5))
    qkv = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5, 7)), jnp.float32)
    conv = jnp.asarray(np.random.default_rng(3).standard_normal((3, 7, 3)), jnp.float32)
    rows = GDNRows(q=q, k=k, v=v, g=g, beta=beta, qkv=qkv)
    step = jax.jit(gdn_recurrent_reference)
    for n in range(6):
        rec, cw = jax.jit(commit)((s, conv), rows, jnp.full((3,), n, jnp.int32))
        ref = s
        for t in range(n):
            _, ref = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                          beta[:, t:t + 1], ref)
        assert np.array_equal(np.asarray(rec), np.asarray(ref)), n
        full = np.concatenate([np.swapaxes(np.asarray(conv), 1, 2), np.asarray(qkv)], 1)
        np.testing.assert_array_equal(np.swapaxes(np.asarray(cw), 1, 2), full[:, n:n + 3])


def test_conv_window_per_row_lengths():
    conv = jnp.asarray(np.arange(2 * 4 * 3).reshape(2, 4, 3), jnp.float32)
    new = jnp.asarray(100 + np.arange(2 * 5 * 4).reshape(2, 5, 4), jnp.float32)
    out = np.asarray(conv_window(conv, new, jnp.asarray([0, 4], jnp.int32)))
    np.testing.assert_array_equal(out[0], np.asarray(conv[0]))
    np.testing.assert_array_equal(out[1], np.asarray(new[1, 1:4]).T)


def test_chunked_default_chunk_of_a_short_input_matches_float64():
    """T = 20: the default chunk is 32 rows (the next power of two), one padded chunk."""
    args = _inputs(1, t=20)
    ref_o, ref_s = _numpy_gdn(*args)
    o, s = gdn_chunked_reference(*(jnp.asarray(a, jnp.float32) for a in args))
    np.testing.assert_allclose(np.asarray(o), ref_o, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(s), ref_s, atol=2e-5, rtol=1e-4)


def test_chunked_states_at_rows_match_float64():
    """States after any number of rows (0, mid-chunk, a chunk end, the last row, per request)
    equal the float64 loop over those rows; outputs and the final state equal the plain
    chunked form's. T = 70 in chunks of 16: rows 16 and 32 end chunks, 70 is the padded end."""
    args = _inputs(4)
    at = np.asarray([[0, 5, 16, 33, 70], [1, 15, 32, 64, 69]], np.int32)
    o, final, states = jax.jit(gdn_chunked_states, static_argnames="chunk_size")(
        *(jnp.asarray(a, jnp.float32) for a in args), jnp.asarray(at), chunk_size=16)
    ref_o, ref_final = gdn_chunked_reference(*(jnp.asarray(a, jnp.float32) for a in args),
                                             chunk_size=16)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(ref_o))
    np.testing.assert_array_equal(np.asarray(final), np.asarray(ref_final))
    q, k, v, g, beta, s = args
    for b in range(2):
        for j, r in enumerate(at[b]):
            _, ref = _numpy_gdn(*(a[b:b + 1, :r] for a in (q, k, v, g, beta)), s[b:b + 1])
            np.testing.assert_allclose(np.asarray(states[b, j]), ref[0], atol=2e-5, rtol=1e-4,
                                       err_msg=f"request {b}, {r} rows")


@pytest.mark.parametrize("ring", [True, False])
def test_conv_state_after_rows_equals_advance_by_that_many(ring):
    """``advance_at`` gives, per requested row count, the conv state ``advance`` leaves after
    consuming that many rows (ring keyed by position, or shift register)."""
    rng = np.random.default_rng(5)
    cols = 4 if ring else 3
    conv = jnp.asarray(rng.standard_normal((2, 6, cols)), jnp.float32)
    qkv = jnp.asarray(rng.standard_normal((2, 12, 6)), jnp.float32)
    start = jnp.asarray([3, 9], jnp.int32) if ring else None
    rows = jnp.asarray([[0, 2, 4], [7, 12, 1]], jnp.int32)
    got = np.asarray(advance_at(conv, 4, qkv, rows, start))
    for b in range(2):
        for j in range(3):
            want = advance(conv, 4, qkv, jnp.full((2,), rows[b, j]), start)[b]
            np.testing.assert_array_equal(got[b, j], np.asarray(want), err_msg=f"{b}, {j}")
