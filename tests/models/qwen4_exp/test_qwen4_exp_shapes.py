"""qwen4_exp checkpoints of shapes the golden fixture does not have (stream counts, layer
patterns, PLE layers, compress ratios, prompt lengths that leave the QSA open group part full):
random tiny checkpoints written in the released layout; for each one

* greedy generation through ``LLM`` with its defaults (the batched engine, MTP at k = 3, the
  prefix cache on, PLE rows looked up on the host per round) equals the argmax of the
  cache-free full forward over prompt + generated tokens, and
* cached decoding (prefill of the prompt, optionally a multi-row chunk that starts inside a
  block, then one token per step across a page boundary) gives the full forward's logits.

hc_count 1 is refused at config time, as transformers refuses it.
"""

from __future__ import annotations

import numpy as np
import pytest

from mtp_jax import LLM, SamplingParams
from mtp_jax.config import ConfigError
from mtp_jax.models.qwen4_exp import Qwen4ExpConfig
from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp

Q, L = "qwen_sparse_attention", "linear_attention"
BASE = dict(
    model_type="qwen4_exp_text", vocab_size=64, hidden_size=16, num_attention_heads=2,
    num_key_value_heads=1, head_dim=8, partial_rotary_factor=0.5, rope_theta=10000.0,
    rms_norm_eps=1e-6, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, output_gate_type="sigmoid", num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=8,
    norm_topk_prob=True, tie_word_embeddings=False, mtp_num_hidden_layers=1,
    max_position_embeddings=4096, eos_token_id=1, hc_lowrank=4, indexer_n_heads=2,
    indexer_kv_heads=1, indexer_head_dim=8, ple_embed_dim=16, ple_conv_kernel_size=3,
    ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=20,
    make_ngram_vocab_size_divisible_by=8, seed=7, split_ngram_parts=2)
GEN = 11  # prompt + GEN > 16: decoding crosses a page boundary

# (id, config changes, prompt, multi-row chunk after the prompt, PLE backend)
SHAPES = [
    ("qsa_first_hc2_ple_first_and_last_linear",
     dict(hc_count=2, layer_types=[Q, L, L], ple_layer_ids=[2, 3], indexer_compress_ratio=3,
          indexer_budget=6), [5, 9, 1, 12, 3, 33, 8], 3, "disk"),
    ("one_qsa_hc4_no_ple_silu",
     dict(hc_count=4, layer_types=[L, "full_attention", L], indexer_compress_ratio=2,
          indexer_budget=2, output_gate_type="silu"), [4, 17, 2, 50, 6], 0, "memory"),
    ("alternating_hc4_ple_on_layer0_composite",
     dict(hc_count=4, layer_types=[L, Q, L, Q], ple_layer_ids=[1], indexer_compress_ratio=4,
          indexer_budget=8, split_ngram_parts=3), [7, 3, 1, 1, 40, 9], 0, "disk"),
]


def _config(changes, composite):
    text = dict(BASE, **changes)
    text["num_hidden_layers"] = len(text["layer_types"])
    if not composite:
        return text
    return {"model_type": "qwen4_exp", "text_config": text, "tie_word_embeddings": False}


@pytest.mark.parametrize("name,changes,prompt,chunk,backend", SHAPES,
                         ids=[s[0] for s in SHAPES])
def test_cached_decode_and_generation_equal_full_forward(tmp_path, name, changes, prompt, chunk,
                                                         backend):
    cfg = write_random_qwen4_exp(_config(changes, "composite" in name), str(tmp_path),
                                 dtype="float32", seed=len(name))
    assert len(prompt) % cfg.indexer_compress_ratio  # the prefill leaves an open group
    # LLM's defaults (MTP, k = 3; its random head rarely drafts right) with pages of 4 tokens:
    # compress ratio 3 blocks straddle pages, prefix-cache snapshots every 16 tokens
    llm = LLM(str(tmp_path), dtype="float32", ple_backend=backend, page_size=4)
    toks = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=GEN,
                                                 ignore_eos=True))[0].token_ids
    m = llm.model
    seq = list(prompt) + list(toks)
    full = np.asarray(m.forward(np.asarray([seq]))[0])[0]  # [S, V], no cache
    assert toks == full[len(prompt) - 1:-1].argmax(-1).tolist(), name

    cache = m.new_cache(1, len(seq) + 1)
    got = {len(prompt) - 1: np.asarray(m.extend(cache, np.asarray([prompt])))[0, -1]}
    n = len(prompt)
    if chunk:
        out = np.asarray(m.extend(cache, np.asarray([seq[n:n + chunk]])))[0]
        got.update({n + i: out[i] for i in range(chunk)})
        n += chunk
    for i in range(n, len(seq) - 1):
        got[i] = np.asarray(m.extend(cache, np.asarray([[seq[i]]])))[0, 0]
    assert sorted(got) == list(range(len(prompt) - 1, len(seq) - 1))
    for i, row in got.items():
        np.testing.assert_allclose(row, full[i], atol=5e-5, rtol=5e-5,
                                   err_msg=f"{name}: position {i}")


def test_hc_count_one_is_refused_at_config_time():
    with pytest.raises(ConfigError, match="hc_count 1"):
        Qwen4ExpConfig.from_dict(dict(BASE, hc_count=1, layer_types=[L, Q], num_hidden_layers=2,
                                      indexer_compress_ratio=2, indexer_budget=4))
