"""Architecture -> model spec: the modules, the tensor names, the speculative drafts a family
supports and the per-request slot states it keeps. Config-time checks
(:mod:`mtp_jax.checks`) consult it before any weight is read."""

from __future__ import annotations

import dataclasses
from typing import Callable

from mtp_jax.config import ConfigError, ModelConfig

# How a slot state is committed after a speculative verify window of k+1 rows:
#   "replay":     verify leaves the live state untouched and keeps the per-row inputs; the commit
#                 replays the accepted rows onto the live state;
#   "checkpoint": verify keeps one state per row; the commit selects the accepted row's copy.
VERIFY_HANDLERS = ("replay", "checkpoint")


@dataclasses.dataclass(frozen=True)
class SlotState:
    """A per-request state that a verify must commit (beyond the paged KV, which rolls back by
    position). ``verify_handler`` is one of :data:`VERIFY_HANDLERS`; ``None`` means the state
    cannot be verified, so speculation is refused for the model at config time."""

    name: str
    description: str
    verify_handler: str | None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    build: Callable  # (cfg, dtype, with_mtp) -> nnx.Module
    drafts: tuple[str, ...]  # speculative algorithms with a draft registered
    slot_states: tuple[SlotState, ...] = ()


def _build_qwen3_5(cfg: ModelConfig, dtype, with_mtp: bool):
    from mtp_jax.models.qwen3_5.model import Qwen35Model

    return Qwen35Model(cfg, dtype, with_mtp=with_mtp)


_QWEN3_5_SLOT_STATES = (
    SlotState("gdn_recurrent", "Gated DeltaNet recurrent state [slots, Hv, Dk, Dv] float32 per "
              "linear-attention layer", "replay"),
    SlotState("gdn_conv", "Gated DeltaNet causal-conv window [slots, conv_dim, K] per "
              "linear-attention layer, a ring keyed by position (position p in column p mod K)",
              "replay"),
)

REGISTRY: dict[str, ModelSpec] = {
    "qwen3_5": ModelSpec("qwen3_5", _build_qwen3_5, ("mtp", "external"), _QWEN3_5_SLOT_STATES),
    "qwen3_5_moe": ModelSpec("qwen3_5_moe", _build_qwen3_5, ("mtp", "external"),
                             _QWEN3_5_SLOT_STATES),
}

# qwen4_exp (Qwen3.8-Flash-Next): builder and slot states live in its own package.
from mtp_jax.models.qwen4_exp.spec import registry_entry as _qwen4_exp_entry  # noqa: E402

REGISTRY["qwen4_exp"] = _qwen4_exp_entry(ModelSpec, SlotState)


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """The registered spec of ``cfg.model_type``; :class:`ConfigError` when there is none."""
    try:
        return REGISTRY[cfg.model_type]
    except KeyError:
        raise ConfigError(f"no model registered for model_type {cfg.model_type!r}; known: "
                          f"{', '.join(REGISTRY)}. Register it in mtp_jax/models/registry.py "
                          "or use a checkpoint of a known family.") from None
