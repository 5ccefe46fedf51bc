"""Independent float64 numpy oracle for the Qwen3.5-family MTP head (no jax, no torch).

Written from the maths in ``shared/MODEL_FACTS.md`` ("MTP head, Qwen3.5 family", "Norms",
"Gated attention"), not from mtp_jax. The tests compare mtp_jax against values this module
produced (``tests/fixtures/*/golden.npz``); ``tests/fixtures/make_golden.py`` checks this module
itself against HF transformers 5.23 before it writes any fixture:

* ``decoder_layer_np`` (the full-attention decoder layer: zero-centred RMSNorms, gated attention
  with q/k norms, NeoX partial RoPE, GQA, dense MLP or MoE with shared expert) is run on the
  TRUNK's full-attention layer (layer 3) of every fixture, on the exact input HF fed that layer
  (captured with a forward hook, model in float64), and must match HF's layer output to 1e-10.
* ``mtp_forward_np`` is compared with the same MTP head assembled from HF's own modules in float64
  (``Qwen3_5[Moe]RMSNorm`` for the three MTP norms, ``nn.Linear`` for ``mtp.fc``, a
  ``Qwen3_5[Moe]DecoderLayer`` holding ``mtp.layers.0.*``, HF's rotary embedding, ``lm_head``).
* ``load_tensors`` on the per-expert fixture (MTP experts stored one tensor per expert) is checked
  to give the same stacked arrays as the fused layout.

MTP row ``t`` (predicts token ``t+2``)::

    e = zc_rmsnorm(embed[x_{t+1}], mtp.pre_fc_norm_embedding)      # [H]
    h = zc_rmsnorm(h_t, mtp.pre_fc_norm_hidden)                     # h_t: trunk hidden after model.norm
    u = mtp.fc @ concat([e, h])                                     # [2H] -> [H], embedding first
    y = full_attention_decoder_layer(u; rows 0..t, position t)     # mtp.layers.0.*
    z = zc_rmsnorm(y, mtp.norm)                                     # returned as the MTP hidden
    logits = lm_head @ z                                            # lm_head = embed_tokens when tied

with ``zc_rmsnorm(x, w) = x / sqrt(mean(x^2) + eps) * (1 + w)``.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# ----------------------------------------------------------------------------- checkpoint reading


def load_text_config(folder: str) -> dict:
    """Text config dict of a checkpoint folder (``text_config`` of a composite, else the flat file).

    ``rope_theta`` / ``partial_rotary_factor`` are copied to the top level from ``rope_parameters``
    when they are only there.
    """
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    text = dict(cfg.get("text_config", cfg))
    rope = text.get("rope_parameters") or {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in text and key in rope:
            text[key] = rope[key]
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def load_tensors(folder: str) -> dict[str, np.ndarray]:
    """All text + MTP tensors of a float32/float64 safetensors checkpoint, as numpy arrays.

    Names are normalised: ``model.language_model.X`` -> ``model.X``; ``model.visual.*`` is dropped.
    Per-expert tensors ``<p>.mlp.experts.{e}.{gate,up,down}_proj.weight`` are stacked into the fused
    layout ``<p>.mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
    ``<p>.mlp.experts.down_proj [E, H, I]``.
    """
    from safetensors.numpy import load_file

    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    raw: dict[str, np.ndarray] = {}
    for name in files:
        raw.update(load_file(os.path.join(folder, name)))

    out: dict[str, np.ndarray] = {}
    per_expert: dict[str, dict[str, dict[int, np.ndarray]]] = {}
    for name, arr in raw.items():
        if name.startswith("model.visual."):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        m = _PER_EXPERT.match(name)
        if m:
            per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = arr
            continue
        out[name] = arr
    for prefix, parts in per_expert.items():
        n = len(parts["gate_proj"])
        gate = np.stack([parts["gate_proj"][e] for e in range(n)])  # [E, I, H]
        up = np.stack([parts["up_proj"][e] for e in range(n)])
        down = np.stack([parts["down_proj"][e] for e in range(n)])  # [E, H, I]
        out[prefix + ".gate_up_proj"] = np.concatenate([gate, up], axis=1)
        out[prefix + ".down_proj"] = down
    return out


# ----------------------------------------------------------------------------- maths


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def zc_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """Zero-centred RMSNorm over the last axis: ``x / sqrt(mean(x^2) + eps) * (1 + w)``."""
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + _f64(w))


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _rope(x: np.ndarray, positions: np.ndarray, rotary_dim: int, theta: float) -> np.ndarray:
    """NeoX-style RoPE on the first ``rotary_dim`` dims of ``x [B, T, heads, D]``.

    Pairs are (i, i + rotary_dim/2); frequency ``theta^(-2i/rotary_dim)``; positions ``[B, T]``.
    """
    half = rotary_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # [half]
    ang = _f64(positions)[..., None] * inv_freq  # [B, T, half]
    cos = np.cos(ang)[:, :, None, :]
    sin = np.sin(ang)[:, :, None, :]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _get(tensors: dict, name: str) -> np.ndarray:
    """Look a tensor up under its flat or composite name."""
    if name in tensors:
        return _f64(tensors[name])
    if name.startswith("model."):
        alt = "model.language_model." + name[len("model."):]
        if alt in tensors:
            return _f64(tensors[alt])
    raise KeyError(name)


def _has(tensors: dict, name: str) -> bool:
    alt = "model.language_model." + name[len("model."):] if name.startswith("model.") else name
    return name in tensors or alt in tensors


def gated_attention_np(x: np.ndarray, tensors: dict, prefix: str, cfg: dict, positions) -> np.ndarray:
    """Causal gated full attention of ``x [B, T, H]`` (already input-normed), rows at ``positions``.

    ``q_proj [2*Hq*D, H]`` gives per head ``[query(D) | gate(D)]``; q/k get zero-centred per-head
    RMSNorm, then partial NeoX RoPE, GQA (query head h reads kv head ``h // (Hq/Hkv)``),
    softmax(q k^T / sqrt(D)) v, times sigmoid(gate), then ``o_proj``.
    """
    B, T, _ = x.shape
    nh, nkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    rotary_dim = int(D * cfg["partial_rotary_factor"])
    theta = float(cfg["rope_theta"])

    qg = (x @ _get(tensors, prefix + "q_proj.weight").T).reshape(B, T, nh, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(B, T, nh * D)
    k = (x @ _get(tensors, prefix + "k_proj.weight").T).reshape(B, T, nkv, D)
    v = (x @ _get(tensors, prefix + "v_proj.weight").T).reshape(B, T, nkv, D)
    q = zc_rmsnorm(q, _get(tensors, prefix + "q_norm.weight"), eps)
    k = zc_rmsnorm(k, _get(tensors, prefix + "k_norm.weight"), eps)
    pos = np.broadcast_to(np.asarray(positions), (B, T))
    q = _rope(q, pos, rotary_dim, theta)
    k = _rope(k, pos, rotary_dim, theta)

    rep = nh // nkv
    k = np.repeat(k, rep, axis=2)  # [B, T, nh, D], head h <- kv head h // rep
    v = np.repeat(v, rep, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
    causal = pos[:, None, :, None] >= pos[:, None, None, :]
    scores = np.where(causal, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(axis=-1, keepdims=True)
    attn = np.einsum("bhqk,bkhd->bqhd", p, v).reshape(B, T, nh * D)
    attn = attn * _sigmoid(gate)
    return attn @ _get(tensors, prefix + "o_proj.weight").T


def _swiglu(x, gate_w, up_w, down_w):
    return (_silu(x @ gate_w.T) * (x @ up_w.T)) @ down_w.T


def mlp_np(x: np.ndarray, tensors: dict, prefix: str, cfg: dict) -> np.ndarray:
    """Dense SwiGLU MLP, or the sparse MoE block when ``<prefix>gate.weight`` (router) exists.

    MoE: softmax over all experts of ``x @ gate^T``, top-k, the k weights renormalised to sum 1,
    ``sum_k w_k * down_e(silu(gate_e x) * up_e x)`` with the fused ``gate_up_proj [E, 2I, H]``
    (rows ``[0, I)`` gate), plus ``sigmoid(shared_expert_gate x) * shared_expert(x)``.
    """
    if not _has(tensors, prefix + "gate.weight"):
        return _swiglu(x, _get(tensors, prefix + "gate_proj.weight"),
                       _get(tensors, prefix + "up_proj.weight"), _get(tensors, prefix + "down_proj.weight"))

    B, T, H = x.shape
    xf = x.reshape(-1, H)
    k_top = cfg["num_experts_per_tok"]
    logits = xf @ _get(tensors, prefix + "gate.weight").T  # [N, E]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k_top]  # [N, k]
    w = np.take_along_axis(probs, top, axis=-1)
    w = w / w.sum(-1, keepdims=True)
    gate_up = _get(tensors, prefix + "experts.gate_up_proj")  # [E, 2I, H]
    down = _get(tensors, prefix + "experts.down_proj")  # [E, H, I]
    inter = gate_up.shape[1] // 2
    out = np.zeros_like(xf)
    for n in range(xf.shape[0]):
        for j in range(k_top):
            e = top[n, j]
            out[n] += w[n, j] * _swiglu(xf[n], gate_up[e, :inter], gate_up[e, inter:], down[e])
    shared = _swiglu(xf, _get(tensors, prefix + "shared_expert.gate_proj.weight"),
                     _get(tensors, prefix + "shared_expert.up_proj.weight"),
                     _get(tensors, prefix + "shared_expert.down_proj.weight"))
    out += _sigmoid(xf @ _get(tensors, prefix + "shared_expert_gate.weight").T) * shared
    return out.reshape(B, T, H)


def decoder_layer_np(x: np.ndarray, tensors: dict, prefix: str, cfg: dict, positions) -> np.ndarray:
    """One full-attention decoder layer, ``prefix`` e.g. ``"mtp.layers.0."`` or ``"model.layers.3."``.

    ``y = x + attn(zc_norm(x, input_layernorm)); out = y + mlp(zc_norm(y, post_attention_layernorm))``.
    """
    x = _f64(x)
    eps = cfg["rms_norm_eps"]
    h = zc_rmsnorm(x, _get(tensors, prefix + "input_layernorm.weight"), eps)
    y = x + gated_attention_np(h, tensors, prefix + "self_attn.", cfg, positions)
    h = zc_rmsnorm(y, _get(tensors, prefix + "post_attention_layernorm.weight"), eps)
    return y + mlp_np(h, tensors, prefix + "mlp.", cfg)


def lm_head_weight(tensors: dict, cfg: dict) -> np.ndarray:
    """``lm_head.weight [V, H]``, or ``embed_tokens`` when tied / when no lm_head is stored."""
    if not cfg.get("tie_word_embeddings", False) and "lm_head.weight" in tensors:
        return _f64(tensors["lm_head.weight"])
    return _get(tensors, "model.embed_tokens.weight")


def mtp_forward_np(tensors: dict, config: dict, hidden, next_ids, positions=None, layer: int = 0):
    """MTP head over rows ``t = 0..T-1`` (teacher forced), float64.

    Args:
      tensors: HF names as stored (``model.*`` or ``model.language_model.*``; fused experts, see
        ``load_tensors`` for per-expert checkpoints).
      config: the text config dict (``load_text_config``).
      hidden: ``[B, T, H]`` trunk hidden after ``model.norm`` (row t = position t), or the previous
        MTP step's ``z`` when chaining.
      next_ids: ``[B, T]`` int, the token ``x_{t+1}`` of row t.
      positions: ``[B, T]`` or ``[T]`` rope positions, default ``arange(T)``; attention is causal
        over these positions.
      layer: index of the MTP layer (``mtp.layers.{layer}``).

    Returns:
      ``(logits [B, T, V], z [B, T, H])`` float64; ``z`` is the MTP hidden after ``mtp.norm``.
    """
    hidden = _f64(hidden)
    next_ids = np.asarray(next_ids)
    B, T, _ = hidden.shape
    if positions is None:
        positions = np.arange(T)
    eps = config["rms_norm_eps"]
    embed = _get(tensors, "model.embed_tokens.weight")
    e = zc_rmsnorm(embed[next_ids], _get(tensors, "mtp.pre_fc_norm_embedding.weight"), eps)
    h = zc_rmsnorm(hidden, _get(tensors, "mtp.pre_fc_norm_hidden.weight"), eps)
    u = np.concatenate([e, h], axis=-1) @ _get(tensors, "mtp.fc.weight").T
    y = decoder_layer_np(u, tensors, f"mtp.layers.{layer}.", config, positions)
    z = zc_rmsnorm(y, _get(tensors, "mtp.norm.weight"), eps)
    return z @ lm_head_weight(tensors, config).T, z
