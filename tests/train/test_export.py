"""Exporting a trained MTP head (mtp_jax.train.export) and a fresh one (mtp_jax.train.fresh).

What was written is read back with the ``safetensors`` library (an independent reader), and the
output folders are loaded with ``load_model`` to check that the engine takes them: the mtp
params equal the exported tensors, the target params the source's.
"""

import dataclasses
import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import mtp_jax
from mtp_jax.config import ConfigError
from mtp_jax.models.qwen3_5.random_checkpoint import write_random
from mtp_jax.models.registry import read_config
from mtp_jax.train import export
from mtp_jax.train.export import write_draft_checkpoint
from mtp_jax.train.fresh import fresh_draft_tensors, read_initializer_range
from mtp_jax.weights import names
from tests.helpers.paths import fixture_path

DENSE, FUSED, PER_EXPERT = (fixture_path(n) for n in
                            ("tiny_dense", "tiny_moe_fused", "tiny_moe_mtp_per_expert"))
EXPERTS = "mtp.layers.0.mlp.experts."
I = 32  # moe_intermediate_size of the MoE fixtures


# ---- helpers ---------------------------------------------------------------------------------

def head(cfg, seed=0):
    """Random canonical mtp tensors of ``cfg`` (float32, std 1: values differ everywhere)."""
    rng = np.random.default_rng(seed)
    shapes = names.mtp_tensors(export.with_mtp_layer(cfg))
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def read_folder(folder):
    """name -> (file, numpy array in its stored dtype) of every *.safetensors in ``folder``."""
    out = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(folder, fn), framework="numpy") as f:
                for n in f.keys():
                    assert n not in out, f"{n} stored twice"
                    out[n] = (fn, f.get_tensor(n))
    return out


def flat_params(model):
    flat = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = np.asarray(v)
    walk(nnx.to_pure_dict(model.params), "")
    return flat


def load(path, **kw):
    return flat_params(mtp_jax.load_model(path, dtype="float32", merge_projections=False, **kw))


def check_mtp_params(params, tensors, dtype=np.float32):
    mtp = {n: a for n, a in params.items() if n.startswith("mtp.")}
    assert set(mtp) == set(tensors)
    for n, a in mtp.items():
        np.testing.assert_array_equal(a, tensors[n].astype(dtype).astype(np.float32), err_msg=n)


def check_target_params(params, source_params):
    target = {n: a for n, a in params.items() if not n.startswith("mtp.")}
    assert set(target) == {n for n in source_params if not n.startswith("mtp.")}
    for n, a in target.items():
        np.testing.assert_array_equal(a, source_params[n], err_msg=n)


def check_index(out):
    """The index maps every stored tensor to the file that holds it, and nothing else."""
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    stored = read_folder(out)
    assert index["weight_map"] == {n: fn for n, (fn, _) in stored.items()}
    assert index["metadata"]["total_size"] == sum(a.nbytes for _, a in stored.values())


def mtp_config_value(out):
    """``mtp_num_hidden_layers`` of ``out/config.json`` (text_config's in a composite)."""
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    return raw.get("text_config", raw)["mtp_num_hidden_layers"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Sources built here: a bf16 random checkpoint in small shards, a fused source with
    ``.weight``-suffixed mtp experts and an F16 mtp.fc, and two checkpoints without mtp."""
    base = tmp_path_factory.mktemp("sources")
    with open(os.path.join(DENSE, "config.json")) as f:
        dense_raw = json.load(f)
    with open(os.path.join(FUSED, "config.json")) as f:
        moe_raw = json.load(f)
    sharded = write_random(dense_raw, str(base / "sharded"), dtype="bfloat16",
                           shard_size_bytes=60_000, seed=3)
    suffix = base / "suffix"
    shutil.copytree(FUSED, suffix)
    t = load_file(os.path.join(FUSED, "model.safetensors"))
    for p in ("gate_up_proj", "down_proj"):
        t[EXPERTS + p + ".weight"] = t.pop(EXPERTS + p)
    t["mtp.fc.weight"] = t["mtp.fc.weight"].astype(np.float16)
    save_file(t, str(suffix / "model.safetensors"))
    no_mtp = base / "no_mtp"  # the fused fixture without mtp, in bf16, declaring none
    no_mtp.mkdir()
    t = {n: a.astype(ml_dtypes.bfloat16) for n, a in
         load_file(os.path.join(FUSED, "model.safetensors")).items() if not n.startswith("mtp.")}
    save_file(t, str(no_mtp / "model.safetensors"))
    with open(no_mtp / "config.json", "w") as f:
        json.dump(dict(moe_raw, mtp_num_hidden_layers=0), f)
    (no_mtp / "tokenizer_config.json").write_text("{}")
    (no_mtp / "sub").mkdir()
    with open(os.path.join(PER_EXPERT, "config.json")) as f:
        composite = json.load(f)  # mtp_num_hidden_layers under text_config
    composite["text_config"]["mtp_num_hidden_layers"] = 0
    per_expert = write_random(composite, str(base / "per_expert"), dtype="float16",
                              experts="per-expert", seed=4)
    return dict(sharded=sharded, suffix=str(suffix), no_mtp=str(no_mtp), per_expert=per_expert)


@pytest.fixture(scope="module")
def source_params():
    return {p: load(p) for p in (DENSE, FUSED, PER_EXPERT)}


# ---- complete checkpoints --------------------------------------------------------------------

def test_per_expert_source_keeps_its_layout(tmp_path, source_params):
    cfg = read_config(PER_EXPERT)
    t = head(cfg)
    out = write_draft_checkpoint(PER_EXPERT, cfg, t, str(tmp_path / "out"))
    stored = read_folder(out)
    src = read_folder(PER_EXPERT)
    mtp = {n: a for n, (fn, a) in stored.items() if fn == "mtp.safetensors"}
    assert set(mtp) == {n for n in src if n.startswith("mtp.")}
    for e in range(8):
        gu, down = t[EXPERTS + "gate_up_proj"][e], t[EXPERTS + "down_proj"][e]
        np.testing.assert_array_equal(mtp[f"{EXPERTS}{e}.gate_proj.weight"], gu[:I])
        np.testing.assert_array_equal(mtp[f"{EXPERTS}{e}.up_proj.weight"], gu[I:])
        np.testing.assert_array_equal(mtp[f"{EXPERTS}{e}.down_proj.weight"], down)
    np.testing.assert_array_equal(mtp["mtp.fc.weight"], t["mtp.fc.weight"])
    assert all(a.dtype == np.float32 for a in mtp.values())
    # the one mixed shard is rewritten without its mtp tensors, bytes unchanged
    assert not os.path.islink(os.path.join(out, "model.safetensors"))
    rest = {n: a for n, (fn, a) in stored.items() if fn == "model.safetensors"}
    assert set(rest) == {n for n in src if not n.startswith("mtp.")}
    for n, a in rest.items():
        assert a.tobytes() == src[n][1].tobytes(), n
    check_index(out)
    with open(os.path.join(PER_EXPERT, "config.json")) as f:
        assert json.load(open(os.path.join(out, "config.json"))) == json.load(f)
    with open(os.path.join(PER_EXPERT, "golden.npz"), "rb") as f:
        assert open(os.path.join(out, "golden.npz"), "rb").read() == f.read()
    params = load(out)
    check_mtp_params(params, t)
    check_target_params(params, source_params[PER_EXPERT])


@pytest.mark.parametrize("source", [FUSED, DENSE], ids=["moe_fused", "dense_two_shards"])
def test_fused_and_dense_sources(tmp_path, source_params, source):
    cfg = read_config(source)
    t = head(cfg, 1)
    out = write_draft_checkpoint(source, cfg, t, str(tmp_path / "out"))
    stored = read_folder(out)
    mtp = {n: a for n, (fn, a) in stored.items() if fn == "mtp.safetensors"}
    assert set(mtp) == set(t)  # fused experts keep their canonical names
    for n, a in mtp.items():
        np.testing.assert_array_equal(a, t[n], err_msg=n)
    assert not any(os.path.islink(os.path.join(out, f)) for f in os.listdir(out))
    assert {fn for fn, _ in stored.values()} == {"mtp.safetensors"} | set(
        fn for fn in os.listdir(source) if fn.endswith(".safetensors"))
    check_index(out)
    params = load(out)
    check_mtp_params(params, t)
    check_target_params(params, source_params[source])


def test_bf16_shards_linked_rewritten_or_dropped(tmp_path, made):
    src = made["sharded"]
    cfg = read_config(src)
    t = head(cfg, 2)
    out = write_draft_checkpoint(src, cfg, t, str(tmp_path / "out"))
    by_file = {}
    for n, (fn, _) in read_folder(src).items():
        by_file.setdefault(fn, []).append(n.startswith("mtp."))
    linked = [fn for fn, m in by_file.items() if not any(m)]
    assert linked and any(all(m) for m in by_file.values())  # the source has both kinds
    for fn, mtp in by_file.items():
        path = os.path.join(out, fn)
        if not any(mtp):
            assert os.path.islink(path) and os.readlink(path) == os.path.join(src, fn)
        elif all(mtp):
            assert not os.path.exists(path)
        else:
            assert not os.path.islink(path)
    mtp = load_file(os.path.join(out, "mtp.safetensors"))
    for n, a in mtp.items():
        assert a.dtype == ml_dtypes.bfloat16, n
        np.testing.assert_array_equal(a, t[n].astype(ml_dtypes.bfloat16), err_msg=n)
    check_index(out)
    check_mtp_params(load(out), t, ml_dtypes.bfloat16)


def test_fused_weight_suffix_and_per_tensor_dtypes_kept(tmp_path, made):
    cfg = read_config(made["suffix"])
    t = head(cfg, 3)
    out = write_draft_checkpoint(made["suffix"], cfg, t, str(tmp_path / "out"))
    mtp = load_file(os.path.join(out, "mtp.safetensors"))
    assert EXPERTS + "gate_up_proj.weight" in mtp and EXPERTS + "gate_up_proj" not in mtp
    assert mtp["mtp.fc.weight"].dtype == np.float16
    assert mtp["mtp.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(mtp[EXPERTS + "gate_up_proj.weight"], t[EXPERTS + "gate_up_proj"])
    check_mtp_params(load(out), {n: (a.astype(np.float16) if n == "mtp.fc.weight" else a)
                                 for n, a in t.items()})


@pytest.mark.parametrize("kind", ["no_mtp", "per_expert"])
def test_fresh_head_into_a_checkpoint_without_mtp(tmp_path, made, kind):
    src = made[kind]
    cfg = read_config(src)
    assert cfg.mtp_num_hidden_layers == 0 and not any(
        n.startswith("mtp.") for n in read_folder(src))
    t = fresh_draft_tensors(cfg, seed=5, initializer_range=0.5)
    out = write_draft_checkpoint(src, cfg, t, str(tmp_path / "out"))
    mtp = load_file(os.path.join(out, "mtp.safetensors"))
    dtype = {"no_mtp": ml_dtypes.bfloat16, "per_expert": np.float16}[kind]  # embed_tokens'
    assert {a.dtype for a in mtp.values()} == {np.dtype(dtype)}
    per_expert_names = {f"{EXPERTS}{e}.{p}_proj.weight" for e in range(8)
                        for p in ("gate", "up", "down")}
    fused_names = {EXPERTS + "gate_up_proj", EXPERTS + "down_proj"}
    want = per_expert_names if kind == "per_expert" else fused_names
    assert want <= set(mtp) and not ((per_expert_names | fused_names) - want) & set(mtp)
    assert mtp_config_value(out) == 1
    if kind == "no_mtp":
        assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
        assert not os.path.exists(os.path.join(out, "sub"))
    check_mtp_params(load(out), t, dtype)


# ---- draft-only folders, dtype override ------------------------------------------------------

def test_draft_only_folder_loads_as_draft_path(tmp_path, source_params):
    cfg = read_config(PER_EXPERT)
    t = head(cfg, 6)
    out = write_draft_checkpoint(PER_EXPERT, cfg, t, str(tmp_path / "draft"), draft_only=True)
    assert sorted(os.listdir(out)) == ["config.json", "mtp.safetensors"]
    params = load(PER_EXPERT, draft_path=out)
    check_mtp_params(params, t)
    check_target_params(params, source_params[PER_EXPERT])


def test_dtype_override(tmp_path):
    cfg = read_config(FUSED)
    t = head(cfg, 7)
    out = write_draft_checkpoint(FUSED, cfg, t, str(tmp_path / "d"), draft_only=True,
                                 dtype="bfloat16")
    mtp = load_file(os.path.join(out, "mtp.safetensors"))
    assert {a.dtype for a in mtp.values()} == {np.dtype(ml_dtypes.bfloat16)}
    with pytest.raises(ConfigError, match="int8"):
        write_draft_checkpoint(FUSED, cfg, t, str(tmp_path / "e"), dtype="int8")


def test_bf16_tensors_and_no_source(tmp_path, source_params):
    cfg = read_config(FUSED)
    t = {n: a.astype(ml_dtypes.bfloat16) for n, a in head(cfg, 8).items()}
    out = write_draft_checkpoint(None, cfg, t, str(tmp_path / "d"), draft_only=True)
    assert os.listdir(out) == ["mtp.safetensors"]  # no source: no config.json
    mtp = load_file(os.path.join(out, "mtp.safetensors"))
    assert set(mtp) == set(t) and {a.dtype for a in mtp.values()} == {np.dtype(np.float32)}
    params = load(FUSED, draft_path=out)
    check_mtp_params(params, t)
    check_target_params(params, source_params[FUSED])


# ---- refusals ----------------------------------------------------------------------------------

def _refused(tmp_path, match, source=FUSED, cfg=None, tensors=None, **kw):
    cfg = cfg or read_config(FUSED)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=match):
        write_draft_checkpoint(source, cfg, head(cfg) if tensors is None else tensors,
                               str(out), **kw)
    assert not out.exists() and os.listdir(tmp_path) == []  # nothing half-written


def test_refusals_name_the_problem(tmp_path):
    cfg = read_config(FUSED)
    t = head(cfg)
    bad = dict(t, **{"mtp.fc.weight": t["mtp.fc.weight"][:, :5]})
    _refused(tmp_path, r"mtp\.fc\.weight has shape \[64, 5\]", tensors=bad)
    missing = {n: a for n, a in t.items() if n != "mtp.norm.weight"}
    _refused(tmp_path, r"missing: mtp\.norm\.weight", tensors=missing)
    extra = dict(t, **{"mtp.layers.1.x": t["mtp.fc.weight"]})
    _refused(tmp_path, r"not mtp\.\* tensors of this config: mtp\.layers\.1\.x", tensors=extra)
    nan = dict(t, **{"mtp.norm.weight": np.full(64, np.nan, np.float32)})
    _refused(tmp_path, r"mtp\.norm\.weight holds NaN", tensors=nan)
    _refused(tmp_path, "does not match", source=DENSE)  # a MoE head for a dense checkpoint
    _refused(tmp_path, "draft_only=True", source=None)


def test_refuses_a_used_output_folder(tmp_path):
    cfg = read_config(FUSED)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match=f"{used}.*not empty"):
        write_draft_checkpoint(FUSED, cfg, head(cfg), str(used))
    assert os.listdir(used) == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_draft_checkpoint(FUSED, cfg, head(cfg), str(empty), draft_only=True)
    assert sorted(os.listdir(empty)) == ["config.json", "mtp.safetensors"]


def test_a_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(export, "_write_target", boom)
    cfg = read_config(FUSED)
    with pytest.raises(OSError, match="disk full"):
        write_draft_checkpoint(FUSED, cfg, head(cfg), str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


# ---- fresh heads -------------------------------------------------------------------------------

def test_fresh_head_init():
    cfg = dataclasses.replace(read_config(FUSED), mtp_num_hidden_layers=0)
    t = fresh_draft_tensors(cfg, seed=1)
    shapes = names.mtp_tensors(dataclasses.replace(cfg, mtp_num_hidden_layers=1))
    assert {n: a.shape for n, a in t.items()} == shapes
    assert all(a.dtype == np.float32 for a in t.values())
    for n, a in t.items():
        if a.ndim == 1:
            assert "norm" in n and not a.any(), n  # zero-centred norms: scale 1 + 0
        else:
            assert abs(a.std() - 0.02) < 0.1 * 0.02 + 3 * 0.02 / np.sqrt(a.size), n
    again, other = fresh_draft_tensors(cfg, seed=1), fresh_draft_tensors(cfg, seed=2)
    assert all(np.array_equal(t[n], again[n]) for n in t)
    assert not np.array_equal(t["mtp.fc.weight"], other["mtp.fc.weight"])
    big = fresh_draft_tensors(cfg, seed=1, initializer_range=0.5)
    np.testing.assert_allclose(big["mtp.fc.weight"], 25 * t["mtp.fc.weight"], rtol=1e-6)


def test_read_initializer_range(tmp_path):
    assert read_initializer_range(DENSE) == 0.02  # under text_config
    assert read_initializer_range({"initializer_range": 0.1}) == 0.1
    assert read_initializer_range({"initializer_range": 0.1,
                                   "text_config": {"initializer_range": 0.05}}) == 0.05
    assert read_initializer_range({"text_config": {}}) == 0.02
    with pytest.raises(ConfigError, match="initializer_range"):
        read_initializer_range({"initializer_range": -1})


def test_output_has_the_usual_permissions(tmp_path):
    cfg = read_config(FUSED)
    out = write_draft_checkpoint(FUSED, cfg, head(cfg), str(tmp_path / "out"))
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "f").write_text("")
    assert os.stat(out).st_mode == os.stat(plain).st_mode
    for fn in ("mtp.safetensors", "model.safetensors", "config.json"):
        assert os.stat(os.path.join(out, fn)).st_mode == os.stat(plain / "f").st_mode, fn
