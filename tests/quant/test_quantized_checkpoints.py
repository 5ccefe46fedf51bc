"""Quantized checkpoints written by ``random_checkpoint --quantize`` load to the independent
float64 dequantization of their stored tensors (every format, both families, a mixed
checkpoint, per-expert and stacked experts, quantized MTP input projections), and a
quantized checkpoint generates the same greedy tokens (MTP on: the same drafts too) as a
float32 checkpoint holding the same dequantized values."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from mtp_jax import LLM, SamplingParams
from mtp_jax.config import ModelConfig
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.loader import read_checkpoint
from mtp_jax.tools.random_checkpoint import write_random_checkpoint
from mtp_jax.weights import names
from mtp_jax.weights.safetensors_files import _Files, checkpoint_files, read_header, read_stored
from mtp_jax.weights.safetensors_reader import load_tensors
from tests.helpers.paths import fixture_path
from tests.quant.reference import dequantize_stored

FORMATS = ("fp8-block", "modelopt-fp8", "modelopt-nvfp4", "ct-nvfp4")


def odd_dense_config():
    """tiny_dense with hidden 144 and intermediate 208: partial 128-blocks, 9 and 13 groups."""
    raw = json.load(open(os.path.join(fixture_path("tiny_dense"), "config.json")))
    raw["text_config"].update(hidden_size=144, intermediate_size=208)
    return raw


def stored(folder):
    """Every stored tensor of a folder, in its stored dtype."""
    out, fh = {}, _Files()
    try:
        for fn in checkpoint_files(folder)[0]:
            for name, t in read_header(os.path.join(folder, fn)).items():
                out[name] = np.array(read_stored(fh, t))
    finally:
        fh.close()
    return out


def canonical_reference(cfg, logical):
    """Canonical name -> float64 value, per-expert tensors stacked as the reader stacks them."""
    ref = {}
    for name, v in logical.items():
        c = names.canonical_name(name)
        if ".experts." in c and c.split(".experts.")[1][:1].isdigit():
            pre, rest = c.split(".experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            key = f"{pre}.experts." + ("down_proj" if proj == "down_proj" else "gate_up_proj")
            ref.setdefault(key, {})[(e, proj)] = v
        else:
            ref[c] = v
    for k, v in list(ref.items()):
        if isinstance(v, dict):
            n = 1 + max(e for e, _ in v)
            ref[k] = np.stack([v[(e, "down_proj")] if k.endswith("down_proj") else
                               np.concatenate([v[(e, "gate_proj")], v[(e, "up_proj")]])
                               for e in range(n)])
    return ref


def check_loaded_equals_reference(folder, expect_quantized):
    cfg = ModelConfig.from_folder(folder)
    shapes = {**names.target_tensors(cfg), **names.mtp_tensors(cfg)}
    got = load_tensors(folder, cfg, shapes, dtype=np.float32, include_mtp=True)
    st = stored(folder)
    ref = canonical_reference(cfg, dequantize_stored(st))
    assert set(ref) == set(got)
    for k in got:
        np.testing.assert_array_equal(got[k], ref[k].astype(np.float32), err_msg=k)
    quantized = {n for n, a in st.items() if a.dtype == np.uint8 or "float8" in str(a.dtype)}
    for name in expect_quantized:
        assert any(name in q for q in quantized), (name, sorted(quantized)[:8])
    return cfg, got


@pytest.mark.parametrize("fmt", FORMATS)
def test_written_formats_load_to_reference(fmt, tmp_path):
    folder = write_random_checkpoint(odd_dense_config(), str(tmp_path / fmt), dtype="float32",
                                     quantize=fmt, quantize_mtp_fc=True)
    assert json.load(open(os.path.join(folder, "config.json")))["quantization_config"]
    check_loaded_equals_reference(folder, ["layers.3.self_attn.q_proj.", "mtp.fc.",
                                           "mtp.layers.0.mlp.down_proj."])


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-nvfp4"])
def test_moe_experts_per_expert_and_stacked(fmt, tmp_path):
    folder = write_random_checkpoint(fixture_path("tiny_moe_fused"), str(tmp_path / "m"),
                                     dtype="float32", quantize=fmt, experts="fused",
                                     mtp_experts="per-expert")
    check_loaded_equals_reference(folder, ["model.layers.0.mlp.experts.gate_up_proj",
                                           "mtp.layers.0.mlp.experts.3.down_proj."])


def test_qwen4_exp_reads_quantized_mtp_fc(tmp_path):
    folder = write_random_checkpoint(fixture_path("tiny_qwen4_exp"), str(tmp_path / "q"),
                                     dtype="float32", quantize="modelopt-nvfp4",
                                     quantize_mtp_fc=True)
    cfg = Qwen4ExpConfig.from_folder(folder)
    from mtp_jax.models.qwen4_exp import names as q4
    shapes = {**q4.target_tensors(cfg), **q4.mtp_tensors(cfg)}
    got, _ = read_checkpoint(folder, cfg, shapes, dtype="float32", with_mtp=True)
    logical = dequantize_stored(stored(folder))
    for c in ("mtp.fc_embedding.weight", "mtp.fc_hidden.weight",
              "layers.0.linear_attn.in_proj_qkv.weight", "mtp.layers.0.mlp.experts.down_proj"):
        assert any(n.startswith(q4.disk_name(cfg, c)) for n, a in stored(folder).items()
                   if a.dtype == np.uint8), c
        np.testing.assert_array_equal(got[c], logical[q4.disk_name(cfg, c)].astype(np.float32))


def f32_export(src, dst):
    """A float32 checkpoint of the same values: the reference dequantization of every stored
    tensor under its unquantized name, config.json without quantization_config."""
    os.makedirs(dst)
    values = {n: v.astype(np.float32) for n, v in dequantize_stored(stored(src)).items()}
    save_file(values, os.path.join(dst, "model.safetensors"))
    raw = json.load(open(os.path.join(src, "config.json")))
    del raw["quantization_config"]
    json.dump(raw, open(os.path.join(dst, "config.json"), "w"))
    return dst


def test_mixed_checkpoint_generates_like_its_f32_export(tmp_path):
    """NVFP4 trunk, block-FP8 MTP layer with a quantized mtp.fc (ModelOpt MIXED_PRECISION):
    the same greedy tokens and accept lengths as the float32 export, MTP on."""
    q = write_random_checkpoint(fixture_path("tiny_moe_fused"), str(tmp_path / "q"),
                                dtype="float32", quantize="modelopt-nvfp4",
                                mtp_quantize="fp8-block", quantize_mtp_fc=True,
                                mtp_experts="per-expert")
    assert json.load(open(os.path.join(q, "config.json")))["quantization_config"][
        "quant_algo"] == "MIXED_PRECISION"
    ref = f32_export(q, str(tmp_path / "f32"))
    prompts = [[5, 17, 42, 9], [3, 100, 7, 250, 11, 60]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, folder in (("q", q), ("f32", ref)):
        llm = LLM(folder, dtype="float32", speculative_num_steps=2, max_running_requests=2,
                  quantization="dequantize",
                  max_model_len=64, enable_prefix_cache=False)
        outs[name] = [(o.token_ids, o.accept_length) for o in llm.generate(prompts, params)]
    assert outs["q"] == outs["f32"]
    assert all(len(t) == 12 for t, _ in outs["q"])
