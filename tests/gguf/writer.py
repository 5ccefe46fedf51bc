"""A test-only qwen4exp GGUF target and Strata MTP pack writer, written from the format text
(../shared/FORMATS.md) with ``gguf.GGUFWriter``, independent of mtp_jax's reader and of its
random-checkpoint tool: it reads a safetensors qwen4_exp checkpoint and applies the GGUF
conventions itself (norms stored ``1 + w`` except the GDN ``ssm_norm``; GDN value heads tiled;
``ssm_a = -exp(A_log)``; convolutions ``[C, K]``; the indexer and expert tensors split; the
n-gram shards concatenated; hash buffers as UINT64 metadata). Everything is F32, so the GGUF
holds the checkpoint's values (up to the +1 / -exp round trips).

``norm_offset`` / ``tile`` exist to break the writer on purpose (the teeth checks).
"""

import json
import os
import re

import gguf
import numpy as np
from safetensors.numpy import load_file

U64 = gguf.GGUFValueType.UINT64
_HC = {"attn_hyper_connection.": "hc_attn_", "mlp_hyper_connection.": "hc_ffn_"}


def _text_config(folder):
    raw = json.load(open(os.path.join(folder, "config.json")))
    return raw.get("text_config", raw)


_PER_EXPERT = re.compile(r"^(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def _canonical(folder):
    """HF names without the text prefix; per-expert tensors stacked as the fused layout
    (``experts.gate_up_proj [E, 2I, H]`` gate rows first, ``experts.down_proj [E, H, I]``)."""
    out, experts = {}, {}
    for n, v in load_file(os.path.join(folder, "model.safetensors")).items():
        for p in ("model.language_model.", "model."):
            if n.startswith(p):
                n = n[len(p):]
                break
        if m := _PER_EXPERT.match(n):
            experts.setdefault(m[1], {})[(int(m[2]), m[3])] = v
        else:
            out[n] = v
    for p, parts in experts.items():
        e = 1 + max(i for i, _ in parts)
        out[p + "gate_up_proj"] = np.stack([np.concatenate([parts[(i, "gate")], parts[(i, "up")]])
                                            for i in range(e)])
        out[p + "down_proj"] = np.stack([parts[(i, "down")] for i in range(e)])
    return out


def _tiled(x, nk, nv, axis=0):
    """HF grouped value heads -> GGUF tiled: head axis [nk, r, d] -> [r, nk, d]."""
    x = np.moveaxis(x, axis, 0)
    y = x.reshape(nk, nv // nk, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


def _metadata(w, c, t, n_layers):
    a = "qwen4exp."
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    rope = c["rope_parameters"]
    rot = int(c["head_dim"] * rope["partial_rotary_factor"])
    u32 = {"block_count": n_layers, "context_length": c["max_position_embeddings"],
           "embedding_length": c["hidden_size"], "attention.head_count": c["num_attention_heads"],
           "attention.head_count_kv": c["num_key_value_heads"],
           "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"],
           "rope.dimension_count": rot, "expert_count": c["num_experts"],
           "expert_used_count": c["num_experts_per_tok"],
           "expert_feed_forward_length": c["moe_intermediate_size"],
           "expert_shared_feed_forward_length": c["shared_expert_intermediate_size"],
           "ssm.conv_kernel": c["linear_conv_kernel_dim"],
           "ssm.state_size": c["linear_key_head_dim"], "ssm.group_count": nk,
           "ssm.time_step_rank": nv, "ssm.inner_size": nv * c["linear_value_head_dim"],
           "hyper_connection.count": c["hc_count"], "hyper_connection.low_rank": c["hc_lowrank"],
           "attention.indexer.head_count": c["indexer_n_heads"],
           "attention.indexer.key_length": c["indexer_head_dim"],
           "attention.indexer.top_k": c["indexer_budget"],
           "ple.ngram_size": c["ngram_size"], "ple.heads_per_ngram": c["heads_per_ngram"],
           "ple.conv_kernel": c["ple_conv_kernel_size"], "ple.eos_token_id": c["eos_token_id"],
           "embedding_length_per_layer_input":
               c["ple_embed_dim"] // ((c["ngram_size"] - 1) * c["heads_per_ngram"])}
    for k, v in u32.items():
        w.add_uint32(a + k, int(v))
    w.add_float32(a + "attention.layer_norm_rms_epsilon", c["rms_norm_eps"])
    w.add_float32(a + "rope.freq_base", rope["rope_theta"])
    w.add_array(a + "rope.dimension_sections", list(rope["mrope_section"]) + [0])
    w.add_array(a + "attention.recurrent_layers",
                [lt == "linear_attention" for lt in c["layer_types"]])
    w.add_array(a + "attention.compress_ratios",
                [0 if lt == "linear_attention" else c["indexer_compress_ratio"]
                 for lt in c["layer_types"]])
    w.add_array(a + "ple.layers", [i - 1 for i in c["ple_layer_ids"]])
    ple = c["ple_layer_ids"][0] - 1
    buf = f"layers.{ple}.ple.ple_embedding."
    for gkey, hkey in (("layer_multipliers", "layer_multipliers"),
                       ("head_vocab_sizes", "ngram_heads_vocab_sizes"),
                       ("head_offsets", "ngram_heads_offsets")):
        w.add_key_value(a + "ple." + gkey, [int(x) for x in t[buf + hkey]], gguf.GGUFValueType.ARRAY,
                        sub_type=U64)
    w.add_uint32("tokenizer.ggml.eos_token_id", c["eos_token_id"])


def _layer_tensors(c, t, i, norm_offset, tile):
    p, b = f"layers.{i}.", f"blk.{i}."
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    tl = (lambda x, axis=0: _tiled(x, nk, nv, axis)) if tile else (lambda x, axis=0: x)
    qk = 2 * nk * c["linear_key_head_dim"]
    out = {}
    for hf, gg in _HC.items():
        out[b + gg + "norm.weight"] = t[p + hf + "hc_norm.weight"] + norm_offset
        out[b + gg + "down.weight"] = t[p + hf + "input_mix_weight_down.weight"]
        out[b + gg + "up.weight"] = t[p + hf + "input_mix_weight_up.weight"]
        out[b + gg + "inject.weight"] = t[p + hf + "block_inject_weight.weight"]
    if c["layer_types"][i] == "linear_attention":
        la = p + "linear_attn."
        qkv = t[la + "in_proj_qkv.weight"]
        conv = t[la + "conv1d.weight"][:, 0, :]
        out[b + "attn_qkv.weight"] = np.concatenate([qkv[:qk], tl(qkv[qk:])])
        out[b + "attn_gate.weight"] = tl(t[la + "in_proj_z.weight"])
        out[b + "ssm_alpha.weight"] = tl(t[la + "in_proj_a.weight"])
        out[b + "ssm_beta.weight"] = tl(t[la + "in_proj_b.weight"])
        out[b + "ssm_a"] = tl(-np.exp(t[la + "A_log"]))
        out[b + "ssm_dt.bias"] = tl(t[la + "dt_bias"])
        out[b + "ssm_conv1d.weight"] = np.concatenate([conv[:qk], tl(conv[qk:])])
        out[b + "ssm_norm.weight"] = t[la + "norm.weight"]  # stored as is
        out[b + "ssm_out.weight"] = tl(t[la + "out_proj.weight"], 1)
    else:
        sa = p + "self_attn."
        for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                       ("o_proj", "attn_output")):
            out[b + gg + ".weight"] = t[sa + hf + ".weight"]
        out[b + "attn_q_norm.weight"] = t[sa + "q_norm.weight"] + norm_offset
        out[b + "attn_k_norm.weight"] = t[sa + "k_norm.weight"] + norm_offset
        qkp = t[sa + "indexer.index_qk_proj.weight"]
        nq = c["indexer_n_heads"] * c["indexer_head_dim"]
        out[b + "indexer.q_proj.weight"], out[b + "indexer.k_proj.weight"] = qkp[:nq], qkp[nq:]
        out[b + "indexer.q_norm.weight"] = t[sa + "indexer.q_layernorm.weight"] + norm_offset
        out[b + "indexer.k_norm.weight"] = t[sa + "indexer.k_layernorm.weight"] + norm_offset
    m, inter = p + "mlp.", c["moe_intermediate_size"]
    out[b + "ffn_gate_inp.weight"] = t[m + "gate.weight"]
    out[b + "ffn_gate_exps.weight"] = t[m + "experts.gate_up_proj"][:, :inter]
    out[b + "ffn_up_exps.weight"] = t[m + "experts.gate_up_proj"][:, inter:]
    out[b + "ffn_down_exps.weight"] = t[m + "experts.down_proj"]
    for s in ("gate", "up", "down"):
        out[b + f"ffn_{s}_shexp.weight"] = t[m + f"shared_expert.{s}_proj.weight"]
    out[b + "ffn_gate_inp_shexp.weight"] = t[m + "shared_expert_gate.weight"][0]  # 1-D [H]
    if i + 1 in c["ple_layer_ids"]:
        q = p + "ple."
        out[b + "ple_key.weight"] = t[q + "key_proj.weight"]
        out[b + "ple_value.weight"] = t[q + "value_proj.weight"]
        for s in ("key", "query", "conv"):
            out[b + f"ple_norm_{s}.weight"] = t[q + f"norm_{s}.weight"] + norm_offset
        out[b + "ple_conv1d.weight"] = t[q + "conv1d.weight"][:, 0, :]
    return out


def _write(path, arch, add_meta, tensors, raw=None):
    w = gguf.GGUFWriter(path, arch)
    add_meta(w)
    for n, v in tensors.items():
        w.add_tensor(n, np.ascontiguousarray(v, np.float32))
    for n, (data, shape, qtype) in (raw or {}).items():
        w.add_tensor(n, data, raw_shape=None if data.dtype == np.uint8 else shape,
                     raw_dtype=qtype)  # uint8: the byte shape (gguf derives the logical one)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_target(folder, path, *, norm_offset=1.0, tile=True, nextn=False, quantize=None):
    """``folder`` (safetensors qwen4_exp) -> a qwen4exp GGUF target at ``path``. ``nextn``:
    also a trailing llama.cpp-style ``blk.{n}.nextn.*`` block (which must never be read).
    ``quantize``: ``{GGUF tensor name suffix: ggml type name}``, tensors whose name ends so
    are stored in that block type (``gguf.quants.quantize``)."""
    c, t = _text_config(folder), _canonical(folder)
    n = c["num_hidden_layers"]
    tensors = {"token_embd.weight": t["embed_tokens.weight"], "output.weight": t["lm_head.weight"],
               "output_hc_norm.weight": t["hyper_connection_mixer.hc_norm.weight"] + norm_offset,
               "output_hc_down.weight": t["hyper_connection_mixer.input_mix_weight_down.weight"],
               "output_hc_up.weight": t["hyper_connection_mixer.input_mix_weight_up.weight"]}
    for i in range(n):
        tensors.update(_layer_tensors(c, t, i, norm_offset, tile))
    ple = c["ple_layer_ids"][0] - 1
    shard = re.compile(rf"^layers\.{ple}\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$")
    shards = sorted((int(m[1]), v) for k, v in t.items() if (m := shard.match(k)))
    tensors["per_layer_token_embd.weight"] = np.concatenate([v for _, v in shards])
    if nextn:
        tensors[f"blk.{n}.nextn.eh_proj.weight"] = t["mtp.fc_hidden.weight"]
        tensors[f"blk.{n}.nextn.shared_head_norm.weight"] = t["mtp.pre_fc_norm_embedding.weight"]

    def meta(w):
        _metadata(w, c, t, n + (1 if nextn else 0))
        if nextn:
            w.add_uint32("qwen4exp.nextn_predict_layers", 1)

    raw = {}
    for suffix, qname in (quantize or {}).items():
        qtype = gguf.GGMLQuantizationType[qname]
        for name in [k for k in tensors if k.endswith(suffix)]:
            value = np.ascontiguousarray(tensors.pop(name), np.float32)
            raw[name] = (gguf.quants.quantize(value, qtype), value.shape, qtype)
    _write(path, "qwen4exp", meta, tensors, raw)
    return path


def write_pack(folder, path, *, experts=None, arch="qwen4exp-mtp"):
    """The ``mtp.*`` tensors of ``folder`` as a Strata MTP pack at ``path``: HF names, norms
    raw, everything F32, unless ``experts`` = ``{canonical: (bytes, shape, ggml type)}``
    replaces stacked expert tensors by pre-quantized bytes."""
    t = {k: v for k, v in _canonical(folder).items() if k.startswith("mtp.")}
    raw = dict(experts or {})
    for k in raw:
        t.pop(k)

    def meta(w):
        w.add_string("strata.mtp.source", "tests/fixtures")
        w.add_string("strata.mtp.expert_format", "q2_0" if raw else "bf16")

    _write(path, arch, meta, t, raw)
    return path
