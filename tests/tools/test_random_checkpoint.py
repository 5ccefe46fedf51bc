"""mtp_jax.tools.random_checkpoint: released layout, sharding, index, layouts, streaming."""

from __future__ import annotations

import copy
import glob
import json
import os
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from mtp_jax.config import ConfigError, ModelConfig
from mtp_jax.models.qwen3_5 import random_checkpoint as family_rc
from mtp_jax.tools import random_checkpoint as rc
from mtp_jax.weights import names
from tests.helpers.paths import CONFIGS


_TEXT = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": 512, "hidden_size": 32, "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25,
                        "_note": "nested private key"},
    "mtp_num_hidden_layers": 1, "tie_word_embeddings": False, "eos_token_id": 1,
    "dtype": "bfloat16", "_derived": {"x": 1},
}
MOE = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
       "text_config": _TEXT, "_provenance": {"a": [{"_b": 1}]}}


def dense_flat() -> dict:
    d = copy.deepcopy(_TEXT)
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size"):
        d.pop(k)
    d.update(model_type="qwen3_5_text", intermediate_size=48, tie_word_embeddings=True)
    return d


def read_checkpoint(path: str) -> tuple[dict, dict[str, tuple[int, ...]], dict[str, str]]:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "np") as f:
            for k in f.keys():
                assert k not in shapes, f"{k} in two shards"
                shapes[k] = tuple(f.get_slice(k).get_shape())
                where[k] = os.path.basename(file)
    return index, shapes, where


def tensor(path: str, name: str) -> np.ndarray:
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        file = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(path, file), "np") as f:
        return f.get_tensor(name)


def expected_shapes(cfg: ModelConfig, experts: str, mtp_experts: str | None = None,
                    mtp: bool = True) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    groups = [(names.target_tensors(cfg), experts)]
    if mtp:
        groups.append((names.mtp_tensors(cfg), mtp_experts or experts))
    for tensors, layout in groups:
        for c, shape in tensors.items():
            if layout == "per-expert" and c.endswith("mlp.experts.gate_up_proj"):
                p = c[: -len("gate_up_proj")]
                for e in range(shape[0]):
                    for proj in ("gate_proj", "up_proj"):
                        out[names.disk_name(cfg, f"{p}{e}.{proj}.weight")] = (shape[1] // 2,
                                                                              shape[2])
            elif layout == "per-expert" and c.endswith("mlp.experts.down_proj"):
                p = c[: -len("down_proj")]
                for e in range(shape[0]):
                    out[names.disk_name(cfg, f"{p}{e}.down_proj.weight")] = shape[1:]
            else:
                out[names.disk_name(cfg, c)] = tuple(shape)
    return out


def test_fused_sharded_layout_and_index(tmp_path):
    out = rc.write_random_checkpoint(MOE, str(tmp_path), shard_size_bytes=20_000)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    assert "_provenance" not in written and "_derived" not in written["text_config"]
    assert "_note" not in written["text_config"]["rope_parameters"]
    cfg = ModelConfig.from_dict(written)
    assert cfg.composite
    index, shapes, where = read_checkpoint(out)
    assert shapes == expected_shapes(cfg, "fused")
    assert index["weight_map"] == where
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.safetensors")))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(2 * int(np.prod(s)) for s in shapes.values())
    assert all(k.startswith(("model.language_model.", "lm_head.", "mtp.")) for k in shapes)
    assert any(k.startswith("mtp.layers.0.mlp.experts.") for k in shapes)
    # Shards respect the limit except a single oversized tensor (the embedding, lm_head).
    for file in files:
        members = [k for k, v in where.items() if v == file]
        size = sum(2 * int(np.prod(shapes[k])) for k in members)
        assert size <= 20_000 or len(members) == 1
    emb = tensor(out, "model.language_model.embed_tokens.weight")
    assert emb.dtype == ml_dtypes.bfloat16 and np.isfinite(emb.astype(np.float32)).all()


def test_per_expert_layout_matches_fused_values(tmp_path):
    fused = rc.write_random_checkpoint(MOE, str(tmp_path / "f"), shard_size_bytes=50_000)
    per = rc.write_random_checkpoint(MOE, str(tmp_path / "p"), experts="per-expert",
                                     mtp_experts="fused", shard_size_bytes=50_000)
    cfg = ModelConfig.from_dict(MOE)
    _, shapes, _ = read_checkpoint(per)
    assert shapes == expected_shapes(cfg, "per-expert", "fused")
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in shapes
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" not in shapes
    p = "model.language_model.layers.2.mlp.experts."
    gate_up = tensor(fused, p + "gate_up_proj")
    down = tensor(fused, p + "down_proj")
    i = cfg.moe_intermediate_size
    for e in range(cfg.num_experts):
        np.testing.assert_array_equal(tensor(per, f"{p}{e}.gate_proj.weight"), gate_up[e, :i])
        np.testing.assert_array_equal(tensor(per, f"{p}{e}.up_proj.weight"), gate_up[e, i:])
        np.testing.assert_array_equal(tensor(per, f"{p}{e}.down_proj.weight"), down[e])
    # Other tensors are identical whatever the layout and sharding.
    for k in ("mtp.fc.weight", "lm_head.weight",
              "model.language_model.layers.3.self_attn.q_proj.weight"):
        np.testing.assert_array_equal(tensor(per, k), tensor(fused, k))


def test_mtp_per_expert_trunk_fused_and_no_mtp(tmp_path):
    cfg = ModelConfig.from_dict(MOE)
    mixed = rc.write_random_checkpoint(MOE, str(tmp_path / "m"), mtp_experts="per-expert")
    _, shapes, _ = read_checkpoint(mixed)
    assert shapes == expected_shapes(cfg, "fused", "per-expert")
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in shapes
    none = rc.write_random_checkpoint(MOE, str(tmp_path / "n"), include_mtp=False)
    _, shapes, _ = read_checkpoint(none)
    assert shapes == expected_shapes(cfg, "fused", mtp=False)
    assert not any(k.startswith("mtp.") for k in shapes)


def test_dense_flat_tied_and_dtypes(tmp_path):
    d = dense_flat()
    cfg = ModelConfig.from_dict(d)
    f32 = rc.write_random_checkpoint(d, str(tmp_path / "f32"), dtype="float32")
    bf16 = rc.write_random_checkpoint(d, str(tmp_path / "bf16"), dtype="bfloat16")
    f16 = rc.write_random_checkpoint(d, str(tmp_path / "f16"), dtype="float16")
    _, shapes, _ = read_checkpoint(f32)
    assert shapes == expected_shapes(cfg, "fused")
    assert "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes
    assert all(k.startswith(("model.", "mtp.")) for k in shapes)
    with open(os.path.join(f32, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32"
    for k in shapes:
        a = tensor(f32, k)
        assert a.dtype == np.float32
        # bf16 is the round-to-nearest-even of the same float32 values; f16 likewise.
        np.testing.assert_array_equal(tensor(bf16, k), a.astype(ml_dtypes.bfloat16))
        np.testing.assert_array_equal(tensor(f16, k), a.astype(np.float16))


def test_init_values(tmp_path):
    out = rc.write_random_checkpoint(MOE, str(tmp_path), dtype="float32")
    p = "model.language_model.layers.0."
    np.testing.assert_array_equal(tensor(out, p + "linear_attn.norm.weight"), 1.0)
    a_log = tensor(out, p + "linear_attn.A_log")
    assert (a_log >= 0).all() and (a_log <= np.log(16) + 1e-6).all()
    assert (tensor(out, p + "linear_attn.dt_bias") < 0).all()
    norm = tensor(out, p + "input_layernorm.weight")
    assert 0 < np.abs(norm).max() < 0.2  # zero-centred: small around 0
    q = tensor(out, "model.language_model.layers.3.self_attn.q_proj.weight")
    assert abs(q.std() * np.sqrt(q.shape[1]) - 1) < 0.1
    emb = tensor(out, "model.language_model.embed_tokens.weight")
    assert len(np.unique(emb[:, 0])) == emb.shape[0]
    again = rc.write_random_checkpoint(MOE, str(tmp_path / "again"), dtype="float32")
    np.testing.assert_array_equal(tensor(again, "mtp.fc.weight"), tensor(out, "mtp.fc.weight"))
    other = rc.write_random_checkpoint(MOE, str(tmp_path / "seed1"), dtype="float32", seed=1)
    assert not np.array_equal(tensor(other, "mtp.fc.weight"), tensor(out, "mtp.fc.weight"))


def test_streaming_memory_is_bounded(tmp_path, monkeypatch):
    """A 64 MB checkpoint is written with a few MB of traced allocations: tensors are generated
    chunk by chunk and written straight to the file, never held whole."""
    big = copy.deepcopy(MOE)
    big["text_config"].update(vocab_size=65536, hidden_size=256, num_attention_heads=4,
                              head_dim=64)
    monkeypatch.setattr(family_rc, "CHUNK_ELEMENTS", 1 << 16)
    tracemalloc.start()
    try:
        out = rc.write_random_checkpoint(big, str(tmp_path), shard_size_bytes=16 << 20,
                                         workers=2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    index, shapes, _ = read_checkpoint(out)
    total = index["metadata"]["total_size"]
    assert total > 64 << 20
    assert len(set(index["weight_map"].values())) >= 4
    assert peak < 8 << 20, f"peak traced memory {peak} bytes for a {total}-byte checkpoint"


def test_cli(tmp_path):
    cfg_file = tmp_path / "cfg.json"
    cfg_file.write_text(json.dumps(MOE))
    out = tmp_path / "out"
    rc.main(["--config", str(cfg_file), "--out", str(out), "--experts", "per-expert",
             "--no-mtp", "--dtype", "float16", "--shard-size-gb", "0.00002", "--seed", "3"])
    index, shapes, _ = read_checkpoint(str(out))
    cfg = ModelConfig.from_dict(MOE)
    assert shapes == expected_shapes(cfg, "per-expert", mtp=False)
    assert len(set(index["weight_map"].values())) > 1
    assert tensor(str(out), "model.language_model.norm.weight").dtype == np.float16


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        rc.write_random_checkpoint(MOE, str(tmp_path / "a"), tokenizer=True)
    with pytest.raises(ValueError, match="layout"):
        rc.write_random_checkpoint(MOE, str(tmp_path / "b"), experts="stacked")
    with pytest.raises(ValueError, match="dtype"):
        rc.write_random_checkpoint(MOE, str(tmp_path / "c"), dtype="int8")
    with pytest.raises(ConfigError):
        rc.write_random_checkpoint(os.path.join(CONFIGS, "Qwen3-Next-80B-A3B-Instruct.json"),
                                   str(tmp_path / "d"))


def test_cli_names_a_missing_config(tmp_path, capsys):
    """A --config that is not there (or a folder without config.json) is refused naming the
    flag, the path and the fix, before --out is made."""
    for path, what in [(tmp_path / "nope.json", "no such file"),
                       (tmp_path, "a folder without config.json")]:
        assert rc.main(["--config", str(path), "--out", str(tmp_path / "out")]) == 2
        assert (f"error: --config {path}: {what}; pass a model config JSON (e.g. "
                "configs/Qwen3.5-2B.json) or a checkpoint folder holding config.json."
                ) in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# text + MTP bf16 bytes of the released checkpoints (shared/real_configs/README.md, table 1).
RELEASED_BF16_BYTES = {
    "Qwen3.5-0.8B.json": 1_545_691_776, "Qwen3.5-2B.json": 3_885_306_496,
    "Qwen3.5-4B.json": 8_652_701_696, "Qwen3.5-9B.json": 18_394_187_776,
    "Qwen3.5-27B.json": 54_641_395_712, "Qwen3.6-27B.json": 54_641_395_712,
    "Qwen3.8-27B.json": 54_641_395_712, "Qwen3.5-35B-A3B.json": 71_010_502_912,
    "Qwen3.6-35B-A3B.json": 71_010_502_912, "Qwen3.5-122B-A10B.json": 249_270_412_288,
    "Qwen3.5-397B-A17B.json": 805_883_836_928,
}


@pytest.mark.parametrize("name", sorted(RELEASED_BF16_BYTES))
def test_real_config_plans_match_released_sizes(name):
    """Planning (no generation) a real config gives exactly the released byte count."""
    path = os.path.join(CONFIGS, name)
    with open(path) as f:
        assert not any(k.startswith("_") for k in json.load(f))
    _, plans = family_rc.plan_checkpoint(path)
    assert sum(p.nbytes(2) for p in plans) == RELEASED_BF16_BYTES[name]
    shards = family_rc.shard_plans(plans, 2, 2 << 30)
    assert all(sum(p.nbytes(2) for p in s) <= 2 << 30 or len(s) == 1 for s in shards)


def test_cli_refuses_a_folder_holding_a_checkpoint(tmp_path, capsys):
    """A second write into one --out is refused (naming the folder, its files and the fix)
    and leaves the first checkpoint as it was; --overwrite replaces it, deleting the old
    format's files (no GGUF left beside the new safetensors); other files stay."""
    from tests.helpers.paths import fixture_path

    qwen4 = fixture_path("tiny_qwen4_exp")
    out = tmp_path / "out"
    gguf_args = ["--config", qwen4, "--out", str(out), "--format", "gguf"]
    assert rc.main(gguf_args) == 0
    (out / "notes.txt").write_text("mine")
    before = {f: os.path.getmtime(out / f) for f in ("model.gguf", "mtp.gguf")}
    capsys.readouterr()
    assert rc.main(gguf_args + ["--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert (f"error: --out {out} already holds a checkpoint (model.gguf, mtp.gguf); writing "
            "into it would replace or mix with its files. Pass --overwrite to replace it, or "
            "another --out folder.") in err
    assert {f: os.path.getmtime(out / f) for f in before} == before
    assert rc.main(["--config", qwen4, "--out", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "notes.txt"]
    assert rc.main(["--config", qwen4, "--out", str(out)]) == 2
    assert "already holds a checkpoint (config.json, model.safetensors)" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_refused_tokenizer_leaves_no_empty_out_folder(tmp_path, capsys, fmt):
    """``--tokenizer`` on a config whose vocabulary is smaller than Qwen's is refused with the
    bound its help states, and the ``--out`` folder the run would have created is not left
    behind empty; an ``--out`` that existed before stays."""
    from mtp_jax.tools.random_checkpoint import main
    from tests.helpers.paths import fixture_path

    out = tmp_path / "new"
    assert main(["--config", fixture_path("tiny_qwen4_exp"), "--out", str(out),
                 "--tokenizer", "--format", fmt]) == 2
    assert "vocab_size >= 248077" in capsys.readouterr().err
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    assert main(["--config", fixture_path("tiny_qwen4_exp"), "--out", str(kept),
                 "--tokenizer", "--format", fmt]) == 2
    assert kept.is_dir()
