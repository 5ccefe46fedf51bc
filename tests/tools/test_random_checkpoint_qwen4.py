"""mtp_jax.tools.random_checkpoint for qwen4_exp configs: the real Qwen tokenizer beside the
weights (``--tokenizer``: the tool's own writer, as for the Qwen3.5 family), per-expert layouts
that load to the same model as the fused one, and the options it refuses."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from mtp_jax.models.loader import load_model
from mtp_jax.tokenizer import Tokenizer
from mtp_jax.tools import qwen_vocab
from mtp_jax.tools import random_checkpoint as rc
from mtp_jax.weights.safetensors_files import read_header
from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_exp")
VOCAB = 248320  # the released vocab_size: --tokenizer needs >= the tokenizer's 248,077 ids
P = "model.language_model.layers.0.mlp.experts."


def _config(vocab: int = VOCAB) -> dict:
    with open(os.path.join(FIX, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"]["vocab_size"] = vocab
    return raw


@pytest.fixture(scope="module")
def fused(tmp_path_factory, vocab_cache) -> str:
    out = str(tmp_path_factory.mktemp("qwen4_fused"))
    return rc.write_random_checkpoint(_config(), out, dtype="float32", seed=5, tokenizer=True,
                                      cache_dir=vocab_cache)


def test_tokenizer_files_and_round_trip(fused):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "config.json", "model.safetensors"):
        assert os.path.isfile(os.path.join(fused, name)), name
    tok = Tokenizer.from_folder(fused)
    assert tok is not None
    text = "Hello world! 你好, qwen4_exp."
    ids = tok.encode(text)
    assert ids and max(ids) < VOCAB
    assert tok.decode(ids) == text
    # Logit (and embedding) rows past the tokenizer's ids are zero, as for Qwen3.5.
    n_tok = len(qwen_vocab.load_ranks()) + len(qwen_vocab.special_tokens())
    with safe_open(os.path.join(fused, "model.safetensors"), "np") as f:
        for k in ("lm_head.weight", "model.language_model.embed_tokens.weight"):
            w = f.get_tensor(k)
            assert w.shape == (VOCAB, 32)
            assert not w[n_tok:].any() and np.abs(w[:n_tok]).max(axis=1).min() > 0


def test_per_expert_loads_to_the_fused_model(fused, tmp_path, vocab_cache):
    per = rc.write_random_checkpoint(_config(), str(tmp_path / "per"), dtype="float32", seed=5,
                                     experts="per-expert", tokenizer=True, cache_dir=vocab_cache)
    mixed = rc.write_random_checkpoint(_config(256), str(tmp_path / "mixed"), dtype="float32",
                                       mtp_experts="per-expert")
    hdr_f = read_header(os.path.join(fused, "model.safetensors"))
    hdr_p = read_header(os.path.join(per, "model.safetensors"))
    hdr_m = read_header(os.path.join(mixed, "model.safetensors"))
    assert P + "gate_up_proj" in hdr_f and P + "gate_up_proj" not in hdr_p
    assert P + "gate_up_proj" in hdr_m and "mtp.layers.0.mlp.experts.gate_up_proj" not in hdr_m
    for e in range(8):  # num_experts of the fixture
        for proj, shape in (("gate_proj", (16, 32)), ("up_proj", (16, 32)),
                            ("down_proj", (32, 16))):
            for hdr, prefix in ((hdr_p, P), (hdr_p, "mtp.layers.0.mlp.experts."),
                                (hdr_m, "mtp.layers.0.mlp.experts.")):
                assert tuple(hdr[f"{prefix}{e}.{proj}.weight"].shape) == shape
    # Per-expert values are the fused tensors split (gate rows first).
    with safe_open(os.path.join(fused, "model.safetensors"), "np") as f, \
            safe_open(os.path.join(per, "model.safetensors"), "np") as g:
        gate_up, down = f.get_tensor(P + "gate_up_proj"), f.get_tensor(P + "down_proj")
        for e in range(8):
            np.testing.assert_array_equal(g.get_tensor(f"{P}{e}.gate_proj.weight"),
                                          gate_up[e, :16])
            np.testing.assert_array_equal(g.get_tensor(f"{P}{e}.up_proj.weight"),
                                          gate_up[e, 16:])
            np.testing.assert_array_equal(g.get_tensor(f"{P}{e}.down_proj.weight"), down[e])
    assert sorted(os.listdir(per)) == sorted(os.listdir(fused))

    ids = np.array([[3, 17, 250, 1000, 248000, 5]])
    m_f, m_p = load_model(fused, "float32"), load_model(per, "float32")
    assert m_f.has_mtp and m_p.has_mtp
    logits_f, streams_f = m_f.forward(ids)
    logits_p, streams_p = m_p.forward(ids)
    np.testing.assert_array_equal(np.asarray(logits_p), np.asarray(logits_f))
    np.testing.assert_array_equal(np.asarray(streams_p), np.asarray(streams_f))
    assert np.isfinite(np.asarray(logits_f)).all()
    assert load_model(mixed, "float32").has_mtp


def test_errors(tmp_path, vocab_cache):
    with pytest.raises(ValueError, match="vocab_size"):  # the fixture's 256 ids: no tokenizer
        rc.write_random_checkpoint(_config(256), str(tmp_path / "a"), tokenizer=True,
                                   cache_dir=vocab_cache)
    with pytest.raises(ValueError, match="experts='stacked'"):
        rc.write_random_checkpoint(_config(256), str(tmp_path / "b"), experts="stacked")
    with pytest.raises(ValueError, match="mtp_experts='stacked'"):
        rc.write_random_checkpoint(_config(256), str(tmp_path / "c"), mtp_experts="stacked")
    with pytest.raises(ValueError, match="dtype"):
        rc.write_random_checkpoint(_config(256), str(tmp_path / "d"), dtype="int8")
    with pytest.raises(ValueError, match="--shard-size-gb"):  # one file, never sharded
        rc.write_random_checkpoint(_config(256), str(tmp_path / "e"), shard_size_bytes=1000)
    assert not os.path.exists(tmp_path / "e")
    # The CLI reports it as an error, exit status 2.
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(_config(256)))
    assert rc.main(["--config", str(cfg), "--out", str(tmp_path / "f"),
                    "--shard-size-gb", "0.000001"]) == 2
    assert rc.main(["--config", str(cfg), "--out", str(tmp_path / "g"), "--dtype", "float32",
                    "--experts", "per-expert", "--no-mtp"]) == 0
    hdr = read_header(str(tmp_path / "g" / "model.safetensors"))
    assert P + "7.down_proj.weight" in hdr and not any(k.startswith("mtp.") for k in hdr)
