"""Which engine serves a model: the family's registry entry says (``ModelEntry.serving``).

:func:`make_engine` builds it; :func:`check_memory_before_load` refuses, before any weight is
read, a memory budget that cannot hold one full-length request (the batched engine plans again,
with the same numbers, once the model is loaded).
"""

from __future__ import annotations

import jax

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.memory import plan_memory, planned_weights_bytes, prefix_snapshots
from mtp_jax.speculative.external import Proposer

__all__ = ["make_engine", "check_memory_before_load"]


def make_engine(model, engine_cfg: EngineConfig, speculative: SpeculativeConfig,
                proposer: Proposer | None = None, tokenizer=None):
    """The engine of ``model``'s family: the batched :class:`~mtp_jax.engine.engine.Engine`
    (``serving="rounds"``, every family)."""
    return Engine(model, engine_cfg, speculative, proposer=proposer, tokenizer=tokenizer)


def check_memory_before_load(cfg, engine_cfg: EngineConfig, speculative: SpeculativeConfig,
                             weights_saved: int = 0) -> None:
    """For a family the batched engine serves, :func:`~mtp_jax.engine.memory.plan_memory` with
    the planned weights (less ``weights_saved``, the bytes quantized projections kept
    quantized save: :func:`~mtp_jax.weights.quant_tensors.folder_kept_bytes_saved`) and the
    prefix-cache snapshots (:func:`~mtp_jax.engine.memory.prefix_snapshots`): a
    ``ConfigError`` when the budget cannot hold one full-length request (nothing to plan with
    ``num_pages`` given)."""
    if engine_cfg.num_pages is not None:
        return
    mtp = speculative.algorithm == "mtp"
    stats = jax.devices()[0].memory_stats() or {}
    plan_memory(cfg, dtype=engine_cfg.dtype, page_size=engine_cfg.page_size,
                max_running_requests=engine_cfg.max_running_requests,
                max_model_len=min(engine_cfg.max_model_len, cfg.max_position_embeddings),
                k=speculative.k, mtp=mtp,
                weights_bytes=planned_weights_bytes(cfg, engine_cfg.dtype, mtp and cfg.has_mtp,
                                                    speculative) - weights_saved,
                device_bytes=stats.get("bytes_limit"), mem_fraction=engine_cfg.mem_fraction,
                max_total_tokens=engine_cfg.max_total_tokens,
                snapshots=prefix_snapshots(engine_cfg))
