"""Random qwen4_exp checkpoints of shapes the golden fixture does not cover load and run."""

from __future__ import annotations

import json
import os

import numpy as np

from mtp_jax.models.qwen4_exp import load_qwen4_exp
from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp
from mtp_jax.weights.safetensors_files import read_header
from tests.helpers.paths import fixture_path

FIX = fixture_path("tiny_qwen4_exp")


def _other_shape():
    raw = json.load(open(os.path.join(FIX, "config.json")))
    tc = raw.pop("text_config")
    tc.update(num_hidden_layers=4, hc_count=2, output_gate_type="silu",
              layer_types=["full_attention", "linear_attention", "linear_attention",
                           "qwen_sparse_attention"],
              ple_layer_ids=[2, 3], split_ngram_parts=3, heads_per_ngram=1, ngram_size=4,
              ple_embed_dim=24)
    return tc  # flat text-only layout (model.*)


def test_random_checkpoint_sharded_tables_and_cached_decode(tmp_path):
    cfg = write_random_qwen4_exp(_other_shape(), str(tmp_path), dtype="float32", seed=3)
    hdr = read_header(os.path.join(tmp_path, "model.safetensors"))
    shards = sorted(n for n in hdr if "ngram_embedding.shard_" in n)
    assert len(shards) == 2 * 3 and all(n.startswith("model.layers.") for n in shards)
    assert cfg.ple_layers == (1, 2)
    m = load_qwen4_exp(str(tmp_path), "float32")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
    ids[0, 4] = cfg.eos_token_id
    full, streams = m.forward(ids)
    assert streams.shape == (2, 9, 2 * cfg.hidden_size)
    cache = m.new_cache(2, 12)  # token-by-token decode (one compiled shape) == full forward
    steps = np.concatenate([np.asarray(m.extend(cache, ids[:, t:t + 1])) for t in range(9)], 1)
    np.testing.assert_allclose(steps, np.asarray(full), atol=2e-4, rtol=2e-4)
    assert m.has_mtp and len(m.ple) == 2 and len(m.ple[1].table._parts) == 3
