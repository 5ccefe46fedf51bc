"""Draft weight checks at draft load (issue 4, part 2): MTP routed experts stored quantized
(per-expert NVFP4, per-tensor FP8, block FP8) under an unquantized target's config (issue 34:
a draft is read under the target's quantization config), stacked experts without both
gate_up_proj and down_proj, and shapes that disagree with the config are refused with messages
naming the tensors, before any tensor data (the target's included) is read."""

import os
import re

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtp_jax import load_model
from mtp_jax.weights.safetensors_files import CheckpointError
from tests.helpers.refusals import MOE, copy_ckpt, split_moe, weight_spy, write_raw_safetensors  # noqa: F401

E, I, H = 8, 32, 64  # tiny_moe_fused: num_experts, moe_intermediate_size, hidden_size
P = "mtp.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return split_moe(tmp_path_factory.mktemp("split"))


def _mtp_tensors():
    return {k: v for k, v in load_file(os.path.join(MOE, "model.safetensors")).items()
            if k.startswith("mtp.")}


def _raw(tensors):
    out = {}
    for k, v in tensors.items():
        v = np.ascontiguousarray(v, np.float32)
        out[k] = ("F32", list(v.shape), v.tobytes())
    return out


def _zeros(dtype, shape):
    size = {"U8": 1, "F8_E4M3": 1, "F32": 4}[dtype]
    return (dtype, list(shape), b"\0" * (int(np.prod(shape, dtype=np.int64)) * size))


def nvfp4_per_expert(t):
    raw = _raw({k: v for k, v in t.items() if not k.startswith(P)})
    for e in range(E):
        for proj, (rows, cols) in (("gate_proj", (I, H)), ("up_proj", (I, H)),
                                   ("down_proj", (H, I))):
            n = f"{P}{e}.{proj}."
            raw[n + "weight"] = _zeros("U8", (rows, cols // 2))
            raw[n + "weight_scale"] = _zeros("F8_E4M3", (rows, cols // 16))
            raw[n + "weight_scale_2"] = _zeros("F32", ())
            raw[n + "input_scale"] = _zeros("F32", ())
    return raw


def fp8_per_tensor(t):
    raw = _raw({k: v for k, v in t.items() if not k.startswith(P)})
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            raw[f"{P}{e}.{proj}.weight"] = _zeros("F8_E4M3", shape)
            raw[f"{P}{e}.{proj}.weight_scale"] = _zeros("F32", ())
    return raw


def fp8_block_stacked(t):
    raw = _raw({k: v for k, v in t.items() if not k.startswith(P)})
    raw[P + "gate_up_proj"] = _zeros("F8_E4M3", (E, 2 * I, H))
    raw[P + "gate_up_proj_scale_inv"] = _zeros("F32", (E, 1, 1))
    raw[P + "down_proj"] = _zeros("F8_E4M3", (E, H, I))
    raw[P + "down_proj_scale_inv"] = _zeros("F32", (E, 1, 1))
    return raw


def stacked_without_down(t):
    return _raw({k: v for k, v in t.items() if k != P + "down_proj"})


def stacked_without_gate_up(t):
    return _raw({k: v for k, v in t.items() if k != P + "gate_up_proj"})


def stacked_split_gate_up(t):
    gu = t[P + "gate_up_proj"]
    out = {k: v for k, v in t.items() if k != P + "gate_up_proj"}
    out[P + "gate_proj"], out[P + "up_proj"] = gu[:, :I], gu[:, I:]
    return _raw(out)


def wrong_expert_shape(t):
    out = dict(t)
    out[P + "down_proj"] = np.zeros((E, H, I // 2), np.float32)
    return _raw(out)


def wrong_fc_shape(t):
    out = dict(t)
    out["mtp.fc.weight"] = np.zeros((H, H), np.float32)
    return _raw(out)


CASES = [
    # Quantized layouts are readable (tests/quant), but only under a config that declares
    # them: the target here is unquantized, and a draft is read under the target's config.
    ("nvfp4_per_expert", nvfp4_per_expert,
     [r"'mtp\.layers\.0\.mlp\.experts\.0\.down_proj\.weight' U8 \[64, 16\] in "
      r"model\.safetensors: stored as modelopt-nvfp4 but config\.json declares no "
      r"quantization_config"]),
    ("fp8_per_tensor", fp8_per_tensor,
     [r"'mtp\.layers\.0\.mlp\.experts\.0\.down_proj\.weight' F8_E4M3 \[64, 32\] in "
      r"model\.safetensors: stored as modelopt-fp8 but config\.json declares no "
      r"quantization_config"]),
    ("fp8_block_stacked", fp8_block_stacked,
     [r"'mtp\.layers\.0\.mlp\.experts\.down_proj' F8_E4M3 \[8, 64, 32\] in "
      r"model\.safetensors: stored as fp8-block but config\.json declares no "
      r"quantization_config"]),
    ("stacked_without_down", stacked_without_down,
     [r"stacked MTP experts need both gate_up_proj and down_proj",
      r"mtp\.layers\.0\.mlp\.experts has 'mtp\.layers\.0\.mlp\.experts\.gate_up_proj' F32 "
      r"\[8, 64, 64\] in model\.safetensors but no mtp\.layers\.0\.mlp\.experts\.down_proj"]),
    ("stacked_without_gate_up", stacked_without_gate_up,
     [r"but no mtp\.layers\.0\.mlp\.experts\.gate_up_proj"]),
    ("stacked_split_gate_up", stacked_split_gate_up,
     [r"stacked name\(s\) the reader does not know: mtp\.layers\.0\.mlp\.experts\.gate_proj, "
      r"mtp\.layers\.0\.mlp\.experts\.up_proj"]),
    ("wrong_expert_shape", wrong_expert_shape,
     [r"'mtp\.layers\.0\.mlp\.experts\.down_proj' in model\.safetensors \(canonical "
      r"mtp\.layers\.0\.mlp\.experts\.down_proj\) has shape \[8, 64, 16\] but the config expects "
      r"\[8, 64, 32\] \(from num_experts=8, moe_intermediate_size=32, hidden_size=64\)"]),
    ("wrong_fc_shape", wrong_fc_shape,
     [r"'mtp\.fc\.weight' in model\.safetensors \(canonical mtp\.fc\.weight\) has shape "
      r"\[64, 64\] but the config expects \[64, 128\]"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_separate_draft_refused_at_draft_load(case, split, tmp_path, weight_spy):
    name, make, patterns = case
    draft = tmp_path / "draft"
    draft.mkdir()
    write_raw_safetensors(draft / "model.safetensors", make(_mtp_tensors()))
    with pytest.raises(CheckpointError) as ei:
        load_model(split[0], "float32", draft_path=str(draft))
    msg = str(ei.value)
    for p in patterns:
        assert re.search(p, msg), f"{name}: {p!r} not in {msg}"
    assert weight_spy.data == [], "tensor data was read before the draft was refused"
    assert not any(p.startswith(split[0]) for p in weight_spy.opened), "target files were opened"


@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_own_mtp_layer_refused_at_load(case, tmp_path, weight_spy):
    """The same checks when the draft is the target checkpoint's own mtp.* layer."""
    name, make, patterns = case
    ckpt = copy_ckpt(MOE, tmp_path / "ckpt")
    t = load_file(os.path.join(ckpt, "model.safetensors"))
    raw = _raw({k: v for k, v in t.items() if not k.startswith("mtp.")})
    raw.update(make({k: v for k, v in t.items() if k.startswith("mtp.")}))
    write_raw_safetensors(os.path.join(ckpt, "model.safetensors"), raw)
    with pytest.raises(CheckpointError, match=patterns[0]):
        load_model(ckpt, "float32")
    assert weight_spy.data == []
    # Without MTP the same checkpoint loads: its mtp.* tensors are never read.
    m = load_model(ckpt, "float32", with_mtp=False)
    assert not m.has_mtp


def test_per_expert_unquantized_draft_still_loads(split, tmp_path):
    """Control: the per-expert BF16 layout (the reader stacks it) is accepted."""
    t = _mtp_tensors()
    out = {k: v for k, v in t.items() if not k.startswith(P)}
    gu, down = t[P + "gate_up_proj"], t[P + "down_proj"]
    for e in range(E):
        out[f"{P}{e}.gate_proj.weight"] = gu[e, :I].astype(ml_dtypes.bfloat16)
        out[f"{P}{e}.up_proj.weight"] = gu[e, I:].astype(ml_dtypes.bfloat16)
        out[f"{P}{e}.down_proj.weight"] = down[e].astype(ml_dtypes.bfloat16)
    draft = tmp_path / "draft"
    draft.mkdir()
    save_file(out, str(draft / "model.safetensors"))
    m = load_model(split[0], "float32", draft_path=str(draft))
    assert m.has_mtp
