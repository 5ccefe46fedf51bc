"""What a qwen4exp GGUF target and a Strata MTP pack hold, written from the format text
(../shared/FORMATS.md, "GGUF: qwen4exp target" and "GGUF: Strata MTP pack"; docs/gguf.md).

This is the writer's side, kept apart from the reader's name map
(:mod:`mtp_jax.models.qwen4_exp.gguf_names`) so that loading what it writes checks the reader
against the format. :func:`target_plan` / :func:`pack_plan` list :class:`Planned` tensors: the
GGUF name, its numpy-order shape, its role (which stored type it takes) and how it is made
from canonical (HF) tensors, the conventions llama.cpp's converter applies:

* every RMSNorm weight is stored ``1 + w``, except the GDN output norm ``ssm_norm`` (as is);
* GDN value heads are tiled: HF groups them by key head (head ``k * r + j``), GGUF tiles them
  (``j * nk + k``): the head axis ``[nk, r, d]`` becomes ``[r, nk, d]`` on the value rows of
  ``attn_qkv``, the rows of ``attn_gate`` / ``ssm_alpha`` / ``ssm_beta`` / ``ssm_dt.bias``,
  ``ssm_a``, the value channels of ``ssm_conv1d`` and the columns of ``ssm_out``;
* ``ssm_a`` holds ``-exp(A_log)``; convolutions are ``[C, K]`` (HF ``[C, 1, K]``);
* the indexer's ``index_qk_proj`` is split into ``indexer.q_proj`` (the first
  ``n_idx * d_idx`` rows) and ``indexer.k_proj``; routed experts ``gate_up_proj [E, 2I, H]``
  into ``ffn_gate_exps`` / ``ffn_up_exps [E, I, H]``; ``shared_expert_gate [1, H]`` is 1-D.

The pack keeps the ``mtp.*`` tensors under their HF names, norms raw, experts stacked and fused.
Roles: ``expert`` (routed experts), ``dense`` (2-D matrices), ``f32`` (1-D tensors, norms,
convolutions, routers: llama.cpp does not quantize them), ``table`` (the n-gram table),
``pack_dense`` (the pack's 2-D tensors, BF16 in Strata's packs).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig

# canonical per-layer suffix -> (GGUF suffix, kind, role)
_LAYER = {
    "self_attn.q_proj.weight": ("attn_q.weight", "plain", "dense"),
    "self_attn.k_proj.weight": ("attn_k.weight", "plain", "dense"),
    "self_attn.v_proj.weight": ("attn_v.weight", "plain", "dense"),
    "self_attn.o_proj.weight": ("attn_output.weight", "plain", "dense"),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "norm", "f32"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "norm", "f32"),
    "self_attn.indexer.q_layernorm.weight": ("indexer.q_norm.weight", "norm", "f32"),
    "self_attn.indexer.k_layernorm.weight": ("indexer.k_norm.weight", "norm", "f32"),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", "tile_qkv", "dense"),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", "tile_rows", "dense"),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", "tile_rows", "dense"),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", "tile_rows", "dense"),
    "linear_attn.A_log": ("ssm_a", "neg_exp", "f32"),
    "linear_attn.dt_bias": ("ssm_dt.bias", "tile_rows", "f32"),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "conv_qkv", "f32"),
    "linear_attn.norm.weight": ("ssm_norm.weight", "plain", "f32"),
    "linear_attn.out_proj.weight": ("ssm_out.weight", "tile_cols", "dense"),
    "mlp.gate.weight": ("ffn_gate_inp.weight", "plain", "f32"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight", "plain", "expert"),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", "plain", "dense"),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", "plain", "dense"),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", "plain", "dense"),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", "row0", "f32"),
    "ple.key_proj.weight": ("ple_key.weight", "plain", "dense"),
    "ple.value_proj.weight": ("ple_value.weight", "plain", "dense"),
    "ple.norm_key.weight": ("ple_norm_key.weight", "norm", "f32"),
    "ple.norm_query.weight": ("ple_norm_query.weight", "norm", "f32"),
    "ple.norm_conv.weight": ("ple_norm_conv.weight", "norm", "f32"),
    "ple.conv1d.weight": ("ple_conv1d.weight", "conv", "f32"),
}
for _hf, _gg in (("attn_hyper_connection.", "hc_attn_"), ("mlp_hyper_connection.", "hc_ffn_")):
    _LAYER[_hf + "hc_norm.weight"] = (_gg + "norm.weight", "norm", "f32")
    _LAYER[_hf + "input_mix_weight_down.weight"] = (_gg + "down.weight", "plain", "dense")
    _LAYER[_hf + "input_mix_weight_up.weight"] = (_gg + "up.weight", "plain", "dense")
    _LAYER[_hf + "block_inject_weight.weight"] = (_gg + "inject.weight", "plain", "dense")
# one canonical tensor -> two GGUF tensors: (GGUF suffix, kind) each
_SPLIT = {
    "self_attn.indexer.index_qk_proj.weight": (("indexer.q_proj.weight", "idx_q"),
                                               ("indexer.k_proj.weight", "idx_k"), "dense"),
    "mlp.experts.gate_up_proj": (("ffn_gate_exps.weight", "gate"),
                                 ("ffn_up_exps.weight", "up"), "expert"),
}
_TOP = {
    "embed_tokens.weight": ("token_embd.weight", "plain", "dense"),
    "lm_head.weight": ("output.weight", "plain", "dense"),
    "hyper_connection_mixer.hc_norm.weight": ("output_hc_norm.weight", "norm", "f32"),
    "hyper_connection_mixer.input_mix_weight_down.weight": ("output_hc_down.weight", "plain",
                                                            "dense"),
    "hyper_connection_mixer.input_mix_weight_up.weight": ("output_hc_up.weight", "plain",
                                                          "dense"),
}
PLE_TABLE = "per_layer_token_embd.weight"
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_PACK_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclasses.dataclass(frozen=True)
class Planned:
    """One GGUF tensor: ``name``, numpy-order ``shape``, ``role`` (module docstring), made by
    ``kind`` (:func:`convert`) from the canonical tensor ``source`` (its shape
    ``source_shape``)."""

    name: str
    shape: tuple[int, ...]
    role: str
    kind: str
    source: str
    source_shape: tuple[int, ...]


def _shape(cfg: Qwen4ExpConfig, kind: str, s: tuple[int, ...]) -> tuple[int, ...]:
    if kind in ("conv", "conv_qkv"):
        return (s[0], s[2])
    if kind == "row0":
        return (s[1],)
    if kind in ("idx_q", "idx_k"):
        n = cfg.indexer_n_heads * cfg.indexer_head_dim
        return (n if kind == "idx_q" else s[0] - n, s[1])
    if kind in ("gate", "up"):
        return (s[0], s[1] // 2, s[2])
    return tuple(s)


def _entries(cfg, canonical: str, shape, gguf_prefix: str, rest: str, table: dict) -> list:
    if rest in _SPLIT:
        *parts, role = _SPLIT[rest]
        return [Planned(gguf_prefix + g, _shape(cfg, k, shape), role, k, canonical, shape)
                for g, k in parts]
    if rest not in table:
        raise ValueError(f"the GGUF writer has no rule for {canonical!r}; the qwen4exp layout "
                         "(mtp_jax/tools/gguf_layout.py) needs one.")
    g, kind, role = table[rest]
    return [Planned(gguf_prefix + g, _shape(cfg, kind, shape), role, kind, canonical, shape)]


def target_plan(cfg: Qwen4ExpConfig) -> list[Planned]:
    """The target GGUF's tensors, in the order written (model order, then the n-gram table)."""
    out = []
    for c, shape in names.target_tensors(cfg).items():
        m = _LAYER_NAME.match(c)
        if m:
            out += _entries(cfg, c, shape, f"blk.{m[1]}.", m[2], _LAYER)
        else:
            out += _entries(cfg, c, shape, "", c, _TOP)
    if len(cfg.ple_layers) > 1:
        raise ValueError(f"a qwen4exp GGUF holds one n-gram table ({PLE_TABLE}); this config "
                         f"has {len(cfg.ple_layers)} PLE layers.")
    for layer in cfg.ple_layers:
        table = names.ple_table_name(layer)
        shape = names.ple_tensors(cfg)[table]
        out.append(Planned(PLE_TABLE, shape, "table", "plain", table, shape))
    return out


def pack_plan(cfg: Qwen4ExpConfig) -> list[Planned]:
    """The Strata pack's tensors: ``mtp.*`` under their HF names, as stored."""
    out = []
    for c, shape in names.mtp_tensors(cfg).items():
        role = ("expert" if c.endswith(_PACK_EXPERTS) else "f32" if len(shape) == 1
                else "pack_dense")
        out.append(Planned(c, tuple(shape), role, "plain", c, tuple(shape)))
    return out


def _tile(x: np.ndarray, cfg: Qwen4ExpConfig, axis: int) -> np.ndarray:
    """HF value heads grouped by key head -> GGUF tiled, along ``axis`` (nv heads of d)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    x = np.moveaxis(x, axis, 0)
    y = x.reshape(nk, nv // nk, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


def _tile_qkv(x: np.ndarray, cfg: Qwen4ExpConfig) -> np.ndarray:
    qk = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return np.concatenate([x[:qk], _tile(x[qk:], cfg, 0)], axis=0)


def convert(cfg: Qwen4ExpConfig, kind: str, x: np.ndarray) -> np.ndarray:
    """Canonical float32 values -> the stored values of a ``kind`` (module docstring)."""
    if kind == "norm":
        return x + np.float32(1.0)
    if kind == "tile_qkv":
        return _tile_qkv(x, cfg)
    if kind == "tile_rows":
        return _tile(x, cfg, 0)
    if kind == "tile_cols":
        return _tile(x, cfg, 1)
    if kind == "neg_exp":
        return _tile(-np.exp(x.astype(np.float64)), cfg, 0).astype(np.float32)
    if kind == "conv":
        return x[:, 0, :]
    if kind == "conv_qkv":
        return _tile_qkv(x[:, 0, :], cfg)
    if kind == "row0":
        return x[0]
    if kind in ("idx_q", "idx_k"):
        n = cfg.indexer_n_heads * cfg.indexer_head_dim
        return x[:n] if kind == "idx_q" else x[n:]
    if kind in ("gate", "up"):
        i = x.shape[1] // 2
        return x[:, :i] if kind == "gate" else x[:, i:]
    assert kind == "plain", kind
    return x
