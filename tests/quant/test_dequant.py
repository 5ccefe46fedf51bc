"""Dequantization of each stored format against the independent float64 reference
(tests/quant/reference.py): stored tensors drawn at random here (not by mtp_jax's writer), with
partial 128-blocks (200 x 272) and an odd group count (272 / 16 = 17), plain and stacked."""

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from mtp_jax.weights.quant_config import parse_quantization
from mtp_jax.weights.quant_tensors import group_quantized
from mtp_jax.weights.safetensors_files import _Files, _read, read_header
from tests.quant.reference import dequantize_stored

R, C = 200, 272
CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "modelopt-fp8": {"quant_method": "modelopt", "quant_algo": "FP8"},
    "modelopt-nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    "ct-nvfp4": {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                 "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float",
                                                     "strategy": "tensor_group",
                                                     "group_size": 16}}}},
}


def _fp8(rng, shape):
    return (rng.standard_normal(shape) * 40).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)


def stored_tensors(fmt, rng, lead=()):
    """Random stored tensors of one weight in ``fmt``: dotted names, or stacked (``lead``)."""
    base = "model.layers.0.mlp.experts.down_proj" if lead else "model.layers.0.mlp.up_proj.weight"
    name = (lambda s: base[:-len("weight")] + s) if not lead else (
        lambda s: base if s == "weight" else base + "_" + s.removeprefix("weight_"))
    per = lead if lead else ()
    if fmt == "fp8-block":
        return {name("weight"): _fp8(rng, (*lead, R, C)),
                name("weight_scale_inv"): rng.uniform(0.5, 2, (*lead, 2, 3)).astype(np.float32)}
    if fmt == "modelopt-fp8":
        return {name("weight"): _fp8(rng, (*lead, R, C)),
                name("weight_scale"): rng.uniform(0.5, 2, per).astype(np.float32),
                name("input_scale"): np.ones(per, np.float32)}
    packed = rng.integers(0, 256, (*lead, R, C // 2), dtype=np.uint8)
    scale = rng.uniform(0.1, 8, (*lead, R, C // 16)).astype(ml_dtypes.float8_e4m3fn)
    if fmt == "modelopt-nvfp4":
        return {name("weight"): packed, name("weight_scale"): scale,
                name("weight_scale_2"): rng.uniform(0.5, 2, per).astype(np.float32),
                name("input_scale"): np.ones(per, np.float32)}
    return {name("weight_packed"): packed, name("weight_scale"): scale,
            name("weight_global_scale"): rng.uniform(0.5, 2, (*lead, 1)).astype(np.float32),
            name("input_global_scale"): np.ones((*lead, 1), np.float32)}


def _load_logical(path, fmt):
    q = parse_quantization(CONFIGS[fmt])
    logical = group_quantized(list(read_header(path).values()), q, str(path))
    fh = _Files()
    try:
        return {t.name: np.array(_read(fh, t)) for t in logical}
    finally:
        fh.close()


@pytest.mark.parametrize("lead", [(), (3,)], ids=["matrix", "stacked"])
@pytest.mark.parametrize("fmt", list(CONFIGS))
def test_every_format_equals_float64_reference(fmt, lead, tmp_path):
    rng = np.random.default_rng(hash((fmt, lead)) % 2**32)
    stored = stored_tensors(fmt, rng, lead)
    path = tmp_path / "model.safetensors"
    save_file(stored, str(path))
    got = _load_logical(path, fmt)
    want = dequantize_stored(stored)
    assert set(got) == set(want) and len(got) == 1, (sorted(got), sorted(want))
    name = next(iter(want))
    assert got[name].shape == (*lead, R, C)
    np.testing.assert_array_equal(got[name], want[name].astype(np.float32))
    assert np.abs(want[name]).max() > 0


def test_e2m1_nibble_order_example(tmp_path):
    """FORMATS.md's example: byte 0x2B -> column 2j = -1.5, column 2j+1 = +1.0."""
    stored = {"x.weight": np.full((1, 8), 0x2B, np.uint8),
              "x.weight_scale": np.ones((1, 1), ml_dtypes.float8_e4m3fn),
              "x.weight_scale_2": np.ones((), np.float32)}
    path = tmp_path / "model.safetensors"
    save_file(stored, str(path))
    got = _load_logical(path, "modelopt-nvfp4")["x.weight"]
    np.testing.assert_array_equal(got[0], [-1.5, 1.0] * 8)
