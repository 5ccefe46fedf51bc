"""Refusals: a stored format the config does not declare, a missing scale, a wrong scale shape
(each naming the tensor, before any tensor data is read), and an unknown quant_method or field
(at config time, before any weight file is opened)."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file  # noqa: F401

from mtp_jax import LLM, load_model
from mtp_jax.config import ConfigError
from mtp_jax.tools.random_checkpoint import write_random_checkpoint
from mtp_jax.weights.safetensors_files import CheckpointError, read_header
from tests.helpers.paths import fixture_path
from tests.helpers.refusals import weight_spy, write_raw_safetensors  # noqa: F401

Q = "model.layers.0.mlp.shared_expert.up_proj."


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    return write_random_checkpoint(fixture_path("tiny_moe_fused"),
                                   str(tmp_path_factory.mktemp("fp8") / "c"), dtype="float32",
                                   quantize="fp8-block")


def _copy_with(src, dst, edit=None, config=None):
    """A copy of ``src`` whose tensors pass through ``edit(name -> (dtype, shape, bytes))``
    and whose quantization_config is replaced by ``config``."""
    os.makedirs(dst)
    fn = "model-00001-of-00001.safetensors"
    path = os.path.join(src, fn)
    raw = {}
    with open(path, "rb") as f:
        data = f.read()
    for name, t in read_header(path).items():
        raw[name] = (t.dtype, list(t.shape), data[t.start:t.end])
    write_raw_safetensors(os.path.join(dst, fn), edit(raw) if edit else raw)
    for meta in ("model.safetensors.index.json", "config.json"):
        d = json.load(open(os.path.join(src, meta)))
        if meta == "model.safetensors.index.json":
            d["weight_map"] = {k: fn for k in (edit(raw) if edit else raw)}
        elif config is not None:
            d["quantization_config"] = config
        json.dump(d, open(os.path.join(dst, meta), "w"))
    return dst


def _drop(name):
    return lambda raw: {k: v for k, v in raw.items() if k != name}


def _reshape_scale(raw):
    raw = dict(raw)
    dtype, shape, data = raw[Q + "weight_scale_inv"]
    raw[Q + "weight_scale_inv"] = (dtype, [1, 2], np.ones(2, np.float32).tobytes())
    return raw


CASES = [
    ("config_says_nvfp4", None, {"quant_method": "modelopt", "quant_algo": "NVFP4"},
     r"'model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight' F8_E4M3 \[32, 64\] in "
     r"model-00001-of-00001\.safetensors: stored as fp8-block but config\.json declares "
     r"quant_method 'modelopt' \(stored formats allowed: modelopt-nvfp4\)"),
    ("missing_scale", _drop(Q + "weight_scale_inv"), None,
     r"'model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight' F8_E4M3 \[32, 64\] in "
     r"model-00001-of-00001\.safetensors is quantized but no scale tensor is stored for it"),
    ("wrong_scale_shape", _reshape_scale, None,
     r"'model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight_scale_inv' F32 \[1, 2\] in "
     r"model-00001-of-00001\.safetensors should have shape \[1, 1\]"),
    ("scale_without_weight", _drop(Q + "weight"), None,
     r"'model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight_scale_inv' F32 \[1, 1\] .*found "
     r"without the weight 'model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight'"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_conflicts_name_the_tensor_before_data_is_read(case, fp8_ckpt, tmp_path, weight_spy):
    _, edit, config, pattern = case
    bad = _copy_with(fp8_ckpt, str(tmp_path / "bad"), edit, config)
    weight_spy.data.clear()
    with pytest.raises(CheckpointError, match=pattern):
        load_model(bad, "float32", with_mtp=False)
    assert weight_spy.data == [], "tensor data was read before the refusal"


@pytest.mark.parametrize("config, pattern", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "kv_bits": 8},
     r"key\(s\) \['kv_bits'\] that mtp_jax does not implement"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"},
     r"quant_algo 'W4A8_AWQ' is not one mtp_jax reads"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
     r"fmt 'e5m2' is not supported"),
])
def test_unknown_quantization_refused_at_config_time(config, pattern, fp8_ckpt, tmp_path,
                                                      weight_spy):
    bad = _copy_with(fp8_ckpt, str(tmp_path / "bad"), None, config)
    weight_spy.opened.clear()
    with pytest.raises(ConfigError, match=pattern):
        LLM(bad, dtype="float32", speculative_algorithm="none")
    assert weight_spy.opened == [], "a weight file was opened before the refusal"


def test_separate_draft_read_under_targets_config(fp8_ckpt, tmp_path):
    """A block-FP8 draft folder next to a block-FP8 target loads (read under the target's
    quantization config; the draft folder itself has no config.json)."""
    draft = tmp_path / "draft"
    draft.mkdir()
    fn = "model-00001-of-00001.safetensors"
    path = os.path.join(fp8_ckpt, fn)
    data = open(path, "rb").read()
    raw = {n: (t.dtype, list(t.shape), data[t.start:t.end])
           for n, t in read_header(path).items() if n.startswith("mtp.")}
    write_raw_safetensors(str(draft / "model.safetensors"), raw)
    m = load_model(fp8_ckpt, "float32", draft_path=str(draft))
    assert m.has_mtp


def test_quantization_option_checked_first(weight_spy):
    with pytest.raises(ConfigError, match=r"quantization \(--quantization\) 'int4' is unknown"):
        LLM(fixture_path("tiny_moe_fused"), dtype="float32", quantization="int4")
    assert weight_spy.opened == []
    from mtp_jax.generate import build_parser
    assert build_parser().parse_args(["--quantization", "dequantize"]).quantization == "dequantize"


def test_model_line_says_how_quantized_weights_are_held(fp8_ckpt):
    """The CLI's ``[model]`` line names a quantized checkpoint and how its weights are held:
    dequantized at load (``auto``, ``dequantize``) or kept, with the bytes saved; nothing for
    an unquantized checkpoint or the built-in model."""
    from types import SimpleNamespace

    from mtp_jax.cli_report import quant_note as _quant_note
    from mtp_jax.llm import LLM

    held = {}
    for mode in ("auto", "dequantize", "keep"):
        held[mode] = llm = LLM(fp8_ckpt, dtype="float32", quantization=mode,
                               speculative_algorithm="none")
        note = _quant_note(SimpleNamespace(model=fp8_ckpt, quantization=mode), llm)
        if mode == "keep":
            assert llm.model.weight_bytes_saved > 0
            assert note.startswith("; quantized weights kept as stored (") and "float32" in note
        else:
            assert note == f"; fp8 checkpoint dequantized to float32 at load (--quantization {mode})"
    for model in (fixture_path("tiny_moe_fused"), None):  # unquantized, the built-in model
        assert _quant_note(SimpleNamespace(model=model, quantization="auto"), held["auto"]) == ""
