"""Pallas step-form GDN kernels (verify / commit) against the XLA reference.

CPU: interpret-mode numerics and the Triton lowering; GPU (``-m gpu``): the compiled kernel at
real shapes. Inputs are random like the model's: q, k L2-normalised (q scaled by Dk**-0.5),
g = -softplus(x), beta = sigmoid(x), and a random non-zero state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gdn import BACKENDS, gdn_recurrent_reference
from pallas_kernels.gdn import api
from pallas_kernels.gdn.pallas import gdn_commit_pallas, gdn_verify_pallas
from tests.helpers.triton_lowering import lower_for_cuda


def _inputs(seed, b, t, h, dk, dv):
    """Random f32 inputs shaped like the model's (numpy RNG: no compile per shape)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    l2 = lambda a: a / np.sqrt(np.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    q = l2(normal(b, t, h, dk)) * np.float32(dk ** -0.5)
    k = l2(normal(b, t, h, dk))
    v = normal(b, t, h, dv)
    g = -np.logaddexp(0.0, normal(b, t, h)).astype(np.float32)  # -softplus
    beta = (1.0 / (1.0 + np.exp(-normal(b, t, h)))).astype(np.float32)  # sigmoid
    state = normal(b, h, dk, dv) * np.float32(0.3)
    return tuple(jnp.asarray(a, jnp.float32) for a in (q, k, v, g, beta, state))


@functools.partial(jax.jit, static_argnames="backend")
def gdn_verify(q, k, v, g, beta, state, *, backend):
    return api.gdn_verify(q, k, v, g, beta, state, backend=backend)


@functools.partial(jax.jit, static_argnames="backend")
def gdn_commit(q, k, v, g, beta, state, *, backend):
    return api.gdn_commit(q, k, v, g, beta, state, backend=backend)


def _mask(g, beta, length):
    keep = (jnp.arange(g.shape[1])[None, :] < length[:, None])[..., None]
    return jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0)


def _close(a, b, tol):
    """|a - b| <= tol * (|b| + 0.1): outputs o are ~1e-2, states ~1."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=0.1 * tol)


@pytest.mark.parametrize("b,t,h,dk,dv,block_v", [
    (2, 1, 3, 128, 128, 32),
    (2, 2, 3, 32, 64, 16),
    (2, 4, 4, 128, 128, 16),
    (1, 8, 2, 64, 64, 64),
])
def test_kernel_matches_reference(b, t, h, dk, dv, block_v):
    args = _inputs(t * 10 + h, b, t, h, dk, dv)
    o_ref, s_ref = jax.jit(gdn_recurrent_reference)(*args)
    o = gdn_verify_pallas(*args, block_v=block_v, interpret=True)
    s = gdn_commit_pallas(*args, block_v=block_v, interpret=True)
    assert o.shape == (b, t, h, dv) and s.shape == (b, h, dk, dv)
    _close(o, o_ref, 1e-5)
    _close(s, s_ref, 1e-5)


def test_api_pads_window_to_power_of_two():
    """T=3 (two drafts + 1) is padded with no-op rows for the kernel; the extra rows are dropped."""
    args = _inputs(7, 2, 3, 2, 64, 64)
    o_ref, s_ref = jax.jit(gdn_recurrent_reference)(*args)
    _close(gdn_verify(*args, backend="pallas"), o_ref, 1e-5)
    _close(gdn_commit(*args, backend="pallas"), s_ref, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_rows_leave_state_unchanged(backend):
    q, k, v, g, beta, state = _inputs(3, 3, 4, 2, 128, 128)
    length = jnp.array([0, 2, 4])
    gm, bm = _mask(g, beta, length)
    new = np.asarray(gdn_commit(q, k, v, gm, bm, state, backend=backend))
    # A fully masked window (batch 0) is an exact no-op, bit for bit.
    assert np.array_equal(new[0], np.asarray(state[0]))
    # Rows past n change nothing: same as committing only the first n rows (n = 2 and 4) ...
    for i, n in ((1, 2), (2, 4)):
        one = lambda a: a[i:i + 1, :n]
        _, expect = gdn_recurrent_reference(one(q), one(k), one(v), one(g), one(beta),
                                            state[i:i + 1])
        _close(new[i:i + 1], expect, 1e-5)
    # ... and exactly: a window of g = beta = 0 rows leaves any state bitwise unchanged.
    zero = jnp.zeros_like(g)
    assert np.array_equal(np.asarray(gdn_commit(q, k, v, zero, zero, new, backend=backend)), new)


def _assert_window_equals_row_by_row(q, k, v, g, beta, state, backend):
    """Row t of a verify window equals a one-row verify after committing rows < t one at a
    time; returns the state after committing every row that way."""
    window = np.asarray(gdn_verify(q, k, v, g, beta, state, backend=backend))
    s = state
    for t in range(q.shape[1]):
        row = tuple(a[:, t:t + 1] for a in (q, k, v, g, beta))
        _close(window[:, t:t + 1], gdn_verify(*row, s, backend=backend), 1e-6)
        s = gdn_commit(*row, s, backend=backend)
    return s


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_window_equals_decoding_row_by_row(backend):
    """Row t of a verify equals a one-row verify after committing rows < t one at a time."""
    q, k, v, g, beta, state = _inputs(11, 3, 4, 2, 128, 128)
    s = _assert_window_equals_row_by_row(q, k, v, g, beta, state, backend)
    _close(s, gdn_commit(q, k, v, g, beta, state, backend=backend), 1e-6)


def test_bad_input_errors():
    args = _inputs(0, 1, 2, 2, 32, 32)
    with pytest.raises(ValueError, match="'triton'.*xla.*pallas"):
        gdn_verify(*args, backend="triton")
    with pytest.raises(ValueError, match="'cuda'"):
        gdn_commit(*args, backend="cuda")
    with pytest.raises(ValueError, match="state has shape"):
        gdn_commit(*args[:5], args[5][:, :1], backend="pallas")
    with pytest.raises(ValueError, match="not a multiple of block_v"):
        gdn_verify_pallas(*args, block_v=64, interpret=True)


@pytest.mark.parametrize("t", [1, 3, 4, 8])
def test_triton_lowering_real_shape(t):
    """27B shape: 48 value heads, Dk = Dv = 128; T=3 goes through the api's padding."""
    b, h, d = 8, 48, 128
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    args = (f32(b, t, h, d), f32(b, t, h, d), f32(b, t, h, d), f32(b, t, h), f32(b, t, h),
            f32(b, h, d, d))
    for fn in (api.gdn_verify, api.gdn_commit):
        text = lower_for_cuda(lambda *a: fn(*a, backend="pallas", interpret=False), *args)
        assert "__gpu$xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 8])
def test_gpu_real_shape(b):
    args = _inputs(5 + b, b, 4, 48, 128, 128)
    o_ref, s_ref = jax.jit(gdn_recurrent_reference)(*args)
    _close(gdn_verify(*args, backend="pallas"), o_ref, 1e-5)
    _close(gdn_commit(*args, backend="pallas"), s_ref, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_masked_rows_and_row_by_row(backend):
    """On the GPU: a fully masked window is a bitwise no-op, rows past n change nothing, and a
    verify window equals decoding its rows one by one with commits in between."""
    q, k, v, g, beta, state = _inputs(9, 8, 4, 48, 128, 128)
    length = jnp.arange(8) % 5
    gm, bm = _mask(g, beta, length)
    new = np.asarray(gdn_commit(q, k, v, gm, bm, state, backend=backend))
    assert np.array_equal(new[0], np.asarray(state[0]))  # length 0
    zero = jnp.zeros_like(g)
    again = gdn_commit(q, k, v, zero, zero, new, backend=backend)
    assert np.array_equal(np.asarray(again), new)
    head = lambda a: a[1:2, :1]  # batch 1 has length 1
    one = gdn_commit(head(q), head(k), head(v), head(g), head(beta), state[1:2], backend=backend)
    _close(new[1:2], one, 1e-6)
    s = _assert_window_equals_row_by_row(q, k, v, g, beta, state, backend)
