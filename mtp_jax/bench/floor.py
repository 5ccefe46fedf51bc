"""The bytes a decode step or speculative round must move, and the time floor they set.

Weights read (the embedding only for the rows used; routed experts only for the experts hit
under uniform routing), KV read over the context, GDN state read by the verify and read +
written by the commit, and for k > 0 the MTP draft's weights and KV over its k calls (with a
reduced draft vocabulary of N hot ids, the draft's LM head reads N rows instead of V; with
an int8 draft head or layer, 1 byte per weight and 4 per row's scale): the byte model lives in
:mod:`mtp_jax.models.round_bytes` (the engine's adaptive speculation reads it too).
"""

from __future__ import annotations

from mtp_jax.config import ConfigError, config_dict
from mtp_jax.models.registry import config_from_dict
from mtp_jax.models.round_bytes import expected_experts, forward_weight_bytes, round_bytes

__all__ = ["load_config", "expected_experts", "forward_weight_bytes", "round_bytes"]


def load_config(path: str):
    """The model config of a released ``config.json`` (``configs/*.json``) or a checkpoint
    folder, keys starting with ``_`` (notes) dropped, parsed by the config class of the family
    that the registry finds for its ``model_type``
    (:func:`mtp_jax.models.registry.config_from_dict`). Raises ``OSError`` (no such file),
    ``ValueError`` (not JSON) or ``ConfigError`` (not a JSON object, an unknown family, a bad
    field)."""
    try:
        raw = config_dict(path)
    except TypeError:
        raise ConfigError(f"{path} holds no JSON object; pass a model config.json (e.g. "
                          "configs/Qwen3.5-2B.json).") from None
    return config_from_dict(raw)
