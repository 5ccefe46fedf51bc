"""Config-time rules for GGUF targets and drafts (headers only, never tensor data).

* A Qwen3.5-family GGUF (``qwen35``, ``qwen35moe``) is refused with or without speculation:
  mtp_jax does not load its weights; with MTP the message says "MTP is not supported for
  <arch> yet" and points at the HF safetensors folder (whose ``mtp.*`` is the draft).
* A Flash-Next GGUF (``qwen4exp``) target is read (config from its metadata). With MTP it needs
  a Strata MTP pack: ``speculative_draft_model_path``, or, when that is not given and the
  target was named by its folder, the folder's own pack
  (:func:`~mtp_jax.weights.gguf_header.folder_pack`). None, a draft that is not a GGUF, a GGUF
  without ``mtp.*`` tensors, or a pack whose shapes do not fit are refused, each naming the
  fix (the packs beside the target, when there are some). llama.cpp's ``nextn`` blocks are
  never read as a draft.
* A Strata pack passed as the target, and any other GGUF architecture, are refused.
* A GGUF draft for a safetensors target: refused (a Qwen3.5-family target reads its draft from
  safetensors; a safetensors qwen4_exp target uses its own ``mtp.*``).
"""

from __future__ import annotations

import os

from mtp_jax.config import ConfigError
from mtp_jax.weights.gguf_header import (QWEN3_5_GGUF_ARCHS, folder_pack, gguf_architecture,
                                         gguf_draft_file, gguf_file, gguf_folder)
from mtp_jax.weights.safetensors_files import CheckpointError

__all__ = ["gguf_target_config", "check_gguf_draft", "GGUF_TARGET_ARCHS"]

GGUF_TARGET_ARCHS = ("qwen4exp",)


def _pack_hint(g: str) -> str:
    """How to pass a pack for target ``g``, naming the packs in its folder when there are."""
    folder = os.path.dirname(os.path.abspath(g))
    packs = gguf_folder(folder)[1]
    if packs:
        which = packs[0] if len(packs) == 1 else f"one of {', '.join(packs)}"
        return (f"--speculative-draft-model-path {which} (speculative_draft_model_path=...; "
                f"the Strata pack{'s' * (len(packs) > 1)} beside the target)")
    return ("--speculative-draft-model-path PACK.gguf (speculative_draft_model_path=...; a "
            f".gguf of architecture qwen4exp-mtp made for this target; {folder} holds none)")


def _qwen3_5(g: str, arch: str, mtp: bool) -> ConfigError:
    folder = ("Pass the model's HF safetensors checkpoint folder (config.json + *.safetensors) "
              "instead")
    if mtp:
        return ConfigError(f"MTP is not supported for {arch} yet: {g} is a Qwen3.5-family GGUF, "
                           "and mtp_jax loads no Qwen3.5-family GGUF weights yet, with or "
                           f"without speculation. {folder}; its mtp.* tensors are the draft.")
    return ConfigError(f"{g} is a GGUF checkpoint ({arch}); mtp_jax does not load "
                       f"Qwen3.5-family GGUF weights yet. {folder}.")


def _config(g: str, draft: str | None):
    from mtp_jax.models.qwen4_exp.gguf_loader import gguf_config
    try:
        return gguf_config(g, draft)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def gguf_target_config(g: str, *, mtp: bool, draft_path: str | None, model: str | None = None):
    """The config of GGUF target ``g`` (a ``qwen4exp`` one, with the Strata pack's MTP layers
    when ``mtp``). ``model``: the model path ``g`` came from; when it is a GGUF folder and
    ``draft_path`` is None, the folder's pack is the draft.

    Raises:
      ConfigError: the rules above (headers only; no tensor data is read).
    """
    arch = gguf_architecture(g)
    if arch in QWEN3_5_GGUF_ARCHS:
        raise _qwen3_5(g, arch, mtp)
    if arch == "qwen4exp-mtp":
        raise ConfigError(f"{g} is a Strata MTP pack (a draft), not a target: pass the "
                          "Flash-Next GGUF as the model and the pack as "
                          "--speculative-draft-model-path.")
    if arch not in GGUF_TARGET_ARCHS:
        raise ConfigError(f"{g} is a GGUF of architecture {arch!r}; mtp_jax reads GGUF targets "
                          f"of architecture {', '.join(GGUF_TARGET_ARCHS)} (Qwen3.8-Flash-Next) "
                          "only. Pass an HF safetensors checkpoint folder of a Qwen3.5-family "
                          "or qwen4_exp model.")
    if not mtp:
        return _config(g, None)
    if draft_path is None and model is not None:
        draft_path = folder_pack(model)  # a GGUF folder brings its own pack
    if draft_path is None:
        raise ConfigError(f"{g} is a Flash-Next GGUF target, which carries no MTP draft mtp_jax "
                          "reads (llama.cpp's nextn blocks are never read as a draft): pass a "
                          f"Strata MTP pack, {_pack_hint(g)}, or run without speculation "
                          "(--speculative-algorithm none).")
    d = gguf_draft_file(os.fspath(draft_path)) if os.path.exists(draft_path) else None
    if d is None:
        raise ConfigError(f"{g} is a GGUF target, which reads its MTP draft from a Strata MTP "
                          "pack (a .gguf of architecture qwen4exp-mtp), but "
                          f"speculative_draft_model_path {draft_path!r} is not a GGUF file on "
                          f"this machine. Pass the pack, {_pack_hint(g)}, or run without "
                          "speculation (--speculative-algorithm none).")
    return _config(g, d)


def check_gguf_draft(cfg, draft_path: str, d: str, target: str | None) -> None:
    """A GGUF draft ``d`` (given as ``draft_path``): a Strata pack that fits a GGUF ``target``
    passes; for any other target it is refused.

    Raises:
      ConfigError: a pack that does not fit, or a GGUF draft for a safetensors target.
    """
    if target is not None and gguf_file(os.fspath(target)) is not None:
        _config(gguf_file(os.fspath(target)), d)
        return
    try:
        arch = gguf_architecture(d)
    except ConfigError:
        arch = "unreadable header"
    if cfg.model_type == "qwen4_exp":
        raise ConfigError(f"speculative_draft_model_path {draft_path!r} is a GGUF ({arch}); a "
                          "Strata MTP pack drafts for a Flash-Next GGUF target only, and this "
                          "target is an HF safetensors checkpoint whose own mtp.* is its draft. "
                          "Omit the path, or pass the GGUF target as the model.")
    raise ConfigError(f"speculative_draft_model_path {draft_path!r} is a GGUF file ({arch}); a "
                      f"GGUF draft cannot supply the MTP draft of a {cfg.model_type} target, "
                      "since mtp_jax reads Qwen3.5-family drafts (mtp.* tensors) only from HF "
                      "safetensors. Pass a safetensors folder holding the mtp.* tensors, or omit "
                      "the path to use the target's own.")
