"""Fused slot-addressed GDN kernels (conv rows + gates/norms/recurrence) against a float64 numpy
re-derivation of the layer's step form (HF ``Qwen3_5GatedDeltaNet``), and their exactness rule:
a commit of n rows gives bitwise the state of n decode steps.

CPU: interpret-mode numerics and the Triton lowering; GPU (``-m gpu``): compiled at real shapes.
Inputs are fresh random values (never zeros); slots are in random order with untouched slots
between them.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.gdn.fused import gdn_conv_rows, gdn_step
from pallas_kernels.gdn.fused_decode import OutputNorm, gdn_decode_ring
from tests.helpers.triton_lowering import lower_for_cuda


def _case(seed, b, t, hk, hv, dk, dv, kernel=4, slots=7, dtype=np.float32):
    rng = np.random.default_rng(seed)
    c = 2 * hk * dk + hv * dv
    n = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(
        qkv=n(b, t, c).astype(dtype), weight=(0.5 * n(c, kernel)).astype(dtype),
        window=n(slots, c, kernel - 1).astype(dtype),
        a=n(b, t, hv).astype(dtype), b=n(b, t, hv).astype(dtype),
        a_log=n(hv) * 0.5, dt_bias=n(hv) * 0.5,
        state=0.3 * n(slots, hv, dk, dv),
        slot=rng.permutation(np.arange(1, slots))[:b].astype(np.int32), hk=hk)


def _np_conv(qkv, weight, window, slot, out_dtype):
    """float64 conv + silu, rounded to the model dtype like the layer; ``[B, T, C]``."""
    b, t, _ = qkv.shape
    ext = np.concatenate([np.swapaxes(window[slot], 1, 2), qkv], axis=1).astype(np.float64)
    w = weight.astype(np.float64)
    km1 = window.shape[-1]
    conv = sum(ext[:, i:i + t] * w[:, i] for i in range(km1 + 1))
    return (conv / (1 + np.exp(-conv))).astype(out_dtype).astype(np.float64)


def _np_step(conv, a, b, a_log, dt_bias, keep, state, slot, hk):
    """float64 norms, gates and step form; returns ``(o [B,T,Hv,Dv], new pool)``."""
    bsz, t, _ = conv.shape
    _, hv, dk, dv = state.shape
    rep = hv // hk
    q = conv[..., :hk * dk].reshape(bsz, t, hk, dk)
    k = conv[..., hk * dk:2 * hk * dk].reshape(bsz, t, hk, dk)
    v = conv[..., 2 * hk * dk:].reshape(bsz, t, hv, dv)
    l2 = lambda x: x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)
    q = np.repeat(l2(q), rep, axis=2) * dk ** -0.5
    k = np.repeat(l2(k), rep, axis=2)
    beta = 1 / (1 + np.exp(-b.astype(np.float64)))
    g = -np.exp(a_log.astype(np.float64)) * np.logaddexp(0, a.astype(np.float64) + dt_bias)
    g, beta = np.where(keep[..., None], g, 0), np.where(keep[..., None], beta, 0)
    pool = state.astype(np.float64).copy()
    o = np.zeros((bsz, t, hv, dv))
    for i in range(bsz):
        s = pool[slot[i]]
        for r in range(t):
            s = s * np.exp(g[i, r])[:, None, None]
            kv = np.einsum("hkv,hk->hv", s, k[i, r])
            s = s + k[i, r][:, :, None] * ((v[i, r] - kv) * beta[i, r][:, None])[:, None, :]
            o[i, r] = np.einsum("hkv,hk->hv", s, q[i, r])
        pool[slot[i]] = s
    return o, pool


def _close(got, want, rtol, atol):
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,dtype", [
    (2, 1, 2, 4, 16, 32, np.float32),
    (3, 4, 2, 2, 32, 16, np.float32),
    (2, 3, 1, 3, 16, 16, ml_dtypes.bfloat16),
])
def test_conv_rows_and_window_match_numpy(b, t, hk, hv, dk, dv, dtype):
    c = _case(1, b, t, hk, hv, dk, dv, dtype=dtype)
    length = np.array([t, 0, t - 1][:b], np.int32)
    conv = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                         jnp.asarray(c["window"]), jnp.asarray(c["slot"]), interpret=True)
    conv2, window = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                                  jnp.asarray(c["window"]), jnp.asarray(c["slot"]),
                                  jnp.asarray(length), interpret=True)
    want = _np_conv(c["qkv"], c["weight"], c["window"], c["slot"], dtype)
    ulp = 2.0 ** -7 if dtype == ml_dtypes.bfloat16 else 1e-5
    _close(conv, want, rtol=ulp, atol=ulp)
    np.testing.assert_array_equal(np.asarray(conv2), np.asarray(conv))
    # The window moves past `length` rows of [old window | rows]; other slots stay as they were.
    ext = np.concatenate([np.swapaxes(c["window"][c["slot"]], 1, 2), c["qkv"]], axis=1)
    km1 = c["window"].shape[-1]
    expect = c["window"].copy()
    for i, s in enumerate(c["slot"]):
        expect[s] = ext[i, length[i]:length[i] + km1].T
    np.testing.assert_array_equal(np.asarray(window), expect)


@pytest.mark.parametrize("b,t,hk,hv,dk,dv,block_v", [
    (2, 1, 2, 4, 16, 32, 16),
    (3, 4, 2, 2, 32, 16, 16),
    (2, 3, 1, 3, 16, 32, 32),
])
def test_step_modes_match_numpy(b, t, hk, hv, dk, dv, block_v):
    c = _case(2, b, t, hk, hv, dk, dv)
    conv = _np_conv(c["qkv"], c["weight"], c["window"], c["slot"], np.float32)
    rng = np.random.default_rng(3)
    keep = rng.random((b, t)) < 0.7
    keep[:, 0] = True
    args = (jnp.asarray(conv, jnp.float32), jnp.asarray(c["a"]), jnp.asarray(c["b"]),
            jnp.asarray(c["a_log"]), jnp.asarray(c["dt_bias"]), jnp.asarray(keep))
    run = functools.partial(gdn_step, num_k_heads=hk, block_v=block_v, interpret=True)
    o_want, pool_want = _np_step(conv, c["a"], c["b"], c["a_log"], c["dt_bias"], keep,
                                 c["state"], c["slot"], hk)
    o = run(*args, jnp.asarray(c["state"]), jnp.asarray(c["slot"]), mode="verify")
    pool = run(*args, jnp.asarray(c["state"]), jnp.asarray(c["slot"]), mode="commit")
    _close(o, o_want, rtol=1e-4, atol=1e-5)
    _close(pool, pool_want, rtol=1e-4, atol=1e-5)
    untouched = np.setdiff1d(np.arange(c["state"].shape[0]), c["slot"])
    np.testing.assert_array_equal(np.asarray(pool)[untouched], c["state"][untouched])
    if t == 1:
        o_d, pool_d = run(*args, jnp.asarray(c["state"]), jnp.asarray(c["slot"]), mode="decode")
        # Same code; the interpreter's XLA may order the output reduction differently.
        np.testing.assert_allclose(np.asarray(o_d), np.asarray(o), rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(np.asarray(pool_d), np.asarray(pool))


def _decode_steps(c, n, hk, interpret=True):
    """``n`` decode steps (conv with window write, then the fused decode) from the case's pools;
    returns the final ``(state pool, window pool)``."""
    window, state = jnp.asarray(c["window"]), jnp.asarray(c["state"])
    slot = jnp.asarray(c["slot"])
    b = slot.shape[0]
    for r in range(n):
        conv, window = gdn_conv_rows(jnp.asarray(c["qkv"][:, r:r + 1]), jnp.asarray(c["weight"]),
                                     window, slot, jnp.ones((b,), jnp.int32),
                                     interpret=interpret)
        _, state = gdn_step(conv, jnp.asarray(c["a"][:, r:r + 1]),
                            jnp.asarray(c["b"][:, r:r + 1]), jnp.asarray(c["a_log"]),
                            jnp.asarray(c["dt_bias"]), jnp.ones((b, 1), bool), state, slot,
                            num_k_heads=hk, mode="decode", interpret=interpret)
    return state, window


def _commit_rows(c, n, hk, interpret=True):
    """A verify window of all T rows, committing the first ``n``; returns the pools."""
    window, state = jnp.asarray(c["window"]), jnp.asarray(c["state"])
    slot = jnp.asarray(c["slot"])
    b, t = c["qkv"].shape[:2]
    conv = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]), window, slot,
                         interpret=interpret)
    keep = jnp.broadcast_to(jnp.arange(t) < n, (b, t))
    state = gdn_step(conv, jnp.asarray(c["a"]), jnp.asarray(c["b"]), jnp.asarray(c["a_log"]),
                     jnp.asarray(c["dt_bias"]), keep, state, slot, num_k_heads=hk,
                     mode="commit", interpret=interpret)
    _, window = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]), window, slot,
                              jnp.full((b,), n, jnp.int32), interpret=interpret)
    return state, window


@pytest.mark.parametrize("n", [1, 3])
def test_commit_of_n_rows_equals_n_decode_steps(n):
    """Bitwise on the GPU (the test below), where every mode compiles the same per-row code;
    the interpreter's XLA fuses each program its own way, so here up to float32 rounding."""
    c = _case(4, 2, 4, 2, 4, 16, 32, dtype=ml_dtypes.bfloat16)
    state, window = _commit_rows(c, n, 2)
    state_d, window_d = _decode_steps(c, n, 2)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(window_d))
    np.testing.assert_allclose(np.asarray(state), np.asarray(state_d), rtol=1e-5, atol=1e-6)
    assert not np.array_equal(np.asarray(state), c["state"])


def _check_merged_layout(c, hk, interpret):
    """The kernels fed the merged in-projection's whole output ``[qkv | z | b | a]`` (``z``
    junk that must not be read) read their columns in place and match numpy."""
    bsz, t, _ = c["qkv"].shape
    hv = c["a"].shape[-1]
    junk = 50 * np.random.default_rng(8).standard_normal((bsz, t, 3 * hv + 5))
    wide = np.concatenate([c["qkv"], junk.astype(c["qkv"].dtype), c["b"], c["a"]], axis=-1)
    b_col = c["qkv"].shape[-1] + junk.shape[-1]
    length = np.full((bsz,), t - 1, np.int32)
    conv, window = gdn_conv_rows(jnp.asarray(wide), jnp.asarray(c["weight"]),
                                 jnp.asarray(c["window"]), jnp.asarray(c["slot"]),
                                 jnp.asarray(length), interpret=interpret)
    want = _np_conv(c["qkv"], c["weight"], c["window"], c["slot"], c["qkv"].dtype)
    _close(conv, want, rtol=2.0 ** -7, atol=2.0 ** -7)
    conv_std, window_std = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                                         jnp.asarray(c["window"]), jnp.asarray(c["slot"]),
                                         jnp.asarray(length), interpret=interpret)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(window_std))
    keep = np.ones((bsz, t), bool)
    o = gdn_step(conv, jnp.asarray(wide), jnp.asarray(wide), jnp.asarray(c["a_log"]),
                 jnp.asarray(c["dt_bias"]), jnp.asarray(keep), jnp.asarray(c["state"]),
                 jnp.asarray(c["slot"]), num_k_heads=hk, mode="verify", b_col=b_col,
                 a_col=b_col + hv, interpret=interpret)
    o_want, _ = _np_step(np.asarray(conv_std, np.float64), c["a"], c["b"], c["a_log"],
                         c["dt_bias"], keep, c["state"], c["slot"], hk)
    _close(o, o_want, rtol=1e-3, atol=1e-4)


def test_merged_layout_is_read_in_place():
    _check_merged_layout(_case(9, 2, 4, 2, 4, 16, 32, dtype=ml_dtypes.bfloat16), 2, True)


def test_bad_shapes_are_refused():
    c = _case(5, 2, 1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="mode"):
        gdn_step(jnp.zeros((2, 1, 96)), c["a"], c["b"], c["a_log"], c["dt_bias"],
                 jnp.ones((2, 1), bool), jnp.asarray(c["state"]), c["slot"], num_k_heads=2,
                 mode="prefill")
    with pytest.raises(ValueError, match="conv has shape"):
        gdn_step(jnp.zeros((2, 1, 80)), c["a"], c["b"], c["a_log"], c["dt_bias"],
                 jnp.ones((2, 1), bool), jnp.asarray(c["state"]), c["slot"], num_k_heads=2,
                 mode="verify")
    with pytest.raises(ValueError, match="window"):
        gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"])[:, :3],
                      jnp.asarray(c["window"]), c["slot"])
    with pytest.raises(ValueError, match="a has shape .* with a_col=1"):
        gdn_step(jnp.zeros((2, 1, 96)), c["a"], c["b"], c["a_log"], c["dt_bias"],
                 jnp.ones((2, 1), bool), jnp.asarray(c["state"]), c["slot"], num_k_heads=2,
                 mode="verify", a_col=1)


# A toy shape, and Qwen3.8-Flash-Next's GDN (qwen4_exp: 16 key / 48 value heads of 128, conv 4,
# a shift-register window) at 1 and 4 requests.
@pytest.mark.parametrize("bsz,hk,hv", [(2, 2, 4), (1, 16, 48), (4, 16, 48)])
def test_kernels_lower_to_triton(bsz, hk, hv):
    c = _case(6, bsz, 4, hk, hv, 128, 128, dtype=ml_dtypes.bfloat16)

    def fn(qkv, weight, window, a, b, a_log, dt_bias, state, slot):
        conv, window = gdn_conv_rows(qkv, weight, window, slot, jnp.full((bsz,), 2, jnp.int32),
                                     interpret=False)
        keep = jnp.ones(a.shape[:2], bool)
        o = gdn_step(conv, a, b, a_log, dt_bias, keep, state, slot, num_k_heads=hk,
                     mode="verify", interpret=False)
        state = gdn_step(conv, a, b, a_log, dt_bias, keep, state, slot, num_k_heads=hk,
                         mode="commit", interpret=False)
        o1, state = gdn_step(conv[:, :1], a[:, :1], b[:, :1], a_log, dt_bias, keep[:, :1],
                             state, slot, num_k_heads=hk, mode="decode", interpret=False)
        return o, o1, state, window

    text = lower_for_cuda(fn, *(jnp.asarray(c[k]) for k in (
        "qkv", "weight", "window", "a", "b", "a_log", "dt_bias", "state", "slot")))
    for name in ("gdn_conv_write", "gdn_fused_verify", "gdn_fused_commit", "gdn_fused_decode"):
        assert name in text
    # The merged layout (a wider, non-power-of-two input read at column offsets) lowers too.
    wide = jnp.concatenate([jnp.asarray(c[k]) for k in ("qkv", "b", "a")], axis=-1)
    cols = {"b_col": c["qkv"].shape[-1], "a_col": c["qkv"].shape[-1] + c["a"].shape[-1]}
    text = lower_for_cuda(
        lambda w, weight, window, a_log, dt_bias, state, slot: gdn_step(
            gdn_conv_rows(w, weight, window, slot, interpret=False), w, w, a_log, dt_bias,
            jnp.ones(w.shape[:2], bool), state, slot, num_k_heads=hk, mode="verify",
            interpret=False, **cols),
        wide, *(jnp.asarray(c[k]) for k in ("weight", "window", "a_log", "dt_bias", "state",
                                            "slot")))
    assert "gdn_fused_verify" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,hv", [(1, 16), (1, 48), (8, 32), (32, 48)])
def test_gpu_matches_numpy_and_commit_equals_decodes(b, hv):
    c = _case(7, b, 4, 16, hv, 128, 128, slots=b + 3, dtype=ml_dtypes.bfloat16)
    conv = np.asarray(gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                                    jnp.asarray(c["window"]), jnp.asarray(c["slot"])))
    _close(conv, _np_conv(c["qkv"], c["weight"], c["window"], c["slot"], ml_dtypes.bfloat16),
           rtol=2.0 ** -7, atol=2.0 ** -7)
    conv64 = conv.astype(np.float64)
    keep = np.ones((b, 4), bool)
    o = gdn_step(jnp.asarray(conv), jnp.asarray(c["a"]), jnp.asarray(c["b"]),
                 jnp.asarray(c["a_log"]), jnp.asarray(c["dt_bias"]), jnp.asarray(keep),
                 jnp.asarray(c["state"]), jnp.asarray(c["slot"]), num_k_heads=16, mode="verify")
    o_want, _ = _np_step(conv64, c["a"], c["b"], c["a_log"], c["dt_bias"], keep, c["state"],
                         c["slot"], 16)
    _close(o, o_want, rtol=1e-3, atol=1e-4)
    for got, want in zip(_commit_rows(c, 3, 16, False), _decode_steps(c, 3, 16, False)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.gpu
def test_gpu_merged_layout_is_read_in_place():
    _check_merged_layout(_case(10, 2, 4, 16, 32, 128, 128, slots=5, dtype=ml_dtypes.bfloat16),
                         16, False)


# ---- the ring conv state and the one-kernel decode (pallas_kernels.gdn.fused_decode) ----------


def _ring_case(seed, b, hk, hv, dk, dv, dtype, kernel=4, slots=7):
    """A case with a ring window ``[S, C, K]``, positions from 0 (partly before K-1) upwards,
    and request 1 not valid."""
    c = _case(seed, b, 1, hk, hv, dk, dv, kernel=kernel, slots=slots, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    c["window"] = rng.standard_normal((slots, c["qkv"].shape[-1], kernel)).astype(dtype)
    c["start"] = np.array([0, 5, 2, 9, 13, 3, 1][:b], np.int32)
    c["valid"] = np.arange(b)[:, None] != 1
    return c


def _np_ring_rows(c, hk, dtype):
    """float64 numpy of a ring case ``c`` (from the ring window's K-1 inputs before
    ``start``): ``(conv rows, outputs, new state pool)``."""
    conv = _np_conv(c["qkv"], c["weight"], _np_ordered(c["window"], c["slot"], c["start"]),
                    np.arange(c["qkv"].shape[0]), dtype)
    o, pool = _np_step(conv, c["a"], c["b"], c["a_log"], c["dt_bias"], c["valid"], c["state"],
                       c["slot"], hk)
    return conv, o, pool


def _np_ordered(ring, slot, start):
    """The K-1 inputs before ``start`` per request, oldest first (column p mod K holds p)."""
    kernel = ring.shape[-1]
    cols = (start[:, None] + 1 + np.arange(kernel - 1)[None, :]) % kernel
    return np.stack([ring[s][:, cols[i]] for i, s in enumerate(slot)])  # [B, C, K-1]


def _np_ring_after(ring, slot, start, valid, qkv):
    """The ring pool after one row per request: column ``start mod K`` of a valid row's slot
    takes its raw input; everything else is unchanged."""
    out = ring.copy()
    for i, s in enumerate(slot):
        if valid[i, 0]:
            out[s][:, start[i] % ring.shape[-1]] = qkv[i, 0, :ring.shape[1]]
    return out


def _merged(c, seed):
    """The case's rows as a merged in-projection output ``[qkv | z | b | a]`` (random z), its
    column offsets and the ``OutputNorm`` reading z there."""
    hv = c["a"].shape[-1]
    dv = c["state"].shape[-1]
    z = np.random.default_rng(seed).standard_normal(c["qkv"].shape[:2] + (hv * dv,))
    wide = np.concatenate([c["qkv"], z.astype(c["qkv"].dtype), c["b"], c["a"]], axis=-1)
    z_col = c["qkv"].shape[-1]
    cols = {"b_col": z_col + hv * dv, "a_col": z_col + hv * dv + hv}
    return wide, cols, OutputNorm(z_col=z_col, eps=1e-6)


def _np_gated_norm(o, z, weight, eps, dtype):
    """float64 ``norm(o) * w * silu(z)`` per head, rounded to ``dtype`` where the layer rounds:
    ``o [B, 1, Hv, Dv]``, ``z [B, 1, Hv * Dv]`` -> ``[B, 1, Hv * Dv]``."""
    o = np.asarray(o, np.float64)
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps)
    y = (y.astype(dtype).astype(np.float64) * weight.astype(np.float64)).astype(dtype)
    z = np.asarray(z, np.float64).reshape(o.shape)
    y = (y.astype(np.float64) * z / (1 + np.exp(-z))).astype(dtype)
    return y.reshape(z.shape[0], 1, -1)


def _ring_norm_check(c, hk, interpret, repeats=1):
    """The kernel with the output norm folded in against the kernel without it plus a float64
    gated norm of its output, for the case's state and a second one; ``sync`` comes back zero.
    Then ``repeats`` calls alternating the two states each give their state's first result
    bit for bit: a block that read another block's output before it was written would see the
    other state's (the previous call's buffer) or garbage."""
    wide, cols, norm = _merged(c, 21)
    dv = c["state"].shape[-1]
    weight = (1 + 0.2 * np.random.default_rng(22).standard_normal(dv)).astype(c["qkv"].dtype)
    sync = jnp.zeros((wide.shape[0], c["a"].shape[-1]), jnp.int32)
    ulp = 2.0 ** -7 if c["qkv"].dtype == ml_dtypes.bfloat16 else 1e-5
    first = []
    for state in (c["state"], 0.5 - c["state"]):
        args = [jnp.asarray(wide), *(jnp.asarray(c[k]) for k in ("weight", "window")),
                jnp.asarray(wide), jnp.asarray(wide),
                *(jnp.asarray(c[k]) for k in ("a_log", "dt_bias", "valid")), jnp.asarray(state),
                *(jnp.asarray(c[k]) for k in ("slot", "start"))]
        run = functools.partial(gdn_decode_ring, *args, num_k_heads=hk, interpret=interpret,
                                **cols)
        o, pool, window = run()
        y, pool_n, window_n, sync_out = run(output_norm=norm, norm_weight=jnp.asarray(weight),
                                            sync=sync)
        np.testing.assert_array_equal(np.asarray(sync_out), 0)
        np.testing.assert_array_equal(np.asarray(pool_n), np.asarray(pool))
        np.testing.assert_array_equal(np.asarray(window_n), np.asarray(window))
        want = _np_gated_norm(o, wide[..., norm.z_col:norm.z_col + o.shape[2] * dv], weight,
                              norm.eps, c["qkv"].dtype)
        _close(y, want.astype(np.float64), rtol=2 * ulp, atol=ulp / 8)
        first.append((functools.partial(run, output_norm=norm,
                                        norm_weight=jnp.asarray(weight), sync=sync),
                      np.asarray(y)))
    assert not np.array_equal(first[0][1], first[1][1])
    for i in range(repeats):
        call, y = first[i % 2]
        np.testing.assert_array_equal(np.asarray(call()[0]), y)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_ring_decode_folds_the_output_norm(dtype):
    _ring_norm_check(_ring_case(16, 5, 2, 4, 16, 32, dtype), 2, True)


def _ring_decode(c, hk, interpret, **kw):
    return gdn_decode_ring(*(jnp.asarray(c[k]) for k in (
        "qkv", "weight", "window", "a", "b", "a_log", "dt_bias", "valid", "state", "slot",
        "start")), num_k_heads=hk, interpret=interpret, **kw)


@pytest.mark.parametrize("hk,hv,dk,dv,block_v,dtype", [
    (2, 4, 16, 32, 16, np.float32),
    (1, 3, 32, 16, 16, ml_dtypes.bfloat16),
    (2, 2, 16, 32, 32, ml_dtypes.bfloat16),
])
def test_ring_decode_matches_numpy(hk, hv, dk, dv, block_v, dtype):
    """One kernel (conv on the ring, norms, gates, recurrence) against float64 numpy; the
    ring gets each valid row's raw input at column ``position mod K`` and nothing else."""
    b = 5
    c = _ring_case(11, b, hk, hv, dk, dv, dtype)
    o, pool, window = _ring_decode(c, hk, True, block_v=block_v)
    _, o_want, pool_want = _np_ring_rows(c, hk, dtype)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    _close(o, o_want, rtol=tol, atol=tol / 10)
    _close(pool, pool_want, rtol=tol, atol=tol / 10)
    np.testing.assert_array_equal(np.asarray(pool)[c["slot"][1]], c["state"][c["slot"][1]])
    untouched = np.setdiff1d(np.arange(c["state"].shape[0]), c["slot"])
    np.testing.assert_array_equal(np.asarray(pool)[untouched], c["state"][untouched])
    want_ring = _np_ring_after(c["window"], c["slot"], c["start"], c["valid"], c["qkv"])
    np.testing.assert_array_equal(np.asarray(window), want_ring)


def test_ring_conv_rows_match_numpy_and_the_decode_kernel():
    """``gdn_conv_rows`` on a ring: the conv against numpy, and after ``length`` rows column c
    holds the last row at a position = c (mod K); one row of it plus ``gdn_step`` equals the
    one-kernel decode."""
    c = _ring_case(12, 4, 2, 4, 16, 32, ml_dtypes.bfloat16)
    t = 6
    rng = np.random.default_rng(5)
    rows = rng.standard_normal((4, t, c["qkv"].shape[-1])).astype(ml_dtypes.bfloat16)
    length = np.array([6, 0, 3, 1], np.int32)
    slot, start = jnp.asarray(c["slot"]), jnp.asarray(c["start"])
    conv, window = gdn_conv_rows(jnp.asarray(rows), jnp.asarray(c["weight"]),
                                 jnp.asarray(c["window"]), slot, jnp.asarray(length),
                                 start=start, interpret=True)
    ordered = _np_ordered(c["window"], c["slot"], c["start"])
    want = _np_conv(rows, c["weight"], ordered, np.arange(4), ml_dtypes.bfloat16)
    _close(conv, want, rtol=2.0 ** -7, atol=2.0 ** -7)
    expect = c["window"].copy()
    for i, s in enumerate(c["slot"]):
        for r in range(length[i]):
            expect[s][:, (c["start"][i] + r) % 4] = rows[i, r]
    np.testing.assert_array_equal(np.asarray(window), expect)
    # One row through the two kernels gives the one-kernel decode's pools and outputs.
    one = jnp.asarray(c["valid"].sum(1).astype(np.int32))
    conv1, window1 = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                                   jnp.asarray(c["window"]), slot, one, start=start,
                                   interpret=True)
    o1, pool1 = gdn_step(conv1, jnp.asarray(c["a"]), jnp.asarray(c["b"]),
                         jnp.asarray(c["a_log"]), jnp.asarray(c["dt_bias"]),
                         jnp.asarray(c["valid"]), jnp.asarray(c["state"]), slot, num_k_heads=2,
                         mode="decode", interpret=True)
    o, pool, window = _ring_decode(c, 2, True)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(window1))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool1), rtol=1e-5, atol=1e-6)


def test_ring_refusals():
    c = _ring_case(13, 2, 2, 2, 16, 16, np.float32)
    with pytest.raises(ValueError, match="ring .*pass start"):
        gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                      jnp.asarray(c["window"]), jnp.asarray(c["slot"]))
    bad = dict(c, window=c["window"][..., :3])
    with pytest.raises(ValueError, match="has 3 columns; this kernel needs a ring"):
        _ring_decode(bad, 2, True)
    with pytest.raises(ValueError, match="start is"):
        _ring_decode(dict(c, start=c["start"][:1]), 2, True)
    with pytest.raises(ValueError, match="block_v=24 must be a power of two"):
        _ring_decode(c, 2, True, block_v=24)
    norm = OutputNorm(z_col=0, eps=1e-6)
    with pytest.raises(ValueError, match="needs sync, int32 zeros"):
        _ring_decode(c, 2, True, output_norm=norm, norm_weight=jnp.ones((16,)))
    with pytest.raises(ValueError, match="needs norm_weight"):
        _ring_decode(c, 2, True, output_norm=norm, sync=jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="'relu' must be 'silu' or 'sigmoid'"):
        _ring_decode(c, 2, True, output_norm=OutputNorm(0, 1e-6, "relu"),
                     norm_weight=jnp.ones((16,)), sync=jnp.zeros((2, 2), jnp.int32))


@pytest.mark.parametrize("hk,hv", [(16, 16), (16, 48), (16, 32)])  # 2B, 27B, 35B-A3B
def test_ring_decode_lowers_to_triton(hk, hv):
    c = _ring_case(14, 2, hk, hv, 128, 128, ml_dtypes.bfloat16)
    wide, cols, norm = _merged(c, 1)
    text = lower_for_cuda(
        lambda w, weight, window, a_log, dt_bias, valid, state, slot, start, nw: (
            gdn_decode_ring(w, weight, window, w, w, a_log, dt_bias, valid, state, slot, start,
                            num_k_heads=hk, interpret=False, **cols),
            gdn_decode_ring(w, weight, window, w, w, a_log, dt_bias, valid, state, slot, start,
                            num_k_heads=hk, interpret=False, output_norm=norm, norm_weight=nw,
                            sync=jnp.zeros((2, hv), jnp.int32), **cols)),
        jnp.asarray(wide), *(jnp.asarray(c[k]) for k in (
            "weight", "window", "a_log", "dt_bias", "valid", "state", "slot", "start")),
        jnp.ones((128,), jnp.bfloat16))
    assert "gdn_fused_decode_ring_norm" in text and "output_operand_aliases" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,hv", [(1, 16), (1, 48), (8, 32), (32, 16)])
def test_gpu_ring_decode(b, hv):
    """Compiled: against numpy, and against the two-kernel ring path (same per-row code)."""
    c = _ring_case(15, b, 16, hv, 128, 128, ml_dtypes.bfloat16, slots=b + 3)
    c["start"] = np.random.default_rng(b).integers(0, 3000, b).astype(np.int32)
    c["slot"] = np.random.default_rng(b + 1).permutation(np.arange(1, b + 3))[:b].astype(np.int32)
    o, pool, window = _ring_decode(c, 16, False)
    _, o_want, pool_want = _np_ring_rows(c, 16, ml_dtypes.bfloat16)
    _close(o, o_want, rtol=2e-2, atol=2e-3)
    _close(pool, pool_want, rtol=2e-2, atol=2e-3)
    np.testing.assert_array_equal(
        np.asarray(window), _np_ring_after(c["window"], c["slot"], c["start"], c["valid"],
                                           c["qkv"]))
    slot, start = jnp.asarray(c["slot"]), jnp.asarray(c["start"])
    conv1, window1 = gdn_conv_rows(jnp.asarray(c["qkv"]), jnp.asarray(c["weight"]),
                                   jnp.asarray(c["window"]), slot,
                                   jnp.asarray(c["valid"].sum(1).astype(np.int32)), start=start)
    o1, pool1 = gdn_step(conv1, jnp.asarray(c["a"]), jnp.asarray(c["b"]),
                         jnp.asarray(c["a_log"]), jnp.asarray(c["dt_bias"]),
                         jnp.asarray(c["valid"]), jnp.asarray(c["state"]), slot, num_k_heads=16,
                         mode="decode")
    np.testing.assert_array_equal(np.asarray(window), np.asarray(window1))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(pool), np.asarray(pool1), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("b,hv", [(1, 16), (8, 48), (32, 32)])
def test_gpu_ring_decode_folds_the_output_norm(b, hv):
    """Compiled, where the last block of a head to finish (an atomic counter) reads the other
    blocks' outputs: against the unfolded kernel plus a float64 gated norm, and 20 calls
    alternating two states give their own results bit for bit."""
    c = _ring_case(17, b, 16, hv, 128, 128, ml_dtypes.bfloat16, slots=b + 3)
    c["start"] = np.random.default_rng(b).integers(0, 3000, b).astype(np.int32)
    c["slot"] = np.random.default_rng(b + 1).permutation(np.arange(1, b + 3))[:b].astype(np.int32)
    _ring_norm_check(c, 16, False, repeats=20)
