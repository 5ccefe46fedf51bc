"""The quantized few-row projection kernel (:mod:`pallas_kernels.quant.gemv`) in interpret mode
on the CPU: against a float64 numpy re-derivation of the fp8 / nvfp4 forms (written from their
description, not from ``dequantize``), against the XLA composition, and weight for weight
(one-hot rows pick single columns, so each output is one dequantized weight, exactly); the
Triton lowering for an H200; and, on a GPU, the compiled kernel on real decode shapes."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.helpers.triton_lowering as triton_lowering
from pallas_kernels.quant import (QuantFormat, QuantGemvTiles, dequantize, quant_gemv,
                                  quant_gemv_applies)
from pallas_kernels.quant.gemv import quant_gemv_reference

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BF16, F32 = jnp.bfloat16, jnp.float32


# ---- float64 re-derivation of the forms (pallas_kernels/quant/formats.py's docstring) ----

def numpy_fp8_weights(codes, scale, block):
    """``W[r, c] = e4m3(codes[r, c]) * scale[r // bn, c // bk]`` in float64."""
    c = np.asarray(codes).astype(np.float64)
    n, k = c.shape
    rows, cols = np.arange(n) // block[0], np.arange(k) // block[1]
    return c * np.asarray(scale, np.float64)[rows[:, None], cols[None, :]]


def numpy_nvfp4_weights(codes, scale, scale_2, divide):
    """Column ``2j`` from the low nibble of byte ``j``, ``2j + 1`` from the high one; a nibble
    is sign (bit 3) and magnitude ``E2M1[bits 0-2]``; times the group scale of its 16 columns,
    times (or divided by) the row's ``scale_2``; float64."""
    b = np.asarray(codes).astype(np.int64)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(b.shape[0], -1)
    v = np.where(nib & 8, -1.0, 1.0) * E2M1[nib & 7]
    s = np.asarray(scale).astype(np.float64)
    w = v * np.repeat(s, 16, axis=1)
    s2 = np.asarray(scale_2, np.float64)[:, None]
    return w / s2 if divide else w * s2


def rounded(a, dtype):
    """float64 -> float32 -> ``dtype`` -> float64 (the model dtype's value)."""
    return np.asarray(jnp.asarray(np.asarray(a, np.float64).astype(np.float32)).astype(dtype),
                      np.float64)


# ---- inputs ----

def fp8_parts(rng, n, k, block):
    codes = jnp.asarray(rng.standard_normal((n, k)) * 40.0, F32).astype(jnp.float8_e4m3fn)
    nb = (-(-n // block[0]), -(-k // block[1]))
    scale = jnp.asarray(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), nb)), F32)
    return codes, scale, None


def nvfp4_parts(rng, n, k, divide):
    """Every byte value; positive e4m3 group scales from 2**-9 (subnormal) to 448; scale_2
    with random mantissas, about 1e-3 (ModelOpt) or 1e3 (compressed-tensors' divisor)."""
    codes = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
    s_bits = jnp.asarray(rng.integers(1, 0x7F, (n, k // 16)), jnp.uint8)
    scale = jax.lax.bitcast_convert_type(s_bits, jnp.float8_e4m3fn)
    mid = 1e3 if divide else 1e-3
    scale_2 = jnp.asarray(mid * np.exp(rng.uniform(-2, 2, n)), F32)
    return codes, scale, scale_2


def make_case(name, seed=0):
    """``(fmt, parts, numpy weights, tiles)`` of a named case (small shapes, partial edges)."""
    rng = np.random.default_rng(seed)
    fp8 = {"fp8_128": ((128, 128), 200, 328, None),          # 2 full steps + 72, 8 rows over
           "fp8_128_bn8": ((128, 128), 200, 328, QuantGemvTiles(8, 64, reduce_each=True)),
           "fp8_row": ((1, 200), 72, 200, None),              # one scale per row, tail only
           "fp8_row_128": ((1, 128), 40, 328, QuantGemvTiles(16, 128, 2))}
    if name in fp8:
        block, n, k, tiles = fp8[name]
        parts = fp8_parts(rng, n, k, block)
        return (QuantFormat("fp8", block, k), parts,
                numpy_fp8_weights(parts[0], parts[1], block), tiles)
    nv = {"nvfp4": (False, 72, 208, None),                      # 13 groups: one masked step
          "nvfp4_div": (True, 72, 208, None),
          "nvfp4_div_steps": (True, 40, 208, QuantGemvTiles(8, 64, reduce_each=True)),
          "nvfp4_whole": (False, 32, 256, QuantGemvTiles(16, 64, 8))}  # no masked step
    divide, n, k, tiles = nv[name]
    parts = nvfp4_parts(rng, n, k, divide)
    return (QuantFormat("nvfp4", (1, 16), k, divide), parts,
            numpy_nvfp4_weights(*parts, divide), tiles)


def activations(rows, k, seed=1):
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    return jnp.asarray(x.reshape((2, 2, k) if rows == 4 else (rows, k)))


def check_close(y, x, w64, dtype, yref=None):
    """``y`` against the float64 product of the rounded ``x`` and ``w64``: within the output's
    rounding plus float32 summation (2**-16 of the sum of |terms|); against ``yref`` (the XLA
    composition) within one ulp of ``dtype`` plus the same."""
    x64 = rounded(x, dtype).reshape(-1, w64.shape[1])
    w = rounded(w64, dtype)
    y64, mag = x64 @ w.T, np.abs(x64) @ np.abs(w).T
    y = np.asarray(y, np.float64).reshape(y64.shape)
    assert np.max(mag) > 1.0  # the scales do not wash the weights out
    ulp = 2.0 ** -8 if dtype == BF16 else 2.0 ** -23
    err = np.abs(y - y64) / (ulp * np.abs(y64) + 2.0 ** -16 * mag)
    assert err.max() <= 1.0, (err.max(), np.unravel_index(err.argmax(), err.shape))
    if yref is not None:
        yr = np.asarray(yref, np.float64).reshape(y64.shape)
        err = np.abs(y - yr) / (2 * ulp * np.abs(yr) + 2.0 ** -16 * mag)
        assert err.max() <= 1.0, err.max()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("name", ["fp8_128", "fp8_row", "nvfp4", "nvfp4_div"])
def test_matches_float64_and_xla(name, rows, dtype):
    """1 and 4 rows (``[2, 2, K]``), float32 and bfloat16: fp8 with 128-blocks cut at both
    edges (N=200, K=328) or one scale per row; nvfp4 multiplying and dividing by scale_2 with
    an odd group count (K=208)."""
    fmt, parts, w64, tiles = make_case(name)
    x = activations(rows, fmt.in_features)
    y = quant_gemv(x, fmt, *parts, out_dtype=dtype, tiles=tiles)
    assert y.shape == (*x.shape[:-1], parts[0].shape[0]) and y.dtype == dtype
    check_close(y, x, w64, dtype, quant_gemv_reference(x, fmt, *parts, out_dtype=dtype))


@pytest.mark.parametrize("name", ["fp8_128_bn8", "fp8_row_128", "nvfp4_div_steps",
                                  "nvfp4_whole"])
def test_other_tilings(name):
    """Three rows of bf16 activations (bf16 result): several full steps then a masked one,
    8-column programs, per-row scales with 128-column blocks, a K with no masked step."""
    fmt, parts, w64, tiles = make_case(name, seed=2)
    x = activations(3, fmt.in_features).astype(BF16)
    y = quant_gemv(x, fmt, *parts, out_dtype=BF16, tiles=tiles)
    check_close(y, x, w64, BF16, quant_gemv_reference(x, fmt, *parts, out_dtype=BF16))


ONE_HOT = {"fp8_128": [0, 127, 128, 255, 256, 300, 326, 327],
           "fp8_row_128": [0, 1, 127, 128, 200, 255, 256, 327],
           "nvfp4": [0, 1, 15, 16, 17, 190, 206, 207],
           "nvfp4_div": [0, 1, 14, 31, 32, 101, 206, 207],
           "nvfp4_div_steps": [2, 3, 63, 64, 65, 127, 192, 207]}


def check_weights(y, fmt, parts, w64, cols, dtype):
    """One-hot rows' outputs ``y [8, N]`` are the weights of columns ``cols``: the float64
    weight rounded to ``dtype`` bit for bit; ``dequantize``'s bit for bit too, but for
    dividing nvfp4, where XLA multiplies by the rounded reciprocal of scale_2 (its algebraic
    simplifier's rewrite of a division by a broadcast): there within one ulp of ``dtype``."""
    y = np.asarray(y, np.float32)
    np.testing.assert_array_equal(y.astype(np.float64), rounded(w64, dtype)[:, cols].T)
    w = np.asarray(dequantize(fmt, *parts, dtype), np.float32)[:, cols].T
    if not fmt.divide:
        np.testing.assert_array_equal(y, w)
        return
    ulp = np.abs(np.asarray(jnp.asarray(w, dtype).astype(F32))) * (
        2.0 ** -7 if dtype == BF16 else 2.0 ** -23)
    assert np.all(np.abs(y - w) <= ulp), np.max(np.abs(y - w) / np.maximum(ulp, 1e-30))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(ONE_HOT))
def test_weights_bit_exact(name, dtype):
    """Eight one-hot rows: ``y[m, r] = W[r, col_m]`` (a sum of one product and zeros, so
    exact) in every block, group, nibble and the masked tail (:func:`check_weights`)."""
    fmt, parts, w64, tiles = make_case(name, seed=3)
    cols = ONE_HOT[name]
    x = jnp.asarray(np.eye(fmt.in_features, dtype=np.float32)[cols])
    y = quant_gemv(x, fmt, *parts, out_dtype=dtype, tiles=tiles)
    check_weights(y, fmt, parts, w64, cols, dtype)


@pytest.mark.parametrize("name", ["fp8_128_bn8", "nvfp4_div_steps"])
def test_weights_and_rows_rounded_before_products(name):
    """bf16: rows holding ``1 + 2**-7 + 2**-10`` (bf16: ``1 + 2**-7``) at two columns give
    ``bf16(fl32(w_a x) + fl32(w_b x))`` with ``w`` and ``x`` rounded to bf16 first, bit for
    bit (the products are exact in float32; adding zeros is exact)."""
    fmt, parts, w64, tiles = make_case(name, seed=4)
    k = fmt.in_features
    a, b = np.arange(8) * 13 % k, (np.arange(8) * 29 + k - 9) % k
    assert np.all(a != b)
    xv = np.float32(1 + 2.0 ** -7 + 2.0 ** -10)
    x = np.zeros((8, k), np.float32)
    x[np.arange(8), a] = x[np.arange(8), b] = xv
    y = quant_gemv(jnp.asarray(x), fmt, *parts, out_dtype=BF16, tiles=tiles)
    w = rounded(w64, BF16).astype(np.float32)
    xr = np.float32(rounded(xv, BF16))
    want = (w[:, a] * xr + w[:, b] * xr).T
    np.testing.assert_array_equal(np.asarray(y, np.float32), rounded(want, BF16))


def test_refusals_and_applies():
    fmt, parts, _, _ = make_case("fp8_128")
    with pytest.raises(ValueError, match="9 rows"):
        quant_gemv(jnp.zeros((9, 328)), fmt, *parts, out_dtype=BF16)
    with pytest.raises(ValueError, match="K=320"):
        quant_gemv(jnp.zeros((1, 320)), fmt, *parts, out_dtype=BF16)
    with pytest.raises(ValueError, match="bk=256 must divide"):
        quant_gemv(jnp.zeros((1, 328)), fmt, *parts, out_dtype=BF16,
                   tiles=QuantGemvTiles(16, 256))
    with pytest.raises(ValueError, match="bn=32 must divide"):
        quant_gemv(jnp.zeros((1, 328)), QuantFormat("fp8", (16, 128), 328),
                   parts[0], jnp.ones((13, 3)), None, out_dtype=BF16, tiles=QuantGemvTiles(32))
    with pytest.raises(ValueError, match="power of two"):
        quant_gemv(jnp.zeros((1, 328)), fmt, *parts, out_dtype=BF16, tiles=QuantGemvTiles(12))
    with pytest.raises(ValueError, match="scale"):
        quant_gemv(jnp.zeros((1, 328)), fmt, parts[0], parts[1][:1], None, out_dtype=BF16)
    with pytest.raises(ValueError, match="stacked"):
        quant_gemv(jnp.zeros((1, 328)), fmt, parts[0][None], parts[1][None], None,
                   out_dtype=BF16)
    nv, nv_parts, _, _ = make_case("nvfp4")
    with pytest.raises(ValueError, match="multiple of 16"):
        quant_gemv(jnp.zeros((1, 208)), nv, *nv_parts, out_dtype=BF16, tiles=QuantGemvTiles(16, 8))

    assert quant_gemv_applies(QuantFormat("fp8", (128, 128), 5120), 17408, 5120, 1)
    assert quant_gemv_applies(QuantFormat("fp8", (1, 2048), 2048), 8224, 2048, 8)
    assert quant_gemv_applies(QuantFormat("nvfp4", (1, 16), 17408, True), 5120, 17408, 4)
    assert not quant_gemv_applies(QuantFormat("nvfp4", (1, 16), 5120), 17408, 5120, 9)
    assert not quant_gemv_applies(QuantFormat("nvfp4", (1, 16), 5120), 17408, 4096, 1)
    assert not quant_gemv_applies(QuantFormat("fp8", (3, 128), 5120), 17408, 5120, 1)
    assert not quant_gemv_applies(QuantFormat("fp8", (128, 100), 5120), 17408, 5120, 1)


@pytest.mark.parametrize("fmt,n,rows", [
    (QuantFormat("fp8", (128, 128), 5120), 17408, 1),
    (QuantFormat("fp8", (128, 128), 328), 200, 4),
    (QuantFormat("fp8", (1, 2048), 2048), 8224, 8),
    (QuantFormat("nvfp4", (1, 16), 5120), 17408, 1),
    (QuantFormat("nvfp4", (1, 16), 208, True), 72, 4),
], ids=["fp8_128_27b", "fp8_128_edges", "fp8_row", "nvfp4", "nvfp4_div_edges"])
def test_lowers_for_cuda(fmt, n, rows):
    """Each variant lowers to a Triton kernel for an H200 (no PTX compile: see the helper);
    the dividing form carries its correctly rounded ``div.rn.f32``."""
    shapes = fmt.shapes(n)
    parts = [jax.ShapeDtypeStruct(*shapes[p]) if p in shapes else None
             for p in ("codes", "scale", "scale_2")]
    x = jax.ShapeDtypeStruct((rows, fmt.in_features), BF16)
    text = triton_lowering.lower_for_cuda(
        lambda a, c, s, s2: quant_gemv(a, fmt, c, s, s2, out_dtype=BF16, interpret=False),
        x, *parts)
    assert "__gpu$xla.gpu.triton" in text and f"quant_gemv_{fmt.kind}" in text
    assert ("div.rn.f32" in text) == fmt.divide


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,n,rows", [
    (QuantFormat("fp8", (128, 128), 5120), 17408, 1),
    (QuantFormat("fp8", (1, 2048), 2048), 8224, 4),
    (QuantFormat("nvfp4", (1, 16), 5120), 17408, 1),
    (QuantFormat("nvfp4", (1, 16), 17408, True), 5120, 8),
])
def test_gpu_real_shapes(fmt, n, rows):
    """The compiled kernel on decode shapes: against the XLA composition, and weight for weight
    through one-hot rows (``div.rn.f32`` against XLA's division)."""
    rng = np.random.default_rng(5)
    k = fmt.in_features
    parts = (fp8_parts(rng, n, k, fmt.block) if fmt.kind == "fp8"
             else nvfp4_parts(rng, n, k, fmt.divide))
    x = activations(rows, k).astype(BF16)
    y = quant_gemv(x, fmt, *parts, out_dtype=BF16)
    w = (numpy_fp8_weights(parts[0], parts[1], fmt.block) if fmt.kind == "fp8"
         else numpy_nvfp4_weights(*parts, fmt.divide))
    check_close(y, x, w, BF16, quant_gemv_reference(x, fmt, *parts, out_dtype=BF16))
    cols = rng.choice(k, 8, replace=False)
    one_hot = jnp.asarray(np.eye(k, dtype=np.float32)[cols])
    for dtype in (F32, BF16):
        got = quant_gemv(one_hot, fmt, *parts, out_dtype=dtype)
        check_weights(got, fmt, parts, w, cols, dtype)
