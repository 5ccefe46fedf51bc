"""The hyper-connection mix kernels (pallas_kernels.hyper) against a float64 numpy derivation
and the XLA reference (interpret mode on the CPU, and their Triton lowering);
the model's GatedResidual with the kernels against its XLA composition."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.hyper import (HyperTiles, hyper_mix, hyper_mix_reference, stream_rsqrt,
                                  supports, unsupported)
from tests.helpers.triton_lowering import lower_for_cuda

EPS = 1e-6
HC, H, R = 4, 64, 32
TILES = HyperTiles(bn=4, bk=32, bj=16, bkr=16)


def _inputs(rows, dtype, seed, pending=True, inj=True):
    rng = np.random.default_rng(seed)
    f = lambda *s, sc=1.0: jnp.asarray(sc * rng.standard_normal(s).astype(np.float32), dtype)
    h = f(rows, HC * H, sc=2.0)
    pend = (f(rows, HC, sc=0.7), f(rows, H)) if pending else None
    return h, pend, f(HC * H, sc=0.3), f(R, HC * H, sc=0.1), (
        f(HC, HC * H, sc=0.1) if inj else None), f(HC * H, R, sc=0.3)


def _numpy(h, pend, nw, wd, wi, wu):
    """float64 derivation from MODEL_FACTS.md's formulas (no intermediate rounding)."""
    f = lambda a: np.asarray(a, np.float64)
    h = f(h)
    rows = h.shape[0]
    if pend is not None:
        h = h + (f(pend[0])[:, :, None] * f(pend[1])[:, None, :]).reshape(rows, -1)
    hs = h.reshape(rows, HC, H)
    hn = (hs / np.sqrt(np.mean(hs * hs, -1, keepdims=True) + EPS)).reshape(rows, -1)
    hn = hn * (1 + f(nw))
    sig = lambda a: 1 / (1 + np.exp(-a))
    d = hn @ f(wd).T / HC
    mix = sig((d * sig(d)) @ f(wu).T)
    x = np.mean((mix * hn).reshape(rows, HC, H), axis=1)
    inj = None if wi is None else 2 * sig(hn @ f(wi).T / HC)
    return h, x, inj


@pytest.mark.parametrize("rows,pending,inj", [(1, False, True), (3, True, True),
                                              (2, True, False)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_match_numpy_and_xla(rows, pending, inj, dtype):
    args = _inputs(rows, dtype, seed=rows, pending=pending, inj=inj)
    got = hyper_mix(*args, hc=HC, eps=EPS, tiles=TILES, interpret=True)
    ref = hyper_mix_reference(*args, hc=HC, eps=EPS)
    exact = _numpy(*args)
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
    for name, g, r, e in zip(("h", "x", "inj"), got, ref, exact):
        if e is None:
            assert g is None and r is None
            continue
        assert g.dtype == dtype and g.shape == r.shape, name
        g = np.asarray(g, np.float32)
        np.testing.assert_allclose(g, np.asarray(r, np.float32), rtol=tol, atol=tol,
                                   err_msg=name)
        np.testing.assert_allclose(g, e, rtol=tol, atol=tol, err_msg=name)


def test_rows_are_independent_and_leading_axes_kept():
    """A verify window (several rows) gives each row what a one-row call gives it."""
    h, pend, nw, wd, wi, wu = _inputs(4, jnp.float32, seed=9)
    many = hyper_mix(h.reshape(2, 2, -1), (pend[0].reshape(2, 2, -1), pend[1].reshape(2, 2, -1)),
                     nw, wd, wi, wu, hc=HC, eps=EPS, tiles=TILES, interpret=True)
    assert [a.shape for a in many] == [(2, 2, HC * H), (2, 2, H), (2, 2, HC)]
    one = hyper_mix(h[2:3], (pend[0][2:3], pend[1][2:3]), nw, wd, wi, wu, hc=HC, eps=EPS,
                    tiles=TILES, interpret=True)
    for a, b in zip(many, one):
        np.testing.assert_allclose(np.asarray(a).reshape(4, -1)[2], np.asarray(b)[0],
                                   rtol=1e-6, atol=1e-6)


def test_stream_statistics_are_per_stream():
    h = jnp.concatenate([jnp.full((1, H), 2.0), jnp.full((1, H), 0.5),
                         jnp.ones((1, 2 * H))], axis=1)
    np.testing.assert_allclose(np.asarray(stream_rsqrt(h, HC, 0.0))[0], [0.5, 2, 1, 1])


def test_kernels_lower_to_triton():
    args = _inputs(4, jnp.bfloat16, seed=1)
    tiles = HyperTiles(bn=4, bk=32, bj=8, bkr=16)
    text = lower_for_cuda(lambda *a: hyper_mix(*a, hc=HC, eps=EPS, tiles=tiles,
                                               interpret=False), *args)
    assert text.count("hyper_down") and text.count("hyper_up")


def test_supports_and_refusals():
    assert supports(1, 4, 2560, 320) and supports(8, 4, 2560, 320)
    assert not supports(9, 4, 2560, 320)  # more rows than unrolled: XLA
    assert not supports(1, 3, 2560, 320)  # streams not a power of two
    assert not supports(1, 4, 2560, 8)  # rank below a 16-wide block
    assert unsupported(1, 4, 2560, 8) == ("hc_lowrank 8 is not a multiple of 16 of at most 16 "
                                          "steps of 8 columns")
    assert "hidden_size 72 " in unsupported(1, 4, 72, 320)
    h, pend, nw, wd, wi, wu = _inputs(1, jnp.float32, seed=2)
    with pytest.raises(ValueError, match="do not fit"):
        hyper_mix(h, pend, nw, wd[:, :-1], wi, wu, hc=HC, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="not a shape the kernels take: 9 rows"):
        hyper_mix(jnp.tile(h, (9, 1)), None, nw, wd, wi, wu, hc=HC, eps=EPS, interpret=True)


def test_gated_residual_runs_the_kernels_as_its_xla_composition():
    """The model's module: ``mix`` with the kernels (the pending inject folded in) equals
    the XLA composition (inject, then the mix), and calls of more rows take XLA."""
    from flax import nnx

    from mtp_jax.models.qwen4_exp.hyper_connection import GatedResidual, inject

    h, pend, nw, wd, wi, wu = _inputs(2, jnp.float32, seed=4)
    mods = []
    for backend in ("xla", "pallas"):
        m = GatedResidual(HC, H, R, EPS, jnp.float32, backend=backend)
        m.hc_norm.weight = nnx.Param(nw)
        m.input_mix_weight_down.weight = nnx.Param(wd)
        m.input_mix_weight_up.weight = nnx.Param(wu)
        m.block_inject_weight.weight = nnx.Param(wi)
        mods.append(m)
    calls = []
    for m in mods:
        calls.append(m.mix(h, pend))
    assert mods[1]._kernel_applies(h) and not mods[0]._kernel_applies(h)
    assert not mods[1]._kernel_applies(jnp.tile(h, (5, 1)))  # 10 rows: XLA
    np.testing.assert_allclose(np.asarray(calls[0][0]), np.asarray(inject(h, *pend)),
                               rtol=0, atol=0)
    for a, b in zip(calls[0], calls[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
