"""The one-kernel verify on a ring conv window (``pallas_kernels.gdn.fused_verify``) and the
commit that writes the ring in the same kernel (``gdn_step(mode="commit", ring=...)``),
against a float64 numpy re-derivation of the layer's step form (HF ``Qwen3_5GatedDeltaNet``),
against the two-kernel path they replace (``gdn_conv_rows`` + ``gdn_step``), and the
exactness rule: a verify window's commit of n rows gives the state of n decode steps.

Also the verify with the layer's gated output norm folded in (``output_norm``) against a float64
gated norm of the unfolded kernel's output, and ``GatedDeltaNet.verify`` on it against the XLA
backend's verify.

CPU: interpret-mode numerics and the Triton lowering; GPU (``-m gpu``): compiled at real shapes.
Inputs are fresh random values (never zeros); slots are in random order with untouched slots
between them; starts put row 0 at every column of the ring.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.gdn.fused import gdn_conv_rows, gdn_step
from pallas_kernels.gdn.fused_decode import gdn_decode_ring
from pallas_kernels.gdn.fused_verify import gdn_verify_ring
from tests.helpers.triton_lowering import lower_for_cuda
from tests.kernels.test_pallas_gdn_fused import _case, _close, _merged, _np_ring_rows, _np_step
from tests.models.test_gdn_decode import tiny  # noqa: F401 (fixture)

BF16 = ml_dtypes.bfloat16


def _window_case(seed, b, t, hk, hv, dk, dv, dtype, slots=None, kernel=4):
    """``t`` rows per request on a ring ``[S, C, K]``; request 1 has no valid row, the others
    all rows valid; starts cover every column of the ring."""
    slots = slots or b + 3
    c = _case(seed, b, t, hk, hv, dk, dv, kernel=kernel, slots=slots, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    c["window"] = rng.standard_normal((slots, c["qkv"].shape[-1], kernel)).astype(dtype)
    c["start"] = (np.arange(b) * 5 + rng.integers(0, 3000)).astype(np.int32)
    c["valid"] = np.repeat((np.arange(b) != 1)[:, None], t, axis=1)
    return c


def _args(c, *names):
    return [jnp.asarray(c[k]) for k in names]


def _verify(c, hk, interpret, **kw):
    return gdn_verify_ring(*_args(c, "qkv", "weight", "window", "a", "b", "a_log", "dt_bias",
                                  "valid", "state", "slot", "start"),
                           num_k_heads=hk, interpret=interpret, **kw)


def _two_kernel_verify(c, hk, interpret, **kw):
    slot, start = _args(c, "slot", "start")
    conv = gdn_conv_rows(*_args(c, "qkv", "weight", "window"), slot, start=start,
                         interpret=interpret)
    o = gdn_step(conv, *_args(c, "a", "b", "a_log", "dt_bias", "valid", "state"), slot,
                 num_k_heads=hk, mode="verify", interpret=interpret, **kw)
    return o, conv


def _keep(c, length):
    return c["valid"] & (np.arange(c["valid"].shape[1])[None, :] < length[:, None])


def _commit(c, conv, length, hk, interpret, **kw):
    ring = (*_args(c, "qkv", "window", "start"), jnp.asarray(length))
    return gdn_step(conv, *_args(c, "a", "b", "a_log", "dt_bias"), jnp.asarray(_keep(c, length)),
                    *_args(c, "state", "slot"), num_k_heads=hk, mode="commit", ring=ring,
                    interpret=interpret, **kw)


def _np_ring_commit(c, length):
    """The ring after writing each request's first ``length`` rows (column p mod K holds
    position p), valid or not, as the XLA path's window does."""
    out = c["window"].copy()
    kernel = out.shape[-1]
    for i, s in enumerate(c["slot"]):
        for r in range(length[i]):
            out[s][:, (c["start"][i] + r) % kernel] = c["qkv"][i, r, :out.shape[1]]
    return out


def _check_verify(c, hk, interpret, dtype, **kw):
    """The verify's outputs and conv rows against numpy and the two-kernel path."""
    o, conv = _verify(c, hk, interpret, **kw)
    conv_want, o_want, _ = _np_ring_rows(c, hk, dtype)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    _close(conv, conv_want, rtol=tol, atol=tol / 10)
    _close(o, o_want, rtol=tol, atol=tol / 10)
    o2, conv2 = _two_kernel_verify(c, hk, interpret, **kw)
    np.testing.assert_allclose(np.asarray(conv, np.float32), np.asarray(conv2, np.float32),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(o), np.asarray(o2), rtol=1e-5, atol=1e-6)
    return conv


def _check_commit(c, conv, length, hk, interpret, dtype, **kw):
    """The commit's pools against numpy and the two-kernel path (state bit for bit: the same
    kernel code)."""
    b = c["qkv"].shape[0]
    state, window = _commit(c, conv, length, hk, interpret, **kw)
    keep = _keep(c, length)
    conv64 = np.asarray(conv, np.float64)
    _, pool_want = _np_step(conv64, c["a"], c["b"], c["a_log"], c["dt_bias"], keep,
                            c["state"], c["slot"], hk)
    tol = 1e-4 if dtype == np.float32 else 2e-2
    _close(state, pool_want, rtol=tol, atol=tol / 10)
    np.testing.assert_array_equal(np.asarray(window), _np_ring_commit(c, length))
    untouched = np.setdiff1d(np.arange(c["state"].shape[0]), c["slot"][c["valid"][:, 0]])
    np.testing.assert_array_equal(np.asarray(state)[untouched], c["state"][untouched])
    slot = jnp.asarray(c["slot"])
    old_state = gdn_step(conv, *_args(c, "a", "b", "a_log", "dt_bias"), jnp.asarray(keep),
                         *_args(c, "state"), slot, num_k_heads=hk, mode="commit",
                         interpret=interpret, **kw)
    _, old_window = gdn_conv_rows(*_args(c, "qkv", "weight", "window"), slot,
                                  jnp.asarray(length), start=jnp.asarray(c["start"]),
                                  interpret=interpret)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(old_state))
    np.testing.assert_array_equal(np.asarray(window), np.asarray(old_window))
    assert b == len(length)
    return state, window


@pytest.mark.parametrize("t,hk,hv,dk,dv,block_v,dtype", [
    (4, 2, 4, 16, 32, 16, np.float32),
    (4, 1, 3, 32, 16, 16, BF16),
    (6, 2, 2, 16, 32, 32, BF16),  # more rows than the ring's K = 4 columns
])
def test_ring_verify_and_commit_match_numpy_and_the_two_kernel_path(t, hk, hv, dk, dv,
                                                                     block_v, dtype):
    b = 5
    c = _window_case(21, b, t, hk, hv, dk, dv, dtype)
    c["valid"][4, 1:] = False  # valid rows inside length: the state takes row 0, the ring all
    conv = _check_verify(c, hk, True, dtype, block_v=block_v)
    length = np.array([t, t, 0, 1, t - 1], np.int32)
    _check_commit(c, conv, length, hk, True, dtype, block_v=block_v)


def test_merged_layout_and_a_shared_trash_slot():
    """The merged in-projection's output ``[qkv | z | b | a]`` read in place at column
    offsets (N > C), and two padding requests on the trash slot 0: the same results as the
    separate arrays, slot 0 unchanged in both pools."""
    hk, t = 2, 4
    c = _window_case(26, 4, t, hk, 4, 16, 32, BF16)
    c["slot"][[1, 3]] = 0
    c["valid"][[1, 3]] = False
    length = np.array([3, 0, 4, 0], np.int32)
    o, conv = _verify(c, hk, True)
    state, window = _commit(c, conv, length, hk, True)
    wide, cols, _ = _merged(c, 3)
    w = dict(c, qkv=wide, a=wide, b=wide)
    o2, conv2 = _verify(w, hk, True, **cols)
    state2, window2 = _commit(w, conv2, length, hk, True, **cols)
    for got, want in ((o2, o), (conv2, conv), (state2, state), (window2, window)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(state2)[0], c["state"][0])
    np.testing.assert_array_equal(np.asarray(window2)[0], c["window"][0])
    np.testing.assert_array_equal(np.asarray(window2), _np_ring_commit(w, length))


def test_ring_commit_equals_decode_steps():
    """Verify + commit of n rows gives the pools of n one-kernel decode steps."""
    hk, t = 2, 4
    c = _window_case(22, 3, t, hk, 4, 16, 32, BF16)
    c["valid"][:] = True
    conv = gdn_verify_ring(*_args(c, "qkv", "weight", "window", "a", "b", "a_log", "dt_bias",
                                  "valid", "state", "slot", "start"),
                           num_k_heads=hk, interpret=True)[1]
    length = np.array([3, 4, 2], np.int32)
    state, window = _commit(c, conv, length, hk, True)
    d = dict(c)
    for r in range(t):
        row = lambda x: x[:, r:r + 1]
        valid = (r < length)[:, None]
        _, d["state"], d["window"] = gdn_decode_ring(
            jnp.asarray(row(c["qkv"])), *_args(d, "weight", "window"), jnp.asarray(row(c["a"])),
            jnp.asarray(row(c["b"])), *_args(d, "a_log", "dt_bias"), jnp.asarray(valid),
            *_args(d, "state", "slot"), jnp.asarray(c["start"] + r), num_k_heads=hk,
            interpret=True)
    np.testing.assert_array_equal(np.asarray(window), np.asarray(d["window"]))
    np.testing.assert_allclose(np.asarray(state), np.asarray(d["state"]), rtol=1e-5, atol=1e-6)


def test_ring_verify_and_commit_refusals():
    c = _window_case(23, 2, 4, 2, 2, 16, 16, np.float32)
    with pytest.raises(ValueError, match="has 3 columns; this kernel needs a ring"):
        _verify(dict(c, window=c["window"][..., :3]), 2, True)
    with pytest.raises(ValueError, match="valid is"):
        _verify(dict(c, valid=c["valid"][:, :2]), 2, True)
    slot = jnp.asarray(c["slot"])
    conv = gdn_conv_rows(*_args(c, "qkv", "weight", "window"), slot,
                         start=jnp.asarray(c["start"]), interpret=True)
    step_args = (conv, *_args(c, "a", "b", "a_log", "dt_bias", "valid", "state"), slot)
    ring = tuple(_args(c, "qkv", "window", "start"))
    with pytest.raises(ValueError, match="ring is for mode='commit' only"):
        gdn_step(*step_args, num_k_heads=2, mode="verify", ring=ring, interpret=True)
    with pytest.raises(ValueError, match="pass \\(qkv, window, start, length\\)"):
        gdn_step(*step_args, num_k_heads=2, mode="commit", ring=ring, interpret=True)
    length = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match="do not fit conv"):
        gdn_step(*step_args, num_k_heads=2, mode="commit", ring=(ring[0][:, :2], *ring[1:],
                                                                 length), interpret=True)
    with pytest.raises(ValueError, match="do not fit conv"):  # a window pool of other slots
        gdn_step(*step_args, num_k_heads=2, mode="commit",
                 ring=(ring[0], ring[1][:3], ring[2], length), interpret=True)
    with pytest.raises(ValueError, match="qkv has 8 columns; the conv inputs need"):
        _verify(dict(c, qkv=c["qkv"][..., :8]), 2, True)


@pytest.mark.parametrize("hk,hv", [(16, 48)])  # 27B (2B and 35B-A3B: the GPU test)
def test_ring_verify_and_commit_lower_to_triton(hk, hv):
    c = _window_case(24, 1, 4, hk, hv, 128, 128, BF16)
    text = lower_for_cuda(
        lambda qkv, weight, window, a, b, a_log, dt_bias, valid, state, slot, start: (
            gdn_step(gdn_verify_ring(qkv, weight, window, a, b, a_log, dt_bias, valid, state,
                                     slot, start, num_k_heads=hk, interpret=False)[1],
                     a, b, a_log, dt_bias, valid, state, slot, num_k_heads=hk, mode="commit",
                     ring=(qkv, window, start, jnp.sum(valid, axis=1, dtype=jnp.int32)),
                     interpret=False)),
        *_args(c, "qkv", "weight", "window", "a", "b", "a_log", "dt_bias", "valid", "state",
               "slot", "start"))
    assert "gdn_fused_verify_ring" in text and "gdn_fused_commit_ring" in text
    assert "output_operand_aliases" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,hv", [(1, 16), (1, 48), (8, 32), (32, 16)])
def test_gpu_ring_verify_and_commit(b, hv):
    """Compiled at real head sizes: against numpy and the two-kernel path."""
    t = 4
    c = _window_case(25, b, t, 16, hv, 128, 128, BF16)
    conv = _check_verify(c, 16, False, BF16)
    length = np.random.default_rng(b).integers(0, t + 1, b).astype(np.int32)
    _check_commit(c, conv, length, 16, False, BF16)


# ---- the folded output norm (gdn_verify_ring with output_norm) ---------------------------------


def _np_gated_norm_rows(o, z, weight, eps, act, dtype):
    """float64 ``norm(o) * w * act(z)`` per head and row, rounded to ``dtype`` where the layer
    rounds (``GatedDeltaNet._output``): ``o [B, T, Hv, Dv]``, ``z [B, T, Hv * Dv]`` -> ``[B, T,
    Hv * Dv]``."""
    o = np.asarray(o, np.float64)
    y = o / np.sqrt(np.mean(o * o, -1, keepdims=True) + eps)
    y = (y.astype(dtype).astype(np.float64) * weight.astype(np.float64)).astype(dtype)
    z = np.asarray(z, np.float64).reshape(o.shape)
    gate = 1 / (1 + np.exp(-z))
    y = (y.astype(np.float64) * (gate if act == "sigmoid" else z * gate)).astype(dtype)
    return y.reshape(o.shape[:2] + (-1,)).astype(np.float64)


def _norm_case(seed, b, t, hk, hv, dk, dv, dtype, act, slots=None):
    """A window case in the merged layout ``[qkv | z | b | a]``: ``(case, column kwargs, norm,
    norm weight)``."""
    c = _window_case(seed, b, t, hk, hv, dk, dv, dtype, slots=slots)
    wide, cols, norm = _merged(c, seed + 1)
    weight = (1 + 0.2 * np.random.default_rng(seed + 2).standard_normal(dv)).astype(dtype)
    return dict(c, qkv=wide, a=wide, b=wide), cols, dataclasses.replace(norm, act=act), weight


def _verify_norm_check(c, cols, norm, weight, hk, interpret, repeats=1):
    """The folded verify against the unfolded one plus a float64 gated norm of its output
    (the conv rows bit for bit, ``sync`` back to zero), for the case's state and a second one.
    Then ``repeats`` calls alternating the two states each give their state's first result
    bit for bit: a program that read another's output before it was written would see the
    other state's (the previous call's buffer) or garbage."""
    bsz, t, _ = c["qkv"].shape
    hv, dv = c["state"].shape[1], c["state"].shape[-1]
    sync = jnp.zeros((bsz, hv), jnp.int32)
    ulp = 2.0 ** -7 if c["qkv"].dtype == BF16 else 1e-5
    folded, first = dict(output_norm=norm, norm_weight=jnp.asarray(weight), sync=sync), []
    for state in (c["state"], 0.5 - c["state"]):
        run = functools.partial(_verify, dict(c, state=state), hk, interpret, **cols)
        o, conv = run()
        y, conv_n, sync_out = run(**folded)
        assert y.shape == (bsz, t, hv * dv) and y.dtype == c["qkv"].dtype
        np.testing.assert_array_equal(np.asarray(sync_out), 0)
        np.testing.assert_array_equal(np.asarray(conv_n), np.asarray(conv))
        z = c["qkv"][..., norm.z_col:norm.z_col + hv * dv]
        want = _np_gated_norm_rows(o, z, weight, norm.eps, norm.act, c["qkv"].dtype)
        _close(y, want, rtol=2 * ulp, atol=ulp / 8)
        first.append((functools.partial(run, **folded), np.asarray(y)))
    assert not np.array_equal(first[0][1], first[1][1])
    for i in range(repeats):
        call, y = first[i % 2]
        np.testing.assert_array_equal(np.asarray(call()[0]), y)


@pytest.mark.parametrize("act,dtype", [("silu", BF16), ("sigmoid", np.float32)])
def test_ring_verify_folds_the_output_norm(act, dtype):
    """T = 3 rows (padded to 4 inside), request 1 without valid rows and request 3 padding on
    the trash slot 0 as well."""
    c, cols, norm, weight = _norm_case(31, 4, 3, 2, 4, 16, 32, dtype, act)
    c["slot"][[1, 3]] = 0
    c["valid"][[1, 3]] = False
    c["valid"][2, 1] = False  # a hole inside a window
    _verify_norm_check(c, cols, norm, weight, 2, True)


def test_ring_verify_norm_refusals():
    c, cols, norm, weight = _norm_case(32, 2, 3, 2, 2, 16, 16, np.float32, "silu")
    run = functools.partial(_verify, c, 2, True, **cols)
    nw, sync = jnp.asarray(weight), jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="gdn_verify_ring: output_norm needs norm_weight"):
        run(output_norm=norm, norm_weight=nw[:8], sync=sync)
    with pytest.raises(ValueError, match="gdn_verify_ring: output_norm needs sync, int32"):
        run(output_norm=norm, norm_weight=nw, sync=sync[:1])
    with pytest.raises(ValueError, match="needs sync, int32"):
        run(output_norm=norm, norm_weight=nw, sync=sync.astype(jnp.float32))
    with pytest.raises(ValueError, match="needs sync, int32"):
        run(output_norm=norm, norm_weight=nw)
    n = c["qkv"].shape[-1]
    with pytest.raises(ValueError, match=f"output_norm.z_col={n - 8} .* outside the {n} col"):
        run(output_norm=dataclasses.replace(norm, z_col=n - 8), norm_weight=nw, sync=sync)
    with pytest.raises(ValueError, match="output_norm.z_col=-1"):
        run(output_norm=dataclasses.replace(norm, z_col=-1), norm_weight=nw, sync=sync)
    with pytest.raises(ValueError, match="output_norm.act 'relu' must be"):
        run(output_norm=dataclasses.replace(norm, act="relu"), norm_weight=nw, sync=sync)


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_layer_verify_folds_the_norm_and_matches_xla(tiny, act):  # noqa: F811
    """``GatedDeltaNet.verify`` on pools with a ring conv state and the merged in-projection:
    the pallas backend (one kernel, norm folded in) against the XLA backend, with and without
    a ``sync`` in the state (given back zero); a padding request on the trash slot 0."""
    from tests.helpers.model_backends import with_backend

    layers = {k: with_backend(tiny, "gdn", k).layers[0].linear_attn for k in ("pallas", "xla")}
    for layer in layers.values():
        layer.output_gate = act
    gdn = layers["pallas"]
    assert gdn.in_proj is not None
    rng = np.random.default_rng(33)
    b, t, slots = 3, 3, 6
    conv_dim = gdn.conv1d.weight.shape[0]
    pools = (jnp.asarray(0.3 * rng.standard_normal((slots, gdn.hv, gdn.dk, gdn.dv)), jnp.float32),
             jnp.asarray(rng.standard_normal((slots, conv_dim, gdn.kernel)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((b, t, tiny.cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray([[True] * t, [False] * t, [True, True, False]])
    slot = jnp.asarray([4, 0, 2], jnp.int32)
    start = jnp.asarray([7, 0, 2], jnp.int32)
    sync = jnp.zeros((b, gdn.hv), jnp.int32)
    out, (rows, sync_out) = gdn.verify(x, (*pools, sync), valid, slot, start)
    out2, rows2 = gdn.verify(x, pools, valid, slot, start)
    want, (_, sync_x) = layers["xla"].verify(x, (*pools, sync), valid, slot, start)
    np.testing.assert_array_equal(np.asarray(sync_out), 0)
    assert sync_x is sync
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(rows2.conv), np.asarray(rows.conv))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-4, atol=1e-5)
    # The same as the unfolded kernel followed by the XLA norm (GatedDeltaNet._output).
    o, _ = gdn_verify_ring(rows.qkv, gdn._conv_weight(), pools[1], rows.a, rows.b,
                           gdn.A_log[...], gdn.dt_bias[...], valid, pools[0], slot, start,
                           num_k_heads=gdn.hk, interpret=True, **gdn._gate_cols())
    np.testing.assert_allclose(np.asarray(gdn._output(o, rows.qkv[..., gdn.in_proj.offsets[1]:
                                                                   gdn.in_proj.offsets[2]])),
                               np.asarray(out), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hk,hv", [(16, 48)])  # 27B
def test_ring_verify_with_the_norm_lowers_to_triton(hk, hv):
    c, cols, norm, _ = _norm_case(34, 2, 4, hk, hv, 128, 128, BF16, "silu")
    text = lower_for_cuda(
        lambda w, weight, window, a_log, dt_bias, valid, state, slot, start, nw, sync: (
            gdn_verify_ring(w, weight, window, w, w, a_log, dt_bias, valid, state, slot, start,
                            num_k_heads=hk, interpret=False, output_norm=norm, norm_weight=nw,
                            sync=sync, **cols)),
        *_args(c, "qkv", "weight", "window", "a_log", "dt_bias", "valid", "state", "slot",
               "start"), jnp.ones((128,), jnp.bfloat16), jnp.zeros((2, hv), jnp.int32))
    assert "gdn_fused_verify_ring_norm" in text and "output_operand_aliases" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,act", [(1, "silu"), (8, "silu"), (8, "sigmoid")])
def test_gpu_ring_verify_folds_the_output_norm(b, act):
    """Compiled at the 27B shape (Hk=16, Hv=48, Dk=Dv=128, T=4), where the last program of a
    head to finish (an atomic counter) reads the other programs' output rows: against the
    unfolded kernel plus a float64 gated norm, and 20 calls alternating two states give their
    own results bit for bit. Only this test can catch a broken counter protocol (e.g. the
    first program to arrive taking the norm): interpret mode runs the programs one after
    another, so there the last one to run always sees every block written."""
    c, cols, norm, weight = _norm_case(35, b, 4, 16, 48, 128, 128, BF16, act, slots=b + 3)
    c["start"] = np.random.default_rng(b).integers(0, 3000, b).astype(np.int32)
    c["slot"] = np.random.default_rng(b + 1).permutation(np.arange(1, b + 3))[:b].astype(np.int32)
    _verify_norm_check(c, cols, norm, weight, 16, False, repeats=20)
