"""Strata MTP packs: the ``mtp.*`` draft of a Flash-Next GGUF target, as a GGUF of its own.

A pack (architecture ``qwen4exp-mtp``; ../shared/FORMATS.md, "GGUF: Strata MTP pack") keeps the
checkpoint's ``mtp.*`` tensors under their HF names: 1-D norms F32 stored raw (the model adds
the 1, as for safetensors), 2-D dense BF16, routed experts stacked and fused
(``mtp.layers.{i}.mlp.experts.gate_up_proj [E, 2I, H]``, gate rows first, ``down_proj [E, H,
I]``) in ggml block types (Q2_0, Q4_0, Q5_0, Q8_0, Q3_K) quantized along the input axis.
Metadata: ``strata.mtp.{source, source_sha256, expert_format, expert_quantizer}``
(descriptive; the tensor types are what is read).

:func:`check_pack` reads the header only: the architecture, that ``mtp.*`` tensors are there,
their names and shapes against the target's config; it returns the config with the pack's MTP
layer count. Everything it refuses is a :class:`~mtp_jax.config.ConfigError`.
"""

from __future__ import annotations

import dataclasses
import re

from mtp_jax.config import ConfigError
from mtp_jax.models.qwen4_exp import names
from mtp_jax.models.qwen4_exp.config import Qwen4ExpConfig
from mtp_jax.weights.gguf_reader import GGUFFile, GGUFTensor

PACK_ARCH = "qwen4exp-mtp"
PACK_META = ("strata.mtp.source", "strata.mtp.source_sha256", "strata.mtp.expert_format",
             "strata.mtp.expert_quantizer")
_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def pack_tensors(p: GGUFFile) -> dict[str, GGUFTensor]:
    """The pack's ``mtp.*`` tensors under canonical names (a stacked expert tensor may carry a
    ``.weight`` suffix; it is dropped)."""
    out = {}
    for name, t in p.tensors.items():
        if name.endswith(".weight") and name[:-7].endswith(_EXPERTS):
            name = name[:-7]
        if name.startswith("mtp."):
            out[name] = t
    return out


def _check_meta(p: GGUFFile, where: str) -> None:
    unknown = sorted(k for k in p.metadata if not k.startswith(("general.", "tokenizer."))
                     and k not in PACK_META)
    if unknown:
        raise ConfigError(f"the Strata MTP pack {where} holds metadata mtp_jax does not know: "
                          f"{unknown}; it may change the draft's maths, so the pack is refused. "
                          "Report it (mtp_jax/models/qwen4_exp/strata_pack.py).")


def check_pack(p: GGUFFile, cfg: Qwen4ExpConfig, where: str) -> Qwen4ExpConfig:
    """``cfg`` with the pack's MTP layer count, after checking (header only) that ``p`` is a
    Strata pack for this target: architecture, ``mtp.*`` tensors present, every expected name
    there with the target's shape, nothing else. ``where`` names the pack in messages."""
    tensors = pack_tensors(p)
    if not tensors:
        raise ConfigError(f"the GGUF {where} ({p.architecture}) holds no mtp.* tensors, so it "
                          "cannot supply the MTP draft (llama.cpp's nextn blocks are never read "
                          f"as a draft); pass a Strata MTP pack ({PACK_ARCH}) made for this "
                          "target, e.g. --speculative-draft-model-path mtp-q2_0.gguf.")
    if p.architecture != PACK_ARCH:
        raise ConfigError(f"speculative_draft_model_path {where} is a GGUF of architecture "
                          f"{p.architecture!r}, not a Strata MTP pack ({PACK_ARCH!r}); pass "
                          "the pack made for this target (e.g. mtp-q2_0.gguf).")
    _check_meta(p, where)
    layers = sorted({int(m[1]) for n in tensors if (m := _LAYER.match(n))})
    if layers != list(range(len(layers))) or not layers:
        raise ConfigError(f"the Strata MTP pack {where} has mtp.layers {layers}; expected "
                          "layers 0..n-1 (at least one).")
    if not cfg.indexer_compress_ratio:
        raise ConfigError(f"the target has no QSA (full-attention) layer, so its GGUF gives no "
                          "QSA compress ratio (qwen4exp.attention.compress_ratios is 0 on every "
                          f"layer), and the MTP layer of the Strata pack {where} is a QSA layer "
                          "that needs one. Run this target without speculation "
                          "(--speculative-algorithm none).")
    cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=len(layers))
    want = names.mtp_tensors(cfg)
    problems = [f"{n} has shape {list(tensors[n].shape)} ({tensors[n].type}), the target needs "
                f"{list(s)}" for n, s in sorted(want.items())
                if n in tensors and tuple(tensors[n].shape) != tuple(s)]
    problems += [f"{n} not expected" for n in sorted(set(tensors) - set(want))]
    missing = sorted(set(want) - set(tensors))
    if missing:
        problems.append(f"{len(missing)} tensor(s) missing: {', '.join(missing[:6])}"
                        + (" ..." if len(missing) > 6 else ""))
    if problems:
        raise ConfigError(f"the Strata MTP pack {where} does not fit this target (hidden "
                          f"{cfg.hidden_size}, {cfg.num_experts} experts, hc {cfg.hc_count}):\n- "
                          + "\n- ".join(problems[:12])
                          + "\nPass the pack made for this target's checkpoint.")
    return cfg
