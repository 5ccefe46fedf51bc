"""model_type -> :class:`~mtp_jax.models.entry.ModelEntry`: the one place a model family is
chosen.

``config.json`` names its family by ``model_type`` (the file's, or its ``text_config``'s for a
composite checkpoint); :func:`entry_for_raw` finds the entry that reads that spelling,
:func:`read_config` parses the file with the entry's config class, and :func:`entry_of` gives
the entry of a parsed config. ``LLM``, the CLI, ``load_model``, the bench and the tools ask here
and never test a family by name. A new family is a folder in ``models/`` plus one line below.
"""

from __future__ import annotations

from typing import Any

from mtp_jax.config import ConfigError, read_config_json
from mtp_jax.models.entry import VERIFY_HANDLERS, ModelEntry, SlotState  # noqa: F401 (API)
from mtp_jax.models.qwen3_5.entry import ENTRIES as _QWEN3_5
from mtp_jax.models.qwen4_exp.entry import ENTRY as _QWEN4_EXP

__all__ = ["REGISTRY", "ModelEntry", "SlotState", "VERIFY_HANDLERS", "entry_for_raw",
           "entry_of", "model_type_of", "read_config", "config_from_dict"]

REGISTRY: dict[str, ModelEntry] = {e.model_type: e for e in (*_QWEN3_5, _QWEN4_EXP)}


def model_type_of(raw: Any) -> str | None:
    """The ``model_type`` spelling a config dict declares: the top level's, else its
    ``text_config``'s (``None`` when neither has one)."""
    if not isinstance(raw, dict):
        return None
    text = raw.get("text_config")
    top = raw.get("model_type")
    if top is None and isinstance(text, dict):
        return text.get("model_type")
    return top


def entry_for_raw(raw: Any) -> ModelEntry:
    """The entry whose family reads the config dict ``raw``. A composite checkpoint whose top
    ``model_type`` is unknown but whose ``text_config`` names a known family is read as that
    family. Raises :class:`ConfigError` naming the model_type and the known ones."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json holds a JSON {type(raw).__name__}, not an object; it is "
                          "not an HF model config (fetch it again).")
    text = raw.get("text_config")
    spellings = [raw.get("model_type")] + ([text.get("model_type")] if isinstance(text, dict)
                                           else [])
    for name in spellings:
        for entry in REGISTRY.values():
            if name in entry.hf_model_types:
                return entry
    known = ", ".join(REGISTRY)
    raise ConfigError(f"model_type {model_type_of(raw)!r} is not supported; mtp_jax reads {known} "
                      "(and their *_text variants). Check that the checkpoint (--model) or config "
                      "(--config) is of one of those families, or register a new family in "
                      "mtp_jax/models/registry.py.")


def entry_of(cfg) -> ModelEntry:
    """The registered entry of a parsed config (``cfg.model_type``); :class:`ConfigError` when
    there is none."""
    try:
        return REGISTRY[cfg.model_type]
    except KeyError:
        raise ConfigError(f"no model registered for model_type {cfg.model_type!r}; known: "
                          f"{', '.join(REGISTRY)}. Register it in mtp_jax/models/registry.py "
                          "or use a checkpoint of a known family.") from None


def config_from_dict(raw: Any):
    """Parse a config dict with its family's config class (:func:`entry_for_raw`)."""
    return entry_for_raw(raw).config_class.from_dict(raw)


def read_config(path: str):
    """Parse ``<path>/config.json`` with its family's config class. Raises
    :class:`ConfigError` for a missing or unreadable file or an unknown family."""
    return config_from_dict(read_config_json(path))
