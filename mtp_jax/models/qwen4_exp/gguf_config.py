"""``Qwen4ExpConfig`` from a llama.cpp ``qwen4exp`` GGUF's metadata (and tensor shapes).

Keys (prefix ``qwen4exp.``; ../shared/FORMATS.md): ``block_count`` (minus
``nextn_predict_layers``: llama.cpp counts the trailing ``nextn`` blocks, which are never read),
``embedding_length``, ``context_length``, ``attention.{head_count, head_count_kv, key_length,
value_length, layer_norm_rms_epsilon}``, ``rope.{freq_base, dimension_count,
dimension_sections}``, ``expert_{count, used_count, feed_forward_length,
shared_feed_forward_length, weights_norm, gating_func}``, ``ssm.{conv_kernel, state_size,
group_count, time_step_rank, inner_size}`` (dv = ``inner_size / time_step_rank``), the layer
layout (``attention.recurrent_layers`` or ``full_attention_interval``),
``hyper_connection.{count, low_rank}``, ``attention.indexer.{head_count, key_length, top_k}``
(top_k = the token budget), ``attention.compress_ratios`` (per layer: 0 on GDN layers, the one
QSA ratio elsewhere), ``ple.{layers (0-based), ngram_size, heads_per_ngram, conv_kernel,
eos_token_id, image_token_id, layer_multipliers, head_offsets, head_vocab_sizes}`` and
``embedding_length_per_layer_input`` (the width of one n-gram table row). Any other
``qwen4exp.*`` key is refused: it may change the maths.

From the tensors: ``vocab_size`` (``token_embd``), ``tie_word_embeddings`` (no ``output``), the
n-gram table's rows. Not in a GGUF and fixed here: the GDN output gate (``sigmoid``, the
family's), ``mtp_num_hidden_layers`` 0 (a Strata pack sets it,
:mod:`mtp_jax.models.qwen4_exp.gguf_loader`). The hash constants are taken from the metadata
as stored (the loader uses them, not ``seed``).
"""

from __future__ import annotations

import numpy as np

from mtp_jax.config import ConfigError
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.weights.gguf_reader import GGUFFile

ARCH = "qwen4exp"
PLE_TABLE = "per_layer_token_embd.weight"
_P = ARCH + "."
_KNOWN = {
    "block_count", "nextn_predict_layers", "context_length", "embedding_length", "vocab_size",
    "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.dimension_count", "rope.dimension_sections", "expert_count",
    "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "expert_weights_norm", "expert_gating_func", "ssm.conv_kernel", "ssm.state_size",
    "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size", "attention.recurrent_layers",
    "full_attention_interval", "hyper_connection.count", "hyper_connection.low_rank",
    "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k",
    "attention.compress_ratios", "ple.layers", "ple.ngram_size", "ple.heads_per_ngram",
    "ple.conv_kernel", "ple.eos_token_id", "ple.image_token_id", "ple.layer_multipliers",
    "ple.head_offsets", "ple.head_vocab_sizes", "embedding_length_per_layer_input",
}


def _f32(value) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07)."""
    return float(str(np.float32(value)))


def _get(meta: dict, key: str, default=ConfigError):
    v = meta.get(_P + key, default)
    if v is ConfigError:
        raise ConfigError(f"the GGUF has no {_P + key}; a qwen4exp GGUF needs it (re-convert "
                          "the checkpoint with a llama.cpp that knows qwen4exp).")
    return v


def _per_layer(meta: dict, key: str, n: int, block_count: int) -> list | None:
    v = meta.get(_P + key)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) not in (n, block_count):
        raise ConfigError(f"{_P + key} has {len(v) if isinstance(v, list) else v!r} entries; "
                          f"expected one per layer ({n}, or {block_count} with nextn blocks).")
    return v[:n]


def _layer_types(meta: dict, n: int, block_count: int) -> list[str]:
    rec = _per_layer(meta, "attention.recurrent_layers", n, block_count)
    if rec is not None:
        return ["linear_attention" if r else "full_attention" for r in rec]
    interval = int(_get(meta, "full_attention_interval"))
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(n)]


def _compress_ratio(meta: dict, types: list[str], block_count: int) -> int:
    ratios = _per_layer(meta, "attention.compress_ratios", len(types), block_count)
    if ratios is None:
        raise ConfigError(f"the GGUF has no {_P}attention.compress_ratios; QSA layers need it.")
    bad = [i for i, (r, t) in enumerate(zip(ratios, types)) if (r != 0) != (t == "full_attention")]
    found = sorted({int(r) for r in ratios if r})
    if bad or len(found) > 1:
        raise ConfigError(f"{_P}attention.compress_ratios {ratios} must be 0 exactly on the GDN "
                          f"layers and one ratio on every QSA layer (layer types {types}); "
                          "the file is inconsistent.")
    return found[0] if found else 0


def _divisible_by(rows: int, total: int) -> int:
    """A padding multiple that rounds ``total`` table rows up to the stored ``rows``."""
    for k in range(30, -1, -1):
        d = 1 << k
        if -(-total // d) * d == rows:
            return d
    raise ConfigError(f"the n-gram table {PLE_TABLE} has {rows} rows but the heads' vocabulary "
                      f"sizes add up to {total}; the file is inconsistent.")


def _ple_fields(g: GGUFFile, n_ple: int) -> dict:
    meta = g.metadata
    if n_ple == 0:
        return {}
    if n_ple != 1:
        raise ConfigError(f"{_P}ple.layers lists {n_ple} PLE layers; a GGUF holds one n-gram "
                          f"table ({PLE_TABLE}), so mtp_jax reads exactly one PLE layer from it.")
    ngram, per = int(_get(meta, "ple.ngram_size")), int(_get(meta, "ple.heads_per_ngram"))
    sizes = [int(s) for s in _get(meta, "ple.head_vocab_sizes")]
    row = int(_get(meta, "embedding_length_per_layer_input"))
    t = g.tensors.get(PLE_TABLE)
    if t is None:
        raise ConfigError(f"the GGUF lists PLE layers but has no {PLE_TABLE} tensor.")
    if len(t.shape) != 2 or t.shape[1] != row:
        raise ConfigError(f"{PLE_TABLE} has shape {list(t.shape)} but "
                          f"{_P}embedding_length_per_layer_input is {row} (the row width).")
    return dict(ngram_size=ngram, heads_per_ngram=per, ple_embed_dim=row * (ngram - 1) * per,
                ple_conv_kernel_size=int(_get(meta, "ple.conv_kernel")),
                ngram_vocab_size_base=sizes[0] if sizes else 1,
                make_ngram_vocab_size_divisible_by=_divisible_by(t.shape[0], sum(sizes)),
                split_ngram_parts=1)


def check_known_keys(meta: dict) -> None:
    """Every ``qwen4exp.*`` key is one this reader understands (ConfigError otherwise)."""
    unknown = sorted(k for k in meta if k.startswith(_P) and k[len(_P):] not in _KNOWN)
    if unknown:
        raise ConfigError(f"the GGUF holds qwen4exp metadata mtp_jax does not know: {unknown}; "
                          "it may change the model's maths, so the file is refused. Report it "
                          "(the reader is mtp_jax/models/qwen4_exp/gguf_config.py).")
    if meta.get(_P + "expert_gating_func", 1) != 1:
        raise ConfigError(f"{_P}expert_gating_func is {meta[_P + 'expert_gating_func']}; "
                          "qwen4exp routes with softmax (1).")


def config_from_gguf(g: GGUFFile) -> Qwen4ExpConfig:
    """The target's config from a ``qwen4exp`` GGUF's metadata and tensor shapes (header
    only); :class:`ConfigError` naming the key for anything missing, unknown or inconsistent."""
    meta = g.metadata
    check_known_keys(meta)
    block_count = int(_get(meta, "block_count"))
    n = block_count - int(meta.get(_P + "nextn_predict_layers", 0))
    types = _layer_types(meta, n, block_count)
    head_dim = int(_get(meta, "attention.key_length"))
    if int(meta.get(_P + "attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{_P}attention.value_length differs from key_length ({head_dim}); "
                          "qwen4exp attention has one head width.")
    rot = int(meta.get(_P + "rope.dimension_count", head_dim))
    sections = meta.get(_P + "rope.dimension_sections")
    if sections is not None and 2 * sum(int(s) for s in sections) != rot:
        raise ConfigError(f"{_P}rope.dimension_sections {sections} do not add up to half of "
                          f"rope.dimension_count {rot}.")
    vh, inner = int(_get(meta, "ssm.time_step_rank")), int(_get(meta, "ssm.inner_size"))
    if inner % vh:
        raise ConfigError(f"{_P}ssm.inner_size {inner} is not a multiple of "
                          f"ssm.time_step_rank {vh} (value heads).")
    ple_layers = [int(i) for i in meta.get(_P + "ple.layers", [])]
    emb = g.tensors.get("token_embd.weight")
    if emb is None or len(emb.shape) != 2:
        raise ConfigError("the GGUF has no 2-D token_embd.weight; it is not a qwen4exp model.")
    ple_eos = meta.get(_P + "ple.eos_token_id")
    eos = [e for e in (ple_eos, meta.get("tokenizer.ggml.eos_token_id")) if e is not None]
    text = dict(
        model_type="qwen4_exp_text", vocab_size=emb.shape[0],
        hidden_size=int(_get(meta, "embedding_length")), num_hidden_layers=n, layer_types=types,
        num_attention_heads=int(_get(meta, "attention.head_count")),
        num_key_value_heads=int(_get(meta, "attention.head_count_kv")), head_dim=head_dim,
        partial_rotary_factor=rot / head_dim, rope_theta=_f32(_get(meta, "rope.freq_base")),
        rms_norm_eps=_f32(_get(meta, "attention.layer_norm_rms_epsilon")),
        linear_num_key_heads=int(_get(meta, "ssm.group_count")), linear_num_value_heads=vh,
        linear_key_head_dim=int(_get(meta, "ssm.state_size")), linear_value_head_dim=inner // vh,
        linear_conv_kernel_dim=int(_get(meta, "ssm.conv_kernel")), output_gate_type="sigmoid",
        num_experts=int(_get(meta, "expert_count")),
        num_experts_per_tok=int(_get(meta, "expert_used_count")),
        moe_intermediate_size=int(_get(meta, "expert_feed_forward_length")),
        shared_expert_intermediate_size=int(_get(meta, "expert_shared_feed_forward_length")),
        norm_topk_prob=bool(meta.get(_P + "expert_weights_norm", True)),
        tie_word_embeddings="output.weight" not in g.tensors, mtp_num_hidden_layers=0,
        max_position_embeddings=int(meta.get(_P + "context_length", 262144)),
        eos_token_id=list(dict.fromkeys(int(e) for e in eos)) or None,
        hc_count=int(_get(meta, "hyper_connection.count")),
        hc_lowrank=int(_get(meta, "hyper_connection.low_rank")),
        indexer_n_heads=int(_get(meta, "attention.indexer.head_count")), indexer_kv_heads=1,
        indexer_head_dim=int(_get(meta, "attention.indexer.key_length")),
        indexer_budget=int(_get(meta, "attention.indexer.top_k")),
        indexer_compress_ratio=_compress_ratio(meta, types, block_count),
        ple_layer_ids=[i + 1 for i in ple_layers], **_ple_fields(g, len(ple_layers)))
    return Qwen4ExpConfig.from_dict(text)
