"""Architecture -> model spec: the modules, the tensor names and the speculative drafts a family
supports. Config-time checks consult it before any weight is read."""

from __future__ import annotations

import dataclasses
from typing import Callable

from mtp_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    model_type: str
    build: Callable  # (cfg, dtype, with_mtp) -> nnx.Module
    drafts: tuple[str, ...]  # speculative algorithms with a draft registered


def _build_qwen3_5(cfg: ModelConfig, dtype, with_mtp: bool):
    from mtp_jax.models.qwen3_5.model import Qwen35Model

    return Qwen35Model(cfg, dtype, with_mtp=with_mtp)


REGISTRY: dict[str, ModelSpec] = {
    "qwen3_5": ModelSpec("qwen3_5", _build_qwen3_5, ("mtp", "external")),
    "qwen3_5_moe": ModelSpec("qwen3_5_moe", _build_qwen3_5, ("mtp", "external")),
}


def model_spec(cfg: ModelConfig) -> ModelSpec:
    try:
        return REGISTRY[cfg.model_type]
    except KeyError:
        raise ValueError(f"no model registered for model_type {cfg.model_type!r}; known: "
                         f"{', '.join(REGISTRY)}") from None
