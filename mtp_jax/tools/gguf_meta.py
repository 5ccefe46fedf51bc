"""Metadata of the random GGUF writer: the ``qwen4exp.*`` keys of a target, the
``strata.mtp.*`` keys of a pack, and the ``tokenizer.*`` keys of the real Qwen vocabulary.

Target keys (../shared/FORMATS.md, "GGUF: qwen4exp target"; the reader is
:mod:`mtp_jax.models.qwen4_exp.gguf_config`): the usual ``block_count``, widths, heads, RoPE
(``rope.dimension_sections`` = ``mrope_section + [0]``, left out when the sections do not add
up to half the rotary dims, as in a config cut to a smaller head: text positions are equal in
every section, so mtp_jax never reads them), experts (``expert_gating_func`` 1 =
softmax), GDN sizes (``ssm.state_size`` = dk, ``group_count`` = key heads, ``time_step_rank`` =
value heads, ``inner_size`` = dv x value heads), ``attention.recurrent_layers`` (bool per layer),
hyper-connections, the indexer (``top_k`` = the token budget), ``attention.compress_ratios``
(0 on GDN layers), PLE (``ple.layers`` 0-based, the row width
``embedding_length_per_layer_input``, the hash constants as UINT64 arrays).

Tokenizer keys as llama.cpp's converter writes a byte-level BPE vocabulary: ``model`` "gpt2",
``pre`` "qwen35", the tokens by id (added tokens as their text, CONTROL when special, else
USER_DEFINED; ids past the tokenizer up to the model's vocabulary ``[PAD{i}]``, UNUSED),
merges as ``"a b"``, the special ids, ``add_bos_token`` false and the chat template.
"""

from __future__ import annotations

import json
import os

from mtp_jax.models.qwen4_exp.config import (Qwen4ExpConfig, head_offsets, head_vocab_sizes,
                                             layer_multipliers)
from mtp_jax.rope import rope_section

ARCH, PACK_ARCH = "qwen4exp", "qwen4exp-mtp"
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _u64_array(w, key: str, values) -> None:
    from gguf import GGUFValueType
    w.add_key_value(key, [int(v) for v in values], GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.UINT64)


def _mrope_section(raw: dict) -> list[int] | None:
    text = raw.get("text_config", raw)
    section = rope_section(text, raw)[0].get("mrope_section")
    return [int(s) for s in section] if section else None


def add_target_metadata(w, cfg: Qwen4ExpConfig, raw: dict) -> None:
    """The ``qwen4exp.*`` keys of ``cfg`` (``raw``: its config.json dict, for the mrope
    section and the image token id) on GGUFWriter ``w``."""
    a = ARCH + "."
    u32 = {"block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
           "embedding_length": cfg.hidden_size,
           "attention.head_count": cfg.num_attention_heads,
           "attention.head_count_kv": cfg.num_key_value_heads,
           "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
           "rope.dimension_count": cfg.rotary_dim, "expert_count": cfg.num_experts,
           "expert_used_count": cfg.num_experts_per_tok,
           "expert_feed_forward_length": cfg.moe_intermediate_size,
           "expert_shared_feed_forward_length": cfg.shared_expert_intermediate_size,
           "expert_gating_func": 1, "ssm.conv_kernel": cfg.linear_conv_kernel_dim,
           "ssm.state_size": cfg.linear_key_head_dim, "ssm.group_count": cfg.linear_num_key_heads,
           "ssm.time_step_rank": cfg.linear_num_value_heads,
           "ssm.inner_size": cfg.linear_num_value_heads * cfg.linear_value_head_dim,
           "hyper_connection.count": cfg.hc_count, "hyper_connection.low_rank": cfg.hc_lowrank,
           "attention.indexer.head_count": cfg.indexer_n_heads,
           "attention.indexer.key_length": cfg.indexer_head_dim,
           "attention.indexer.top_k": cfg.indexer_budget}
    for k, v in u32.items():
        w.add_uint32(a + k, int(v))
    w.add_float32(a + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_float32(a + "rope.freq_base", cfg.rope_theta)
    w.add_bool(a + "expert_weights_norm", bool(cfg.norm_topk_prob))
    section = _mrope_section(raw)
    if section is not None and 2 * sum(section) == cfg.rotary_dim:
        w.add_array(a + "rope.dimension_sections", section + [0])
    w.add_array(a + "attention.recurrent_layers",
                [t == "linear_attention" for t in cfg.layer_types])
    w.add_array(a + "attention.compress_ratios",
                [0 if t == "linear_attention" else cfg.indexer_compress_ratio
                 for t in cfg.layer_types])
    if cfg.ple_layers:
        _ple_metadata(w, cfg, raw)


def _ple_metadata(w, cfg: Qwen4ExpConfig, raw: dict) -> None:
    a = ARCH + ".ple."
    w.add_array(a + "layers", list(cfg.ple_layers))
    for k, v in (("ngram_size", cfg.ngram_size), ("heads_per_ngram", cfg.heads_per_ngram),
                 ("conv_kernel", cfg.ple_conv_kernel_size), ("eos_token_id", cfg.eos_token_id)):
        w.add_uint32(a + k, int(v))
    image = raw.get("image_token_id", raw.get("text_config", {}).get("image_token_id"))
    if image is not None:
        w.add_uint32(a + "image_token_id", int(image))
    w.add_uint32(ARCH + ".embedding_length_per_layer_input", cfg.ngram_head_dim)
    sizes = head_vocab_sizes(cfg, 0)
    _u64_array(w, a + "layer_multipliers", layer_multipliers(cfg, 0))
    _u64_array(w, a + "head_vocab_sizes", sizes)
    _u64_array(w, a + "head_offsets", head_offsets(sizes))


def add_pack_metadata(w, source: str, expert_format: str) -> None:
    """The ``strata.mtp.*`` keys (descriptive: the tensor types are what a reader uses)."""
    w.add_string("strata.mtp.source", source)
    w.add_string("strata.mtp.expert_format", expert_format.lower())
    w.add_string("strata.mtp.expert_quantizer", "mtp_jax.tools.random_checkpoint (random "
                                                "blocks)")


def _read(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def tokenizer_keys(folder: str, vocab_size: int) -> list[tuple[str, object]]:
    """``(key, value)`` of the ``tokenizer.*`` metadata of the HF tokenizer files in ``folder``
    (a byte-level BPE ``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``)
    for a model of ``vocab_size`` embedding rows."""
    tj, tc, gc = (_read(folder, n) for n in ("tokenizer.json", "tokenizer_config.json",
                                             "generation_config.json"))
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{folder}/tokenizer.json is not a BPE tokenizer; the writer knows "
                         "byte-level BPE (the Qwen vocabulary) only.")
    tokens, types = [None] * vocab_size, [UNUSED] * vocab_size
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, NORMAL
    by_text = {}
    for t in tj.get("added_tokens", []):
        tokens[t["id"]], types[t["id"]] = t["content"], CONTROL if t["special"] else USER_DEFINED
        by_text[t["content"]] = t["id"]
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out = [("tokenizer.ggml.model", "gpt2"), ("tokenizer.ggml.pre", "qwen35"),
           ("tokenizer.ggml.tokens", tokens), ("tokenizer.ggml.token_type", types),
           ("tokenizer.ggml.merges", merges)]
    for key, text in (("eos_token_id", tc.get("eos_token")), ("padding_token_id",
                                                             tc.get("pad_token"))):
        if isinstance(text, str) and text in by_text:
            out.append(("tokenizer.ggml." + key, by_text[text]))
    if isinstance(gc.get("bos_token_id"), int):
        out.append(("tokenizer.ggml.bos_token_id", gc["bos_token_id"]))
    out.append(("tokenizer.ggml.add_bos_token", False))
    if isinstance(tc.get("chat_template"), str):
        out.append(("tokenizer.chat_template", tc["chat_template"]))
    return out


def add_tokenizer_metadata(w, folder: str, vocab_size: int) -> None:
    """:func:`tokenizer_keys` on GGUFWriter ``w``."""
    from gguf import GGUFValueType
    for key, value in tokenizer_keys(folder, vocab_size):
        if key.endswith("_id"):
            w.add_uint32(key, value)
        elif key == "tokenizer.ggml.token_type":
            w.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_string(key, value)
