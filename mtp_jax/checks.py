"""Config-time checks: everything that can be refused before a weight is read.

:func:`check_before_load` is the one gate that every entry point goes through
(``python -m mtp_jax.generate`` via ``LLM``, ``LLM``, ``load_model``). It reads at most
``config.json`` files, a GGUF header and the tensor names of a separate draft folder (its index
or its safetensors headers), never tensor data, and raises :class:`ConfigError` with a message
that names the bad value, what is supported and the fix. In order:

1. the settings alone: algorithm, ``speculative_num_steps`` 1..8 (0 too with speculation
   off), a draft path with speculation off, engine sizing, MTP with dummy (random) weights, a
   proposer with the wrong algorithm;
2. the target: a GGUF file (refused; for a Qwen3.5-family GGUF with MTP: "MTP is not supported
   for <architecture> yet"), ``config.json`` (missing, unreadable, unknown ``model_type``);
3. the family: a speculative algorithm with no draft registered for it
   (``mtp_jax.models.registry``), an MTP request on a config with no MTP layer and no draft path,
   a per-request slot state without a verify handler;
4. the draft source: a missing local path (a Hugging Face repo id, ``name`` or ``org/name``,
   passes and is downloaded at load), a GGUF draft, a folder without ``mtp.*`` tensors, a draft
   config whose architecture, hidden size, vocabulary or expert count differs from the target's.
"""

from __future__ import annotations

import os

from mtp_jax.config import ConfigError, EngineConfig, ModelConfig, SpecConfig
from mtp_jax.models.registry import VERIFY_HANDLERS, model_spec
from mtp_jax.weights.gguf_header import QWEN3_5_GGUF_ARCHS, gguf_architecture, gguf_file
from mtp_jax.weights.hub import looks_like_repo_id

__all__ = ["check_before_load", "check_draft_folder", "check_draft_source", "read_model_config",
           "DUMMY_WEIGHT_MTP_MESSAGE"]

DUMMY_WEIGHT_MTP_MESSAGE = ("MTP reads its draft from the checkpoint, so it cannot run with "
                            "--dummy-weight; use --speculative-algorithm none "
                            "(speculative_algorithm='none') with dummy weights, or drop "
                            "--dummy-weight.")
_DRAFT_KEYS = ("model_type", "hidden_size", "vocab_size", "num_experts")


def check_settings(spec: SpecConfig, engine: EngineConfig | None = None, *,
                   dummy_weight: bool = False, dummy_draft_ok: bool = False,
                   has_proposer: bool | None = None) -> None:
    """Checks of the settings alone (no file is read)."""
    spec.validate()
    if engine is not None:
        engine.validate()
    if spec.algorithm == "mtp" and dummy_weight and not dummy_draft_ok:
        raise ConfigError(DUMMY_WEIGHT_MTP_MESSAGE)
    if has_proposer is not None:
        if spec.algorithm == "external" and not has_proposer:
            raise ConfigError("speculative_algorithm='external' needs a proposer callable "
                              "(request_id, token_ids_so_far, k) -> k token ids, passed as "
                              "LLM(..., proposer=fn); the command line has none, so use mtp or "
                              "none there.")
        if spec.algorithm != "external" and has_proposer:
            raise ConfigError(f"a proposer was given but speculative_algorithm is "
                              f"{spec.algorithm!r}; the proposer is only used with "
                              "speculative_algorithm='external'. Pass that, or drop the proposer.")
    if engine is not None:
        check_scheduler_steps(spec, engine)


def check_scheduler_steps(spec: SpecConfig, engine: EngineConfig) -> None:
    """Multi-step calls need drafts made on the device (not by a host proposer)."""
    if spec.algorithm == "external" and engine.num_scheduler_steps > 1:
        raise ConfigError(f"num_scheduler_steps (--num-scheduler-steps) "
                          f"{engine.num_scheduler_steps} needs drafts made on the device; "
                          "speculative_algorithm='external' takes them from the host every "
                          "round: use num_scheduler_steps=1 (the default).")


def read_model_config(path: str | None, *, mtp: bool) -> ModelConfig:
    """The target's :class:`ModelConfig`, refusing GGUF targets (``mtp``: MTP was asked for)."""
    if path is None:
        raise ConfigError("no model path was given; pass a checkpoint folder (config.json + "
                          "*.safetensors).")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"model path {path!r} is not a path; pass a checkpoint folder.")
    path = os.fspath(path)
    g = gguf_file(path)
    if g is not None:
        arch = gguf_architecture(g)
        if arch not in QWEN3_5_GGUF_ARCHS:
            raise ConfigError(
                f"{g} is a GGUF checkpoint of architecture {arch!r}; mtp_jax runs the Qwen3.5 "
                f"family only (GGUF architectures {', '.join(QWEN3_5_GGUF_ARCHS)}; HF model_type "
                "qwen3_5, qwen3_5_moe). Pass a Qwen3.5-family HF checkpoint folder.")
        if mtp:
            raise ConfigError(
                f"MTP is not supported for {arch} yet: {g} is a GGUF checkpoint, and mtp_jax "
                "reads the MTP draft (mtp.* tensors) only from HF safetensors. Pass the HF "
                "safetensors checkpoint folder (config.json + *.safetensors), or run without "
                "speculation (--speculative-algorithm none).")
        raise ConfigError(
            f"{g} is a GGUF checkpoint ({arch}); mtp_jax does not load GGUF weights yet. Pass "
            "the HF safetensors checkpoint folder of the model (config.json + *.safetensors).")
    return ModelConfig.from_folder(path)


def check_draft_folder(cfg: ModelConfig, draft_path: str) -> None:
    """A local draft folder: its config (when it has one) matches the target's architecture,
    hidden size, vocabulary and expert count, and it holds ``mtp.*`` tensors. Reads config.json
    first, then the index or the safetensors headers; never tensor data."""
    from mtp_jax.weights.safetensors_reader import list_tensor_names

    if not os.path.isdir(draft_path):
        raise ConfigError(f"speculative_draft_model_path {draft_path!r} is not a folder; pass a "
                          "folder holding the mtp.* tensors (safetensors).")
    if os.path.isfile(os.path.join(draft_path, "config.json")):
        try:
            d = ModelConfig.from_folder(draft_path)
        except ConfigError as e:
            raise ConfigError(f"the draft folder {draft_path!r} has a config.json mtp_jax cannot "
                              f"use: {e}") from None
        for key in _DRAFT_KEYS:
            if getattr(d, key) != getattr(cfg, key):
                raise ConfigError(f"the draft at {draft_path!r} has {key}={getattr(d, key)!r} but "
                                  f"the target has {getattr(cfg, key)!r}; the MTP draft must "
                                  "come from the same model family and shape. Pass the draft "
                                  "made for this target, or omit the path to use the target's "
                                  "own mtp.* layer.")
    try:
        tensors = list_tensor_names(draft_path)
    except ValueError as e:
        raise ConfigError(f"cannot read the draft folder {draft_path!r}: {e}") from e
    if not any(n.startswith("mtp.") for n in tensors):
        raise ConfigError(f"the draft folder {draft_path!r} holds no mtp.* tensors, so the MTP "
                          "draft cannot be read from it; point speculative_draft_model_path at "
                          "a checkpoint that has them, or omit it to use the target's own.")


def check_draft_source(cfg: ModelConfig, draft_path: str) -> None:
    """Where the MTP draft comes from: a local folder (checked), a GGUF (refused) or a
    Hugging Face repo id (passes; downloaded at load)."""
    if not isinstance(draft_path, (str, os.PathLike)):
        raise ConfigError(f"speculative_draft_model_path {draft_path!r} is not a path.")
    draft_path = os.fspath(draft_path)
    if not os.path.exists(draft_path):
        if looks_like_repo_id(draft_path):
            return
        raise ConfigError(
            f"speculative_draft_model_path {draft_path!r} is not a folder on this machine, and "
            "it is a local path rather than a Hugging Face repo id (name or org/name); pass an "
            "existing folder holding the mtp.* tensors, or omit it to use the target's own.")
    g = gguf_file(draft_path)
    if g is not None:
        try:
            arch = gguf_architecture(g)
        except ConfigError:
            arch = "unreadable header"
        raise ConfigError(
            f"speculative_draft_model_path {draft_path!r} is a GGUF file ({arch}); a GGUF draft "
            f"cannot supply the MTP draft of a {cfg.model_type} target, since mtp_jax reads "
            "mtp.* tensors only from HF safetensors. Pass a safetensors folder holding the "
            "mtp.* tensors, or omit the path to use the target's own.")
    check_draft_folder(cfg, draft_path)


def check_before_load(model: str | None, *, spec: SpecConfig,
                      engine: EngineConfig | None = None, dummy_weight: bool = False,
                      cfg: ModelConfig | None = None, dummy_draft_ok: bool = False,
                      has_proposer: bool | None = None) -> ModelConfig:
    """Run every config-time check; returns the target's :class:`ModelConfig`.

    Args:
      model: the target checkpoint path (may be None when ``cfg`` is given).
      spec: the speculative settings; engine: the engine sizing (None: not checked).
      dummy_weight: random weights instead of the checkpoint's (refused with MTP unless
        ``dummy_draft_ok``, which benchmarks of random-weight models use).
      cfg: an already parsed config (skips reading ``config.json``).
      has_proposer: whether an external proposer callable was given (None: not checked).
    Raises:
      ConfigError: the first check that fails; no weight has been read.
    """
    check_settings(spec, engine, dummy_weight=dummy_weight, dummy_draft_ok=dummy_draft_ok,
                   has_proposer=has_proposer)
    if cfg is None:
        cfg = read_model_config(model, mtp=spec.algorithm == "mtp")
    family = model_spec(cfg)
    if spec.enabled and spec.algorithm not in family.drafts:
        what = "MTP" if spec.algorithm == "mtp" else repr(spec.algorithm)
        raise ConfigError(
            f"speculative_algorithm={spec.algorithm!r} is not available for model_type "
            f"{cfg.model_type!r}: the family has no {what} draft registered (registered: "
            f"{', '.join(family.drafts) or 'none'}). Use one of those, or "
            "speculative_algorithm='none' (--speculative-algorithm none).")
    spec.validate(cfg)
    if spec.enabled:
        for state in family.slot_states:
            if state.verify_handler not in VERIFY_HANDLERS:
                raise ConfigError(
                    f"model_type {cfg.model_type!r} keeps a per-request slot state "
                    f"{state.name!r} whose verify handler is {state.verify_handler!r}: it "
                    "declares no way to commit a speculative verify (handlers: "
                    f"{', '.join(VERIFY_HANDLERS)}). Run with speculative_algorithm='none' "
                    "(--speculative-algorithm none), or register a handler for the state in "
                    "mtp_jax/models/registry.py.")
    if spec.algorithm == "mtp" and spec.draft_model_path:
        check_draft_source(cfg, spec.draft_model_path)
    return cfg
