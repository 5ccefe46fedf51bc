"""The split-K form of the quantized few-row projection (:mod:`pallas_kernels.quant.gemv`,
:mod:`pallas_kernels.quant.gemv_tiles`) in interpret mode on the CPU: every split (none, two,
three and five slices of steps that do not divide evenly, the automatic one) gives the float64
products of the dequantized weights and the XLA composition, and single weights bit for bit in
every slice and the masked tail; the slice arithmetic and the automatic choice at the 27B's
shapes; the Triton lowering of the split for an H200 at the 27B's down projection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tests.helpers.triton_lowering as triton_lowering
from pallas_kernels.quant import QuantFormat, QuantGemvTiles, quant_gemv
from pallas_kernels.quant.gemv import quant_gemv_reference
from pallas_kernels.quant.gemv_tiles import (H200_SMS, auto_split, default_tiles, slices,
                                             split_plan)
from tests.kernels.test_quant_gemv import (BF16, F32, activations, check_close, check_weights,
                                           fp8_parts, numpy_fp8_weights, numpy_nvfp4_weights,
                                           nvfp4_parts)

# (S, chunk) for split_k = 1, 2, 3, 5, 0 (auto: 2 on these sizes).
PLANS = {
    # fp8, K=328 in 16-column steps: 20 whole + a masked one of 8 columns (21 steps).
    "fp8": {1: (1, 21), 2: (2, 11), 3: (3, 7), 5: (5, 5), 0: (2, 11)},
    # nvfp4, K=528 = 33 groups in 2-group steps: 16 whole + a masked one of 1 group.
    "nvfp4": {1: (1, 17), 2: (2, 9), 3: (3, 6), 5: (5, 4), 0: (2, 9)},
}


def split_case(kind, split, rows, seed=0):
    """``(fmt, parts, float64 weights, tiles)``: fp8 with 128-blocks, N=200, K=328; nvfp4
    multiplying by scale_2, N=72, K=528; 16-column programs, 16 / 32-column steps."""
    rng = np.random.default_rng(seed)
    if kind == "fp8":
        fmt, n, bk = QuantFormat("fp8", (128, 128), 328), 200, 16
        parts = fp8_parts(rng, n, fmt.in_features, fmt.block)
        w64 = numpy_fp8_weights(parts[0], parts[1], fmt.block)
    else:
        fmt, n, bk = QuantFormat("nvfp4", (1, 16), 528), 72, 32
        parts = nvfp4_parts(rng, n, fmt.in_features, False)
        w64 = numpy_nvfp4_weights(*parts, False)
    tiles = QuantGemvTiles(16, bk, reduce_each=rows > 2, split_k=split)
    assert split_plan(fmt, n, fmt.in_features, tiles) == PLANS[kind][split]
    return fmt, parts, w64, tiles


@pytest.mark.parametrize("split", [1, 2, 3, 5, 0], ids=lambda s: f"s{s or 'auto'}")
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_split_matches_float64_and_xla(kind, rows, split):
    """bf16 activations and result, 1 and 4 rows: within the bf16 rounding of the float64
    product and of :func:`quant_gemv_reference` (``check_close``), whatever the split."""
    fmt, parts, w64, tiles = split_case(kind, split, rows)
    x = activations(rows, fmt.in_features).astype(BF16)
    y = quant_gemv(x, fmt, *parts, out_dtype=BF16, tiles=tiles)
    assert y.shape == (*x.shape[:-1], parts[0].shape[0]) and y.dtype == BF16
    check_close(y, x, w64, BF16, quant_gemv_reference(x, fmt, *parts, out_dtype=BF16))


# Columns at slice edges (first / last of a slice) and in the masked tail, per kind and split.
EDGES = {"fp8": {3: [0, 111, 112, 223, 224, 319, 320, 327],
                 5: [0, 79, 80, 159, 160, 239, 319, 327]},
         "nvfp4": {3: [0, 191, 192, 383, 384, 511, 512, 527],
                   5: [0, 127, 128, 255, 256, 383, 511, 520]}}


@pytest.mark.parametrize("split", [3, 5])
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_split_weights_bit_exact(kind, split):
    """Eight one-hot rows, float32 result: each output is one weight plus zeros from the other
    slices' partials, so exactly the weight (``check_weights``); a step summed in two slices
    (or in none) would double (or lose) it."""
    fmt, parts, w64, tiles = split_case(kind, split, 8, seed=3)
    cols = EDGES[kind][split]
    x = jnp.asarray(np.eye(fmt.in_features, dtype=np.float32)[cols])
    y = quant_gemv(x, fmt, *parts, out_dtype=F32, tiles=tiles)
    check_weights(y, fmt, parts, w64, cols, F32)


def test_slices_cover_the_steps_once():
    """``slices``: at most ``split`` slices, none empty, together exactly the steps."""
    for n_steps in range(1, 41):
        for split in range(1, 46):
            s, chunk = slices(n_steps, split)
            assert 1 <= s <= min(split, n_steps)
            assert (s - 1) * chunk < n_steps <= s * chunk
    with pytest.raises(ValueError, match="must be >= 1"):
        slices(0, 2)


FP8_27B = {"gate_up": (34816, 5120), "down": (5120, 17408), "gdn_in": (16480, 5120)}


def test_auto_split_at_27b_shapes():
    """The automatic split on an H200: none where N / bn fills the SMs (gate_up, gdn_in), 2 for
    down's 320 programs of 136 steps (fp8) or 34 (nvfp4); with 64-column fp8 programs, 7;
    capped by the steps each slice must keep; an explicit split_k is taken (normalized)."""
    got = {}
    for name, (n, k) in FP8_27B.items():
        for kind, block in (("fp8", (128, 128)), ("nvfp4", (1, 16))):
            fmt = QuantFormat(kind, block, k)
            got[kind, name] = split_plan(fmt, n, k, default_tiles(fmt, n, k, 1), H200_SMS)[0]
    assert got == {("fp8", "gate_up"): 1, ("fp8", "down"): 2, ("fp8", "gdn_in"): 1,
                   ("nvfp4", "gate_up"): 1, ("nvfp4", "down"): 2, ("nvfp4", "gdn_in"): 1}
    down = QuantFormat("fp8", (128, 128), 17408)
    wide = QuantGemvTiles(64, 128, 8, 3, True)
    assert split_plan(down, 5120, 17408, wide, H200_SMS) == (7, 20)
    assert split_plan(down, 5120, 17408, wide._replace(split_k=3), H200_SMS) == (3, 46)
    assert auto_split(programs=4, n_steps=20, sms=H200_SMS) == 2  # 20 // 8
    assert auto_split(programs=4, n_steps=7, sms=H200_SMS) == 1


def test_refuses_negative_split():
    fmt, parts, _, _ = split_case("fp8", 1, 1)
    with pytest.raises(ValueError, match="split_k=-1"):
        quant_gemv(jnp.zeros((1, 328)), fmt, *parts, out_dtype=BF16,
                   tiles=QuantGemvTiles(16, 16, split_k=-1))


@pytest.mark.parametrize("kind,rows,tiles,split", [
    ("fp8", 1, None, 2), ("fp8", 4, None, 2), ("nvfp4", 1, None, 2),
    ("fp8", 4, QuantGemvTiles(64, 128, 8, 3, True), 7),
    ("nvfp4", 4, QuantGemvTiles(32, 512, 8, 3, True), 4),
], ids=["fp8_r1", "fp8_r4", "nvfp4_r1", "fp8_wide_r4", "nvfp4_wide_r4"])
def test_split_lowers_for_cuda_at_27b_down(kind, rows, tiles, split):
    """The 27B's down projection (N=5120, K=17408) lowers to a Triton kernel for an H200 with
    its K split: float32 partials ``[S, rows, N]`` reduced by XLA."""
    fmt = QuantFormat(kind, (128, 128) if kind == "fp8" else (1, 16), 17408)
    shapes = fmt.shapes(5120)
    parts = [jax.ShapeDtypeStruct(*shapes[p]) if p in shapes else None
             for p in ("codes", "scale", "scale_2")]
    x = jax.ShapeDtypeStruct((rows, fmt.in_features), BF16)
    text = triton_lowering.lower_for_cuda(
        lambda a, c, s, s2: quant_gemv(a, fmt, c, s, s2, out_dtype=BF16, tiles=tiles,
                                       interpret=False), x, *parts)
    assert "__gpu$xla.gpu.triton" in text and f"quant_gemv_{kind}" in text
    assert f"tensor<{split}x{rows}x5120xf32>" in text and "stablehlo.reduce" in text


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
@pytest.mark.parametrize("tiles", [None, QuantGemvTiles(64, 128, 8, 3, True),
                                   QuantGemvTiles(32, 512, 8, 3, True, 5)],
                         ids=["auto", "wide", "wide_s5"])
def test_gpu_split_at_27b_down(kind, tiles):
    """The compiled split kernel on the 27B's down projection, 1 and 4 rows: within the bf16
    rounding of the float64 product and of the XLA composition."""
    if kind == "fp8" and tiles is not None and tiles.bk == 512:
        tiles = tiles._replace(bk=128)  # fp8 steps stay inside a 128-column scale block
    rng = np.random.default_rng(6)
    n, k = 5120, 17408
    if kind == "fp8":
        fmt = QuantFormat("fp8", (128, 128), k)
        parts = fp8_parts(rng, n, k, fmt.block)
        w64 = numpy_fp8_weights(parts[0], parts[1], fmt.block)
    else:
        fmt = QuantFormat("nvfp4", (1, 16), k)
        parts = nvfp4_parts(rng, n, k, False)
        w64 = numpy_nvfp4_weights(*parts, False)
    for rows in (1, 4):
        x = activations(rows, k).astype(BF16)
        y = quant_gemv(x, fmt, *parts, out_dtype=BF16, tiles=tiles)
        check_close(y, x, w64, BF16, quant_gemv_reference(x, fmt, *parts, out_dtype=BF16))
