"""Canonical tensor names and shapes of qwen4_exp checkpoints.

Canonical names are the HF text-model names without the ``model.language_model.`` (composite)
or ``model.`` (text-only) prefix; ``lm_head.weight`` and ``mtp.*`` are top level. They equal the
parameter paths of :mod:`mtp_jax.models.qwen4_exp.model`, except the PLE n-gram tables and hash
buffers, which never become Flax parameters (see :func:`ple_tensors`).

Per decoder layer ``layers.{i}.``: ``attn_hyper_connection.*`` and ``mlp_hyper_connection.*``
(``hc_norm.weight [hc*H]``, ``input_mix_weight_down.weight [r, hc*H]``,
``input_mix_weight_up.weight [hc*H, r]``, ``block_inject_weight.weight [hc, hc*H]``); either
``linear_attn.*`` (GDN, as Qwen3.5) or ``self_attn.*`` (gated attention + ``indexer.index_qk_proj
[(n_idx+1)*d_idx, H]``, ``indexer.q_layernorm``/``k_layernorm [d_idx]``); ``mlp.*`` (MoE with
shared expert); on PLE layers ``ple.*``. Top level: ``embed_tokens``, ``hyper_connection_mixer.*``
(no inject), ``lm_head``.
"""

from __future__ import annotations

from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig, ngram_table_rows
from mtp_jax.weights import names as _names
from mtp_jax.weights.names import attention_tensors, linear_attention_tensors, mlp_tensors

Shape = tuple[int, ...]

PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def hyper_connection(cfg: Qwen4ExpConfig, p: str, inject: bool = True) -> dict[str, Shape]:
    w, r = cfg.hc_hidden, cfg.hc_lowrank
    out = {f"{p}hc_norm.weight": (w,), f"{p}input_mix_weight_down.weight": (r, w),
           f"{p}input_mix_weight_up.weight": (w, r)}
    if inject:
        out[f"{p}block_inject_weight.weight"] = (cfg.hc_count, w)
    return out


def qsa_attention(cfg: Qwen4ExpConfig, p: str) -> dict[str, Shape]:
    """The Qwen3.5 gated attention tensors plus the QSA indexer."""
    di = cfg.indexer_head_dim
    return {
        **attention_tensors(cfg, p),
        f"{p}self_attn.indexer.index_qk_proj.weight": ((cfg.indexer_n_heads
                                                        + cfg.indexer_kv_heads) * di,
                                                       cfg.hidden_size),
        f"{p}self_attn.indexer.q_layernorm.weight": (di,),
        f"{p}self_attn.indexer.k_layernorm.weight": (di,),
    }


linear_attention = linear_attention_tensors  # the GDN tensors are the Qwen3.5 family's


moe = mlp_tensors  # the MoE block's tensors are the Qwen3.5-MoE family's (is_moe is True)


def ple_dense(cfg: Qwen4ExpConfig, p: str) -> dict[str, Shape]:
    """Dense (device) tensors of a PLE module under ``p = "layers.{i}.ple."``."""
    w, h, d = cfg.hc_hidden, cfg.hidden_size, cfg.ple_embed_dim
    return {f"{p}key_proj.weight": (w, d), f"{p}value_proj.weight": (h, d),
            f"{p}norm_key.weight": (w,), f"{p}norm_query.weight": (w,),
            f"{p}norm_conv.weight": (w,), f"{p}conv1d.weight": (w, 1, cfg.ple_conv_kernel_size)}


def decoder_layer(cfg: Qwen4ExpConfig, p: str, layer_type: str, ple: bool) -> dict[str, Shape]:
    out = hyper_connection(cfg, f"{p}attn_hyper_connection.")
    out.update(hyper_connection(cfg, f"{p}mlp_hyper_connection."))
    out.update(qsa_attention(cfg, p) if layer_type == "full_attention"
               else linear_attention(cfg, p))
    out.update(moe(cfg, p))
    if ple:
        out.update(ple_dense(cfg, f"{p}ple."))
    return out


def target_tensors(cfg: Qwen4ExpConfig) -> dict[str, Shape]:
    """Dense target tensors (Flax parameters), no ``mtp.*``, no n-gram tables / hash buffers."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, Shape] = {"embed_tokens.weight": (v, h)}
    for i, t in enumerate(cfg.layer_types):
        out.update(decoder_layer(cfg, f"layers.{i}.", t, i in cfg.ple_layers))
    out.update(hyper_connection(cfg, "hyper_connection_mixer.", inject=False))
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    return out


def mtp_tensors(cfg: Qwen4ExpConfig) -> dict[str, Shape]:
    h = cfg.hidden_size
    out: dict[str, Shape] = {
        "mtp.fc_embedding.weight": (h, h),
        "mtp.fc_hidden.weight": (h, h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (cfg.hc_hidden,),
    }
    for i in range(cfg.mtp_num_hidden_layers):
        out.update(decoder_layer(cfg, f"mtp.layers.{i}.", "full_attention", False))
    out.update(hyper_connection(cfg, "mtp.hyper_connection_mixer.", inject=False))
    return out


def ple_table_name(layer: int, shard: int | None = None) -> str:
    """Canonical name of a PLE n-gram table (``shard=None``: the concatenated table)."""
    if shard is None:
        return f"layers.{layer}.ple.ple_embedding.ngram_embedding.weight"
    return f"layers.{layer}.ple.ple_embedding.ngram_embedding.shard_{shard}.weight"


def ple_tensors(cfg: Qwen4ExpConfig) -> dict[str, Shape]:
    """Host-side PLE tensors: the n-gram table (logical, concatenated) and the int64 hash
    buffers, per PLE layer."""
    out: dict[str, Shape] = {}
    for j, layer in enumerate(cfg.ple_layers):
        out[ple_table_name(layer)] = (ngram_table_rows(cfg, j), cfg.ngram_head_dim)
        p = f"layers.{layer}.ple.ple_embedding."
        out[p + "layer_multipliers"] = (cfg.ngram_size,)
        out[p + "ngram_heads_vocab_sizes"] = (cfg.ngram_heads,)
        out[p + "ngram_heads_offsets"] = (cfg.ngram_heads,)
    return out


def shard_rows(total: int, parts: int) -> list[int]:
    """Rows per stored shard when a table of ``total`` rows is split in ``parts`` (torch.chunk:
    ceil-sized chunks, the last one smaller, fewer chunks when rows run out)."""
    size = -(-total // parts)
    out, left = [], total
    while left > 0:
        out.append(min(size, left))
        left -= out[-1]
    return out


# The checkpoint layout (prefixes, skipped towers) is the Qwen3.5 family's.
disk_name, canonical_name = _names.disk_name, _names.canonical_name
