"""A separate MTP draft folder (--speculative-draft-model-path) gives the same drafts as the
checkpoint's own mtp.* tensors; bad draft folders are refused before weights load."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtp_jax import LLM, ConfigError, SamplingParams
from tests.helpers.paths import fixture_path

SRC = fixture_path("tiny_moe_fused")


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    tensors = load_file(os.path.join(SRC, "model.safetensors"))
    target, draft = root / "target", root / "draft"
    target.mkdir()
    draft.mkdir()
    shutil.copy(os.path.join(SRC, "config.json"), target / "config.json")
    shutil.copy(os.path.join(SRC, "config.json"), draft / "config.json")
    save_file({k: v for k, v in tensors.items() if not k.startswith("mtp.")},
              str(target / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k.startswith("mtp.")},
              str(draft / "model.safetensors"))
    return str(target), str(draft)


def test_separate_draft_folder_matches_own_mtp(split):
    target, draft = split
    prompt = np.random.default_rng(1).integers(2, 300, 9).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    own = LLM(SRC, dtype="float32", speculative_num_steps=2).generate([prompt], params)[0]
    sep = LLM(target, dtype="float32", speculative_num_steps=2,
              speculative_draft_model_path=draft).generate([prompt], params)[0]
    assert sep.token_ids == own.token_ids
    assert (sep.num_rounds, sep.num_accepted_tokens) == (own.num_rounds, own.num_accepted_tokens)


def test_draft_folder_refusals(split, tmp_path):
    target, _ = split
    with pytest.raises(ConfigError, match="holds no mtp"):
        LLM(SRC, dtype="float32", speculative_draft_model_path=target)
    with pytest.raises(ConfigError, match="is not a folder"):
        LLM(SRC, dtype="float32", speculative_draft_model_path=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="only applies"):
        LLM(SRC, dtype="float32", speculative_algorithm="none",
            speculative_draft_model_path=target)
    other = tmp_path / "other"
    shutil.copytree(split[1], other)
    cfg = json.load(open(other / "config.json"))
    cfg["hidden_size"] = 32
    json.dump(cfg, open(other / "config.json", "w"))
    with pytest.raises(ConfigError, match="hidden_size"):
        LLM(SRC, dtype="float32", speculative_draft_model_path=str(other))
