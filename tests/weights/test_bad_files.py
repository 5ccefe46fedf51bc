"""Bad checkpoint files (issue 4, part 3), made by corrupting copies of the tiny fixtures: each
is a ConfigError or CheckpointError naming the file and the fix, through LLM and the CLI; never
an exception from deep inside a reader, never a hang, never a tensor read before the refusal."""

import os
import re

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtp_jax import LLM, ConfigError
from mtp_jax.weights.safetensors_files import CheckpointError
from tests.helpers.refusals import DENSE, MOE, copy_ckpt, edit_config, weight_spy  # noqa: F401

SHARD2 = "model-00002-of-00002.safetensors"


def _rm(name):
    return lambda d: os.remove(os.path.join(d, name))


def _write(name, data: bytes):
    def f(d):
        with open(os.path.join(d, name), "wb") as fh:
            fh.write(data)
    return f


def _cut(name, keep):
    def f(d):
        p = os.path.join(d, name)
        data = open(p, "rb").read()
        open(p, "wb").write(data[:keep] if keep >= 0 else data[:keep])
    return f


def _garble_header(name):
    def f(d):
        p = os.path.join(d, name)
        data = bytearray(open(p, "rb").read())
        data[8:40] = b"\xff\xfe{not json at all!!!}\x00\x01\x02\x03\x04\x05\x06\x07\x08"
        open(p, "wb").write(bytes(data))
    return f


def _huge_header_length(name):
    def f(d):
        p = os.path.join(d, name)
        data = bytearray(open(p, "rb").read())
        data[:8] = (2**62).to_bytes(8, "little")
        open(p, "wb").write(bytes(data))
    return f


def _retype(name, tensor, dtype):
    def f(d):
        p = os.path.join(d, name)
        t = load_file(p)
        t[tensor] = t[tensor].astype(dtype)
        save_file(t, p)
    return f


def _reshape(name, tensor):
    def f(d):
        p = os.path.join(d, name)
        t = load_file(p)
        t[tensor] = np.ascontiguousarray(t[tensor][:, : t[tensor].shape[1] // 2])
        save_file(t, p)
    return f


def _config(**changes):
    return lambda d: edit_config(d, **changes)


def _config_text(text):
    return lambda d: open(os.path.join(d, "config.json"), "w").write(text)


ST = "model.safetensors"
# (id, source fixture, corruption, error type, message regex)
CASES = [
    ("missing_config", MOE, _rm("config.json"), ConfigError,
     r"has no config\.json; pass an HF checkpoint folder"),
    ("config_not_json", MOE, _config_text("{\"model_type\": "), ConfigError,
     r"cannot parse .*config\.json"),
    ("config_not_object", MOE, _config_text("[1, 2, 3]"), ConfigError,
     r"config\.json holds a JSON list, not an object"),
    ("config_bad_value", MOE, _config(hidden_size="big"), ConfigError,
     r"config\.json key 'hidden_size' is 'big'; expected an integer"),
    ("config_zero_heads", MOE, _config(num_attention_heads=0), ConfigError,
     r"'num_attention_heads' is 0; it must be >= 1"),
    ("config_missing_key", MOE, _config(vocab_size=None), ConfigError,
     r"config\.json has no 'vocab_size'"),
    ("unknown_model_type", MOE, _config(model_type="llama"), ConfigError,
     r"model_type 'llama' is not supported; mtp_jax reads qwen3_5, qwen3_5_moe"),
    ("no_weights", MOE, _rm(ST), CheckpointError,
     r"holds no model\.safetensors\.index\.json, no model\.safetensors and no \*\.safetensors"),
    ("shard_in_index_absent", DENSE, _rm(SHARD2), CheckpointError,
     r"names shard\(s\) missing from .*: model-00002-of-00002\.safetensors \(holds \d+ needed "
     r"tensors.*fetch the missing shard"),
    ("index_corrupt", DENSE, _write("model.safetensors.index.json", b"{\"weight_map\": "),
     CheckpointError, r"cannot parse .*model\.safetensors\.index\.json"),
    ("empty_file", MOE, _write(ST, b""), CheckpointError,
     r"model\.safetensors: only 0 bytes long.*truncated or corrupt"),
    ("truncated_header", MOE, _cut(ST, 200), CheckpointError,
     r"model\.safetensors: header length field says \d+ bytes but only 192 bytes follow it"),
    ("corrupt_header", MOE, _garble_header(ST), CheckpointError,
     r"model\.safetensors: header is not valid JSON.*truncated or corrupt"),
    ("huge_header_length", MOE, _huge_header_length(ST), CheckpointError,
     r"model\.safetensors: header length field says 4611686018427387904 bytes"),
    ("truncated_data", MOE, _cut(ST, -1000), CheckpointError,
     r"model\.safetensors: tensor '.*' ends at data byte \d+ but the data section holds only"),
    ("truncated_shard", DENSE, _cut(SHARD2, -10), CheckpointError,
     r"model-00002-of-00002\.safetensors: tensor .* ends at data byte"),
    ("shape_vs_config", MOE, _config(vocab_size=320), CheckpointError,
     r"'model\.embed_tokens\.weight' in model\.safetensors \(canonical embed_tokens\.weight\) has "
     r"shape \[300, 64\] but the config expects \[320, 64\] \(from vocab_size=320"),
    ("tensor_shape", MOE, _reshape(ST, "model.layers.0.mlp.shared_expert.up_proj.weight"),
     CheckpointError, r"shared_expert\.up_proj\.weight' in model\.safetensors .* has shape "
     r"\[32, 32\] but the config expects \[32, 64\]"),
    ("tensor_dtype", MOE, _retype(ST, "model.norm.weight", np.int32), CheckpointError,
     r"'model\.norm\.weight' in model\.safetensors \(for norm\.weight\) is stored as I32"),
    ("layers_vs_config", MOE, _config(num_hidden_layers=2, layer_types=None), CheckpointError,
     r"not expected by the config .*num_hidden_layers=2"),
]


def _corrupted(tmp_path, src, corrupt) -> str:
    d = copy_ckpt(src, tmp_path / "ckpt")
    corrupt(d)
    return d


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_file_through_llm(case, tmp_path, weight_spy):
    name, src, corrupt, etype, pattern = case
    d = _corrupted(tmp_path, src, corrupt)
    weight_spy.data.clear()
    with pytest.raises((ConfigError, CheckpointError)) as ei:
        LLM(d, dtype="float32", speculative_algorithm="none")
    assert type(ei.value) is etype, f"{name}: {type(ei.value).__name__}: {ei.value}"
    assert re.search(pattern, str(ei.value)), f"{name}: {ei.value}"
    assert weight_spy.data == [], f"{name}: tensor data was read before the refusal"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_file_through_cli(case, tmp_path, capsys):
    from mtp_jax import generate

    name, src, corrupt, etype, pattern = case
    d = _corrupted(tmp_path, src, corrupt)
    ids = tmp_path / "prompts.jsonl"  # the checkpoint has no tokenizer: token ids
    ids.write_text('{"prompt": [1, 2, 3]}\n')
    assert generate.main(["--model", d, "--spec-algo", "none", "--prompts-file", str(ids)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(pattern, err), err


def test_bad_draft_folder_files(tmp_path, weight_spy):
    """A draft folder with a corrupt header or a broken config is refused at config time."""
    from tests.helpers.refusals import split_moe

    target, draft = split_moe(tmp_path)
    _garble_header(ST)(draft)
    with pytest.raises(ConfigError, match=r"cannot read the draft folder .*header is not valid"):
        LLM(target, dtype="float32", speculative_draft_model_path=draft)
    edit_config(draft, model_type="gpt2")
    with pytest.raises(ConfigError, match=r"the draft folder .* has a config\.json mtp_jax cannot "
                                          r"use: model_type 'gpt2' is not supported"):
        LLM(target, dtype="float32", speculative_draft_model_path=draft)
    assert weight_spy.data == []
