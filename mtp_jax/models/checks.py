"""Model-side config-time checks: everything about a checkpoint and its family that can be
refused before a weight is read.

They read at most ``config.json`` files, a GGUF header and the tensor names of a separate draft
folder (its index or its safetensors headers), never tensor data, and raise
:class:`~mtp_jax.config.ConfigError` naming the bad value, what is supported and the fix:

* :func:`read_model_config` — the target: a GGUF file (a Flash-Next ``qwen4exp`` one is read,
  with a Strata MTP pack as its draft; the rest, and every bad draft of a GGUF target, are
  refused by :mod:`mtp_jax.models.gguf_checks`), ``config.json`` (missing, unreadable,
  unknown ``model_type``: the registry; an unknown ``quantization_config`` method or field:
  :mod:`mtp_jax.weights.quant_config`);
* :func:`check_family` — a speculative algorithm with no draft registered for the family, a
  per-request slot state without a verify handler;
* :func:`check_request` — what a load asks of the family (random weights, a draft folder,
  kernel backends, family options) against its registry entry;
* :func:`check_draft_source` / :func:`check_draft_folder` — where the MTP draft comes from.

The settings-level checks and the full gate of every entry point are in :mod:`mtp_jax.checks`.
"""

from __future__ import annotations

import os

from mtp_jax.config import ConfigError, ModelConfig
from mtp_jax.kernels import KernelBackends, check_kernel_ops
from mtp_jax.models.entry import VERIFY_HANDLERS, LoadRequest, ModelEntry
from mtp_jax.models.registry import REGISTRY, entry_of, read_config
from mtp_jax.models.gguf_checks import check_gguf_draft, gguf_target_config
from mtp_jax.weights.gguf_header import gguf_draft_file, gguf_file
from mtp_jax.weights.hub import looks_like_repo_id
from mtp_jax.weights.quant_config import quantization_from_folder
from mtp_jax.weights.safetensors_files import list_tensor_names

__all__ = ["read_model_config", "check_family", "check_request", "check_backends",
           "check_draft_source", "check_draft_folder"]

_DRAFT_KEYS = ("model_type", "hidden_size", "vocab_size", "num_experts")


def read_model_config(path: str | None, *, mtp: bool, draft_path: str | None = None):
    """The target's config, parsed by its family's config class (``mtp``: MTP was asked for;
    ``draft_path``: where its draft comes from, which a GGUF target needs to be a Strata
    pack; a GGUF folder's own pack when None).

    Raises:
      ConfigError: no path, a missing one, or a target refused by the rules above.
    """
    if path is None:
        raise ConfigError("no model path was given; pass a checkpoint folder (config.json + "
                          "*.safetensors).")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"model path {path!r} is not a path; pass a checkpoint folder.")
    path = os.fspath(path)
    g = gguf_file(path)
    if g is not None:
        return gguf_target_config(g, mtp=mtp, draft_path=draft_path, model=path)
    cfg = read_config(path)
    quantization_from_folder(path)  # an unknown quant_method or field: refused here
    return cfg


def check_family(cfg, algorithm: str) -> ModelEntry:
    """The family of ``cfg`` can run speculative ``algorithm`` (``"none"`` always can): a draft
    is registered for it and every per-request slot state declares a verify handler. Returns
    the family's entry."""
    family = entry_of(cfg)
    if algorithm != "none" and algorithm not in family.drafts:
        what = "MTP" if algorithm == "mtp" else repr(algorithm)
        raise ConfigError(
            f"speculative_algorithm={algorithm!r} is not available for model_type "
            f"{cfg.model_type!r}: the family has no {what} draft registered (registered: "
            f"{', '.join(family.drafts) or 'none'}). Use one of those, or "
            "speculative_algorithm='none' (--speculative-algorithm none).")
    if algorithm != "none":
        for state in family.slot_states:
            if state.verify_handler not in VERIFY_HANDLERS:
                raise ConfigError(
                    f"model_type {cfg.model_type!r} keeps a per-request slot state "
                    f"{state.name!r} whose verify handler is {state.verify_handler!r}: it "
                    "declares no way to commit a speculative verify (handlers: "
                    f"{', '.join(VERIFY_HANDLERS)}). Run with speculative_algorithm='none' "
                    "(--speculative-algorithm none), or register a handler for the state in "
                    "mtp_jax/models/registry.py.")
    return family


def check_request(cfg, request: LoadRequest) -> None:
    """What a load asks of ``cfg``'s family, against its entry: random weights, a separate
    draft folder, kernel backends (``pallas`` for an op the family runs on XLA only:
    :func:`~mtp_jax.kernels.check_kernel_ops`) and its own options (unknown names or
    values)."""
    family = entry_of(cfg)
    if request.dummy_weight and not family.dummy_weight:
        raise ConfigError(f"dummy (random) weights are not supported for {cfg.model_type} yet; "
                          "write a random checkpoint (python -m mtp_jax.tools.random_checkpoint"
                          " --config ... --out DIR) and load it.")
    draft = request.draft_path
    if draft is not None and not family.draft_folder and not (  # a GGUF: check_draft_source
            isinstance(draft, (str, os.PathLike)) and gguf_draft_file(os.fspath(draft))):
        raise ConfigError(f"speculative_draft_model_path {request.draft_path!r}: a separate MTP "
                          f"draft folder is not supported for {cfg.model_type} yet; drop it (its "
                          "own mtp.* is read).")
    check_kernel_ops(cfg.model_type, family.kernel_ops, dict(request.backends))
    allowed = dict(family.load_options)
    for name, value in request.options:
        if name not in allowed:
            owners = [e.model_type for e in _families_with(name)]
            raise ConfigError(f"{name} {value!r} applies to {' and '.join(owners) or 'no'} "
                              f"checkpoints only, not to model_type {cfg.model_type!r}; drop it.")
        if value not in allowed[name]:
            raise ConfigError(f"{name} {value!r} is unknown; use one of "
                              f"{', '.join(map(repr, allowed[name]))}.")


def _families_with(option: str) -> list[ModelEntry]:
    return [e for e in REGISTRY.values() if option in dict(e.load_options)]


def check_backends(backends: dict, dtype: str | None = None) -> None:
    """The kernel backend choices themselves (names, and ``pallas`` needing a GPU):
    :meth:`mtp_jax.kernels.KernelBackends.resolve`."""
    KernelBackends.resolve(backends.get("attention", "auto"), backends.get("gdn", "auto"),
                           backends.get("moe", "auto"), dtype=dtype,
                           norm=backends.get("norm", "auto"), gemv=backends.get("gemv", "auto"))


def check_draft_folder(cfg: ModelConfig, draft_path: str) -> None:
    """A local draft folder: its config (when it has one) matches the target's architecture,
    hidden size, vocabulary and expert count, and it holds ``mtp.*`` tensors. Reads config.json
    first, then the index or the safetensors headers; never tensor data."""
    if not os.path.isdir(draft_path):
        raise ConfigError(f"speculative_draft_model_path {draft_path!r} is not a folder; pass a "
                          "folder holding the mtp.* tensors (safetensors).")
    if os.path.isfile(os.path.join(draft_path, "config.json")):
        try:
            d = read_config(draft_path)
        except ConfigError as e:
            raise ConfigError(f"the draft folder {draft_path!r} has a config.json mtp_jax cannot "
                              f"use: {e}") from None
        for key in _DRAFT_KEYS:
            if getattr(d, key, None) != getattr(cfg, key, None):
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


def check_draft_source(cfg, draft_path: str, target: str | None = None) -> None:
    """Where the MTP draft comes from: a local folder (checked), a GGUF (a Strata MTP pack of a
    GGUF ``target``, given as the file or a GGUF folder holding it; else refused) or a Hugging
    Face repo id (passes; downloaded at load).

    Raises:
      ConfigError: a local path that does not exist (a ``.gguf`` one: "does not exist"), a
        draft folder or GGUF that cannot draft for this target.
    """
    if not isinstance(draft_path, (str, os.PathLike)):
        raise ConfigError(f"speculative_draft_model_path {draft_path!r} is not a path.")
    draft_path = os.fspath(draft_path)
    if not os.path.exists(draft_path):
        if draft_path.lower().endswith(".gguf"):
            raise ConfigError(f"speculative_draft_model_path {draft_path!r} does not exist: no "
                              "such file on this machine. Pass the path of an existing Strata "
                              "MTP pack (.gguf), or omit it.")
        if looks_like_repo_id(draft_path):
            return
        raise ConfigError(
            f"speculative_draft_model_path {draft_path!r} is not a folder on this machine, and "
            "it is a local path rather than a Hugging Face repo id (name or org/name); pass an "
            "existing folder holding the mtp.* tensors, or omit it to use the target's own.")
    g = gguf_draft_file(draft_path)
    if g is not None:
        check_gguf_draft(cfg, draft_path, g, target)
        return
    check_draft_folder(cfg, draft_path)
