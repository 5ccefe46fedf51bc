"""Tests of mtp_jax.weights.safetensors_reader on tiny synthetic checkpoints."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from mtp_jax.config import ModelConfig
from mtp_jax.weights import names
from mtp_jax.weights import safetensors_files as sr
from mtp_jax.weights.safetensors_files import CheckpointError, list_tensor_names
from mtp_jax.weights.safetensors_reader import load_tensors

F32, BF16, F16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)

_TEXT = {
    "vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
    "partial_rotary_factor": 0.5, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
    "linear_value_head_dim": 4, "linear_conv_kernel_dim": 4,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6,
    "shared_expert_intermediate_size": 4, "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": False, "eos_token_id": 1,
}


def tiny_cfg(composite: bool = True, **over) -> ModelConfig:
    text = dict(_TEXT, **over)
    if composite:
        return ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text})
    return ModelConfig.from_dict(dict(text, model_type="qwen3_5_moe_text"))


def expected_of(cfg, include_mtp=True):
    exp = dict(names.target_tensors(cfg))
    if include_mtp:
        exp.update(names.mtp_tensors(cfg))
    return exp


def build(cfg, *, layout=lambda p: "fused", stored=F32, include_mtp=True, seed=0):
    """Disk tensors of a checkpoint for ``cfg`` and the canonical float32 reference values.

    ``layout(prefix)`` picks "fused", "fused_suffix" (fused with a ``.weight`` suffix) or
    "per_expert" for each MoE layer prefix ("layers.0.", "mtp.layers.0.").
    """
    rng = np.random.default_rng(seed)
    prefix = "model.language_model." if cfg.composite else "model."

    def rand(shape):
        return rng.standard_normal(shape).astype(np.float32).astype(stored)

    disk, ref = {}, {}
    for c, shape in expected_of(cfg, include_mtp).items():
        d = c if c.startswith(("mtp.", "lm_head.")) else prefix + c
        if c.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            lay = layout(c[: c.index("mlp.experts.")])
            if lay == "per_expert":
                base = d[: -len("gate_up_proj")] if c.endswith("gate_up_proj") else \
                    d[: -len("down_proj")]
                n_exp = shape[0]
                if c.endswith("gate_up_proj"):
                    i = shape[1] // 2
                    gates = [rand((i, shape[2])) for _ in range(n_exp)]
                    ups = [rand((i, shape[2])) for _ in range(n_exp)]
                    for e in range(n_exp):
                        disk[f"{base}{e}.gate_proj.weight"] = gates[e]
                        disk[f"{base}{e}.up_proj.weight"] = ups[e]
                    # independent construction: [E, 2I, H] with gate rows first
                    ref[c] = np.stack([np.concatenate([g, u], axis=0)
                                       for g, u in zip(gates, ups)]).astype(np.float32)
                else:
                    downs = [rand(shape[1:]) for _ in range(n_exp)]
                    for e in range(n_exp):
                        disk[f"{base}{e}.down_proj.weight"] = downs[e]
                    ref[c] = np.stack(downs).astype(np.float32)
                continue
            if lay == "fused_suffix":
                d += ".weight"
        a = rand(shape)
        disk[d] = a
        ref[c] = a.astype(np.float32)
    return disk, ref


def save(folder, tensors, shards: int = 0, index_extra: dict | None = None):
    """Write ``tensors`` as one model.safetensors, or as ``shards`` files plus an index."""
    os.makedirs(folder, exist_ok=True)
    if not shards:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        return
    keys = sorted(tensors)
    wm = {}
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[s::shards]}
        save_file(part, os.path.join(folder, fn))
        wm.update({k: fn for k in part})
    wm.update(index_extra or {})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)


def check_equal(got, ref, dtype):
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert got[k].dtype == dtype, k
        assert got[k].shape == v.shape, k
        np.testing.assert_array_equal(got[k].astype(np.float32),
                                      v.astype(dtype).astype(np.float32), err_msg=k)


# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("composite", [True, False])
def test_prefixes(tmp_path, composite):
    cfg = tiny_cfg(composite)
    disk, ref = build(cfg)
    assert any(k.startswith("model.language_model." if composite else "model.layers.")
               for k in disk)
    save(tmp_path, disk)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    check_equal(got, ref, F32)


def test_text_only_checkpoint_with_composite_config(tmp_path):
    # The reader accepts either prefix whatever cfg.composite says.
    disk, ref = build(tiny_cfg(composite=False))
    save(tmp_path, disk)
    cfg = tiny_cfg(composite=True)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    check_equal(got, ref, F32)


def test_sharded_index_visual_skipped_and_put(tmp_path):
    cfg = tiny_cfg()
    disk, ref = build(cfg, seed=1)
    disk["model.visual.blocks.0.attn.qkv.weight"] = np.ones((3, 3), np.float32)
    disk["model.visual.patch_embed.proj.weight"] = np.ones((2,), np.uint8)  # never read
    save(tmp_path, disk, shards=3)
    seen = []

    def put(a):
        assert isinstance(a, np.ndarray)
        seen.append(a.shape)
        return ("put", a)

    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, put=put,
                       include_mtp=True)
    assert len(seen) == len(ref)
    assert all(v[0] == "put" for v in got.values())
    check_equal({k: v[1] for k, v in got.items()}, ref, F32)


def test_missing_shard_error_and_visual_only_shard_tolerated(tmp_path):
    cfg = tiny_cfg()
    disk, ref = build(cfg)
    # A visual-only shard that is listed but absent is fine: nothing in it is needed.
    save(tmp_path / "ok", disk, shards=2,
         index_extra={"model.visual.x.weight": "model-vision.safetensors"})
    got = load_tensors(str(tmp_path / "ok"), cfg, expected_of(cfg), dtype=np.float32,
                       include_mtp=True)
    check_equal(got, ref, F32)
    # A needed shard that is absent is an error naming it.
    save(tmp_path / "bad", disk, shards=2)
    os.remove(tmp_path / "bad" / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors") as ei:
        load_tensors(str(tmp_path / "bad"), cfg, expected_of(cfg), dtype=np.float32,
                     include_mtp=True)
    assert "missing" in str(ei.value)


def test_mtp_only_shard_missing_ok_without_mtp(tmp_path):
    cfg = tiny_cfg()
    disk, ref = build(cfg)
    trunk = {k: v for k, v in disk.items() if not k.startswith("mtp.")}
    save(tmp_path, trunk, shards=2,
         index_extra={k: "model-mtp.safetensors" for k in disk if k.startswith("mtp.")})
    exp = expected_of(cfg, include_mtp=False)
    got = load_tensors(str(tmp_path), cfg, exp, dtype=np.float32, include_mtp=False)
    check_equal(got, {k: ref[k] for k in exp}, F32)
    with pytest.raises(CheckpointError, match="model-mtp.safetensors"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)


@pytest.mark.parametrize("which", ["per_expert", "mixed", "mixed_reverse", "fused_suffix"])
def test_expert_layouts(tmp_path, which):
    cfg = tiny_cfg()
    layout = {
        "per_expert": lambda p: "per_expert",
        "mixed": lambda p: "per_expert" if p.startswith("mtp.") else "fused",
        "mixed_reverse": lambda p: "fused" if p.startswith("mtp.") else "per_expert",
        "fused_suffix": lambda p: "fused_suffix",
    }[which]
    disk, ref = build(cfg, layout=layout, seed=2)
    n_per_expert = sum(".experts.0." in k for k in disk)
    assert n_per_expert == {"per_expert": 9, "mixed": 3, "mixed_reverse": 6,
                            "fused_suffix": 0}[which]
    save(tmp_path, disk, shards=2)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    check_equal(got, ref, F32)


def test_stacked_values_exact(tmp_path):
    # Build the per-expert checkpoint by hand and compare against an explicit row layout.
    cfg = tiny_cfg()
    disk, _ = build(cfg, layout=lambda p: "per_expert")
    save(tmp_path, disk)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    i = cfg.moe_intermediate_size
    for p, dp in (("layers.1.", "model.language_model.layers.1."),
                  ("mtp.layers.0.", "mtp.layers.0.")):
        gu, dn = got[p + "mlp.experts.gate_up_proj"], got[p + "mlp.experts.down_proj"]
        assert gu.shape == (4, 2 * i, 8) and dn.shape == (4, 8, i)
        for e in range(4):
            assert np.array_equal(gu[e, :i], disk[f"{dp}mlp.experts.{e}.gate_proj.weight"])
            assert np.array_equal(gu[e, i:], disk[f"{dp}mlp.experts.{e}.up_proj.weight"])
            assert np.array_equal(dn[e], disk[f"{dp}mlp.experts.{e}.down_proj.weight"])


@pytest.mark.parametrize("stored", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("target", [F32, BF16, F16], ids=["to_f32", "to_bf16", "to_f16"])
def test_stored_dtypes(tmp_path, stored, target):
    cfg = tiny_cfg()
    disk, ref = build(cfg, stored=stored, layout=lambda p: "per_expert" if p == "layers.0."
                      else "fused", seed=3)
    save(tmp_path, disk)
    with open(tmp_path / "model.safetensors", "rb") as f:
        head = f.read(8 + int.from_bytes(f.read(8), "little"))
    tag = {F32: b'"F32"', BF16: b'"BF16"', F16: b'"F16"'}[stored]
    assert tag in head
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=target, include_mtp=True)
    check_equal(got, ref, target)


def test_mixed_stored_dtypes_in_one_stack(tmp_path):
    cfg = tiny_cfg()
    disk, ref = build(cfg, layout=lambda p: "per_expert", stored=BF16)
    disk["model.language_model.layers.0.mlp.experts.2.up_proj.weight"] = \
        disk["model.language_model.layers.0.mlp.experts.2.up_proj.weight"].astype(np.float32)
    save(tmp_path, disk)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    check_equal(got, ref, F32)


def test_include_mtp_false_never_reads_mtp(tmp_path, monkeypatch):
    cfg = tiny_cfg()
    disk, ref = build(cfg, layout=lambda p: "per_expert" if p.startswith("mtp.") else "fused")
    # Odd mtp tensors that would fail if they were considered at all.
    disk["mtp.fc.weight"] = np.zeros((3, 5), np.uint8)
    disk["mtp.bogus.weight"] = np.zeros((2,), np.float32)
    disk["mtp.layers.0.mlp.experts.9.gate_proj.weight"] = np.zeros((1,), np.float32)
    save(tmp_path, disk, shards=2)
    read = []
    orig = sr._read_raw

    def spy(mm, t):
        read.append(t.name)
        return orig(mm, t)

    monkeypatch.setattr(sr, "_read_raw", spy)
    exp = expected_of(cfg, include_mtp=False)
    got = load_tensors(str(tmp_path), cfg, exp, dtype=np.float32, include_mtp=False)
    check_equal(got, {k: ref[k] for k in exp}, F32)
    assert read and not [n for n in read if n.startswith("mtp.")]
    with pytest.raises(CheckpointError):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    with pytest.raises(ValueError, match="include_mtp=False"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=False)


def test_missing_tensors_listed(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    drop = sorted(k for k in disk if k.startswith(("model.language_model.layers.0.",
                                                   "model.language_model.layers.1.")))
    assert len(drop) > 20
    for k in drop:
        del disk[k]
    save(tmp_path, disk)
    with pytest.raises(CheckpointError) as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    msg = str(ei.value)
    assert f"{len(drop)} expected tensor(s) missing" in msg
    assert "layers.0.input_layernorm.weight" in msg
    assert f"({len(drop) - 20} more)" in msg


def test_missing_mtp_hint(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg, include_mtp=False)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError, match="no \\(complete\\) MTP weights"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)


def test_unconsumed_mtp_tensor(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    disk["mtp.layers.1.input_layernorm.weight"] = np.zeros((8,), np.float32)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError, match="mtp.layers.1.input_layernorm.weight") as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    assert "not consumed" in str(ei.value)
    # Without MTP it is ignored.
    load_tensors(str(tmp_path), cfg, expected_of(cfg, False), dtype=np.float32,
                 include_mtp=False)


def test_unexpected_trunk_tensor(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    disk["model.language_model.layers.2.input_layernorm.weight"] = np.zeros((8,), np.float32)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError, match="not expected by the config") as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    assert "layers.2.input_layernorm.weight" in str(ei.value)


def test_missing_experts_named(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg, layout=lambda p: "per_expert")
    del disk["model.language_model.layers.1.mlp.experts.2.up_proj.weight"]
    del disk["mtp.layers.0.mlp.experts.0.down_proj.weight"]
    del disk["mtp.layers.0.mlp.experts.3.down_proj.weight"]
    save(tmp_path, disk)
    with pytest.raises(CheckpointError) as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    msg = str(ei.value)
    assert "layers.1.mlp.experts.gate_up_proj: per-expert up_proj missing for expert(s) 2" in msg
    assert "mtp.layers.0.mlp.experts.down_proj: per-expert down_proj missing for expert(s) 0, 3" \
        in msg


def test_expert_index_out_of_range(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg, layout=lambda p: "per_expert")
    disk["model.language_model.layers.0.mlp.experts.4.down_proj.weight"] = \
        np.zeros((8, 6), np.float32)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError, match="experts.4.down_proj"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)


def test_shape_mismatch(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    disk["model.language_model.layers.1.self_attn.q_proj.weight"] = np.zeros((8, 8), np.float32)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError) as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    msg = str(ei.value)
    assert "layers.1.self_attn.q_proj.weight" in msg
    assert "[8, 8]" in msg and "[16, 8]" in msg
    assert "num_attention_heads=2" in msg and "head_dim=4" in msg


def test_per_expert_shape_mismatch(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg, layout=lambda p: "per_expert")
    disk["mtp.layers.0.mlp.experts.1.gate_proj.weight"] = np.zeros((5, 8), np.float32)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError, match=r"\[5, 8\].*needs \[6, 8\]") as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    assert "moe_intermediate_size=6" in str(ei.value)


def test_quantized_dtype_rejected(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    disk["model.language_model.layers.0.linear_attn.out_proj.weight"] = \
        np.zeros((8, 8), np.uint8)
    disk["model.language_model.layers.0.linear_attn.out_proj.weight_scale_inv"] = \
        np.zeros((1, 1), np.float32)
    save(tmp_path, disk)
    with pytest.raises(CheckpointError) as ei:
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    msg = str(ei.value)
    assert "layers.0.linear_attn.out_proj.weight" in msg and "U8" in msg
    assert "quantized" in msg


def test_duplicates(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    disk["model.embed_tokens.weight"] = disk["model.language_model.embed_tokens.weight"]
    save(tmp_path / "a", disk)
    with pytest.raises(CheckpointError, match="embed_tokens.weight is stored more than once"):
        load_tensors(str(tmp_path / "a"), cfg, expected_of(cfg), dtype=np.float32,
                     include_mtp=True)
    # Across files (no index): both files are named.
    disk, _ = build(cfg)
    os.makedirs(tmp_path / "b")
    save_file(disk, str(tmp_path / "b" / "one.safetensors"))
    save_file({"lm_head.weight": disk["lm_head.weight"]}, str(tmp_path / "b" / "two.safetensors"))
    with pytest.raises(CheckpointError) as ei:
        load_tensors(str(tmp_path / "b"), cfg, expected_of(cfg), dtype=np.float32,
                     include_mtp=True)
    msg = str(ei.value)
    assert "lm_head.weight" in msg and "one.safetensors" in msg and "two.safetensors" in msg
    # Fused and per-expert for one stack.
    disk, _ = build(cfg, layout=lambda p: "per_expert")
    disk["mtp.layers.0.mlp.experts.down_proj"] = np.zeros((4, 8, 6), np.float32)
    save(tmp_path / "c", disk)
    with pytest.raises(CheckpointError, match="both fused"):
        load_tensors(str(tmp_path / "c"), cfg, expected_of(cfg), dtype=np.float32,
                     include_mtp=True)


def _write_raw(path, header: bytes, data: bytes = b"", length: int | None = None):
    with open(path, "wb") as f:
        f.write((len(header) if length is None else length).to_bytes(8, "little"))
        f.write(header)
        f.write(data)


def test_corrupt_files(tmp_path):
    cfg = tiny_cfg()
    exp = expected_of(cfg)
    cases = {
        "short": lambda p: open(p, "wb").write(b"\x01\x02"),
        "trunc_header": lambda p: _write_raw(p, b'{"a": {"dtype"', length=1000),
        "bad_json": lambda p: _write_raw(p, b'{"a": [1, 2'),
        "not_object": lambda p: _write_raw(p, b'[1, 2]'),
        "trunc_data": lambda p: _write_raw(
            p, b'{"lm_head.weight":{"dtype":"F32","shape":[16,8],"data_offsets":[0,512]}}',
            b"\0" * 100),
        "size_mismatch": lambda p: _write_raw(
            p, b'{"lm_head.weight":{"dtype":"F32","shape":[16,8],"data_offsets":[0,500]}}',
            b"\0" * 512),
        "dup_key": lambda p: _write_raw(
            p, b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
               b'"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 4),
    }
    for name, make in cases.items():
        d = tmp_path / name
        d.mkdir()
        make(str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match="model.safetensors") as ei:
            load_tensors(str(d), cfg, exp, dtype=np.float32, include_mtp=True)
        assert "truncated or corrupt" in str(ei.value), name
    # Real file cut short.
    disk, _ = build(cfg)
    save(tmp_path / "cut", disk)
    p = tmp_path / "cut" / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 7])
    with pytest.raises(CheckpointError, match="truncated"):
        load_tensors(str(tmp_path / "cut"), cfg, exp, dtype=np.float32, include_mtp=True)


def test_bad_index_and_no_files(tmp_path):
    cfg = tiny_cfg()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="index.json"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    with pytest.raises(CheckpointError, match="not a folder"):
        list_tensor_names(str(tmp_path / "nope"))


def test_index_lists_tensor_absent_from_shard(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    save(tmp_path, disk, shards=2,
         index_extra={"model.language_model.layers.9.x.weight": "model-00002-of-00002.safetensors"})
    with pytest.raises(CheckpointError, match="not in the shard it names.*layers.9.x.weight"):
        load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)


def test_tied_checkpoint_with_stored_head(tmp_path):
    cfg = tiny_cfg(tie_word_embeddings=True)
    disk, ref = build(tiny_cfg())  # stores lm_head.weight
    save(tmp_path, disk)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=np.float32, include_mtp=True)
    assert "lm_head.weight" not in got
    check_equal(got, {k: ref[k] for k in expected_of(cfg)}, F32)


def test_list_tensor_names(tmp_path):
    cfg = tiny_cfg()
    disk, _ = build(cfg)
    save(tmp_path / "single", disk)
    names_single = list_tensor_names(str(tmp_path / "single"))
    assert names_single == {k: "model.safetensors" for k in disk}
    assert any(k.startswith("mtp.") for k in names_single)
    save(tmp_path / "sharded", disk, shards=2)
    os.remove(tmp_path / "sharded" / "model-00002-of-00002.safetensors")  # index suffices
    names_sharded = list_tensor_names(str(tmp_path / "sharded"))
    assert set(names_sharded) == set(disk)
    assert set(names_sharded.values()) == {"model-00001-of-00002.safetensors",
                                          "model-00002-of-00002.safetensors"}
    # Without an index or model.safetensors: every *.safetensors file.
    os.makedirs(tmp_path / "loose")
    keys = sorted(disk)
    save_file({k: disk[k] for k in keys[:5]}, str(tmp_path / "loose" / "a.safetensors"))
    save_file({k: disk[k] for k in keys[5:]}, str(tmp_path / "loose" / "b.safetensors"))
    loose = list_tensor_names(str(tmp_path / "loose"))
    assert loose == {k: ("a.safetensors" if k in keys[:5] else "b.safetensors") for k in keys}
    got = load_tensors(str(tmp_path / "loose"), cfg, expected_of(cfg), dtype=np.float32,
                       include_mtp=True)
    assert set(got) == set(expected_of(cfg))


def test_put_jax_device_put_bf16(tmp_path):
    jax = pytest.importorskip("jax")
    cfg = tiny_cfg()
    disk, ref = build(cfg, stored=BF16, layout=lambda p: "per_expert")
    save(tmp_path, disk)
    got = load_tensors(str(tmp_path), cfg, expected_of(cfg), dtype=ml_dtypes.bfloat16,
                       put=jax.device_put, include_mtp=True)
    assert all(isinstance(v, jax.Array) for v in got.values())
    check_equal({k: np.asarray(v) for k, v in got.items()}, ref, BF16)
