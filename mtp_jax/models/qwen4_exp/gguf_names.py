"""qwen4exp GGUF tensor names -> canonical (HF) names, and the conversions between them.

A :class:`Recipe` gives, for one canonical tensor (:mod:`mtp_jax.models.qwen4_exp.names`), the
GGUF tensors it is made of and how (../shared/FORMATS.md, "GGUF: qwen4exp target"):

* ``norm``: every RMSNorm weight except the GDN output norm is stored as ``1 + w``
  (llama.cpp's converters bake the zero-centred norm's +1 in); the reader subtracts 1. The GDN
  ``ssm_norm`` is stored as is.
* GDN value heads are tiled in GGUF (head ``j * nk + k``) but grouped by key head in HF
  (``k * r + j``, r = value heads per key head): the reader views the head axis as ``[r, nk,
  ...]`` and swaps it back to ``[nk, r, ...]`` on the value rows of ``attn_qkv``, the rows of
  ``attn_gate`` / ``ssm_alpha`` / ``ssm_beta`` / ``ssm_a`` / ``ssm_dt.bias``, the value
  channels of ``ssm_conv1d`` and the columns of ``ssm_out``.
* ``ssm_a`` holds ``-exp(A_log)``: ``A_log = log(-ssm_a)``; convolutions are stored ``[C, K]``
  (HF ``[C, 1, K]``); the indexer's ``q_proj`` / ``k_proj`` are the rows of ``index_qk_proj``;
  routed experts are ``ffn_{gate,up}_exps [E, I, H]`` (or fused ``ffn_gate_up_exps``) and
  ``ffn_down_exps [E, H, I]``.

Shapes are numpy order (GGUF dims reversed). :func:`result_shape` gives a recipe's output
shape from the stored shapes, so every shape is checked before any tensor data is read.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig

# canonical per-layer suffix -> (GGUF per-layer suffix, kind)
_LAYER = {
    "self_attn.q_proj.weight": ("attn_q.weight", "plain"),
    "self_attn.k_proj.weight": ("attn_k.weight", "plain"),
    "self_attn.v_proj.weight": ("attn_v.weight", "plain"),
    "self_attn.o_proj.weight": ("attn_output.weight", "plain"),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "norm"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "norm"),
    "self_attn.indexer.q_layernorm.weight": ("indexer.q_norm.weight", "norm"),
    "self_attn.indexer.k_layernorm.weight": ("indexer.k_norm.weight", "norm"),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", "qkv"),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", "heads"),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", "heads"),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", "heads"),
    "linear_attn.A_log": ("ssm_a", "a_log"),
    "linear_attn.dt_bias": ("ssm_dt.bias", "heads"),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "qkv_conv"),
    "linear_attn.norm.weight": ("ssm_norm.weight", "plain"),
    "linear_attn.out_proj.weight": ("ssm_out.weight", "out_cols"),
    "mlp.gate.weight": ("ffn_gate_inp.weight", "plain"),
    "mlp.experts.down_proj": ("ffn_down_exps.weight", "plain"),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", "plain"),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", "plain"),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", "plain"),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", "row"),
    "ple.key_proj.weight": ("ple_key.weight", "plain"),
    "ple.value_proj.weight": ("ple_value.weight", "plain"),
    "ple.norm_key.weight": ("ple_norm_key.weight", "norm"),
    "ple.norm_query.weight": ("ple_norm_query.weight", "norm"),
    "ple.norm_conv.weight": ("ple_norm_conv.weight", "norm"),
    "ple.conv1d.weight": ("ple_conv1d.weight", "conv"),
}
for _hf, _gg in (("attn_hyper_connection.", "hc_attn_"), ("mlp_hyper_connection.", "hc_ffn_")):
    _LAYER.update({f"{_hf}hc_norm.weight": (f"{_gg}norm.weight", "norm"),
                   f"{_hf}input_mix_weight_down.weight": (f"{_gg}down.weight", "plain"),
                   f"{_hf}input_mix_weight_up.weight": (f"{_gg}up.weight", "plain"),
                   f"{_hf}block_inject_weight.weight": (f"{_gg}inject.weight", "plain")})
_TOP = {
    "embed_tokens.weight": ("token_embd.weight", "plain"),
    "lm_head.weight": ("output.weight", "plain"),
    "hyper_connection_mixer.hc_norm.weight": ("output_hc_norm.weight", "norm"),
    "hyper_connection_mixer.input_mix_weight_down.weight": ("output_hc_down.weight", "plain"),
    "hyper_connection_mixer.input_mix_weight_up.weight": ("output_hc_up.weight", "plain"),
}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
_GGUF_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One canonical tensor from GGUF ``sources`` by ``kind`` (see the module docstring)."""

    canonical: str
    sources: tuple[str, ...]
    kind: str


def target_recipe(canonical: str, stored: set[str]) -> Recipe:
    """The recipe of a target tensor (``stored``: the GGUF's tensor names, to pick the fused
    or split expert layout). ``KeyError`` for a canonical name GGUF targets do not hold."""
    if canonical in _TOP:
        src, kind = _TOP[canonical]
        return Recipe(canonical, (src,), kind)
    m = _LAYER_NAME.match(canonical)
    if m is None:
        raise KeyError(canonical)
    blk, rest = f"blk.{m[1]}.", m[2]
    if rest == "self_attn.indexer.index_qk_proj.weight":
        return Recipe(canonical, (blk + "indexer.q_proj.weight", blk + "indexer.k_proj.weight"),
                      "concat0")
    if rest == "mlp.experts.gate_up_proj":
        if blk + "ffn_gate_up_exps.weight" in stored:
            return Recipe(canonical, (blk + "ffn_gate_up_exps.weight",), "plain")
        return Recipe(canonical, (blk + "ffn_gate_exps.weight", blk + "ffn_up_exps.weight"),
                      "concat1")
    src, kind = _LAYER[rest]
    return Recipe(canonical, (blk + src,), kind)


def is_nextn(name: str, n_layers: int) -> bool:
    """A tensor of llama.cpp's trailing ``nextn`` (MTP) blocks: never read."""
    m = _GGUF_LAYER.match(name)
    return ".nextn." in name or (m is not None and int(m[1]) >= n_layers)


def result_shape(cfg: Qwen4ExpConfig, kind: str, shapes: list[tuple[int, ...]]) -> tuple:
    """The canonical shape a recipe of ``kind`` makes from its sources' stored shapes."""
    if kind == "concat0":
        return (sum(s[0] for s in shapes), *shapes[0][1:])
    if kind == "concat1":
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])
    if kind in ("conv", "qkv_conv"):
        return (shapes[0][0], 1, *shapes[0][1:])
    if kind == "row":
        return (1, shapes[0][-1]) if len(shapes[0]) == 1 else shapes[0]
    return shapes[0]


def _untile(x: np.ndarray, cfg: Qwen4ExpConfig, axis: int) -> np.ndarray:
    """GGUF tiled value heads -> HF grouped, along ``axis`` (length nv * d)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nk == nv:
        return x
    x = np.moveaxis(x, axis, 0)
    d = x.shape[0] // nv
    y = x.reshape(nv // nk, nk, d, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)
    return np.moveaxis(y, 0, axis)


def _untile_qkv(x: np.ndarray, cfg: Qwen4ExpConfig) -> np.ndarray:
    qk = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return np.concatenate([x[:qk], _untile(x[qk:], cfg, 0)], axis=0)


def convert(cfg: Qwen4ExpConfig, kind: str, parts: list[np.ndarray],
            raw_norms: bool = False) -> np.ndarray:
    """Apply a recipe of ``kind`` to its sources' float32 values. ``raw_norms``: the norms are
    stored without the +1 (a Strata pack)."""
    x = parts[0]
    if kind == "norm":
        return x if raw_norms else x - np.float32(1.0)
    if kind == "concat0":
        return np.concatenate(parts, axis=0)
    if kind == "concat1":
        return np.concatenate(parts, axis=1)
    if kind == "conv":
        return x[:, None, :]
    if kind == "qkv_conv":
        return _untile_qkv(x, cfg)[:, None, :]
    if kind == "qkv":
        return _untile_qkv(x, cfg)
    if kind == "heads":
        return _untile(x, cfg, 0)
    if kind == "a_log":
        return np.log(-_untile(x, cfg, 0).astype(np.float64)).astype(np.float32)
    if kind == "out_cols":
        return _untile(x, cfg, 1)
    if kind == "row":
        return x.reshape(1, -1) if x.ndim == 1 else x
    assert kind == "plain", kind
    return x
