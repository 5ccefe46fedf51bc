"""The engine and speculative settings of an :class:`mtp_jax.LLM` from its arguments."""

from __future__ import annotations

from mtp_jax.config import (EngineConfig, SpeculativeConfig, normalize_algorithm,
                            normalize_draft_dtype)
from mtp_jax.models.loaded import resolve_dtype
from mtp_jax.speculative.draft_dtypes import resolve_draft_dtypes

__all__ = ["llm_settings"]


def llm_settings(args: dict) -> tuple[SpeculativeConfig, EngineConfig]:
    """``(SpeculativeConfig, EngineConfig)`` from ``args``, the keyword arguments of
    :class:`mtp_jax.LLM` by name (its ``locals()``): ``"auto"`` dtypes resolved for this
    machine, the draft dtypes before the checks read them. Raises
    :class:`~mtp_jax.config.ConfigError` for values the configs refuse."""
    dtype = resolve_dtype(args["dtype"])
    speculative = SpeculativeConfig(
        algorithm=normalize_algorithm(args["speculative_algorithm"]),
        num_steps=args["speculative_num_steps"],
        draft_model_path=args["speculative_draft_model_path"],
        draft_vocab_size=args["speculative_draft_vocab_size"],
        token_map_path=args["speculative_token_map"],
        draft_head_dtype=normalize_draft_dtype(args["speculative_draft_head_dtype"]),
        draft_layer_dtype=normalize_draft_dtype(args["speculative_draft_layer_dtype"]),
        adaptive=args["speculative_adaptive"],
        adaptive_round_cost=args["speculative_adaptive_round_cost"])
    engine = EngineConfig(
        max_running_requests=args["max_running_requests"], page_size=args["page_size"],
        max_model_len=args["max_model_len"], dtype=dtype,
        chunked_prefill_size=args["chunked_prefill_size"],
        max_prefill_batch=args["max_prefill_batch"],
        enable_prefix_cache=args["enable_prefix_cache"],
        overlap_schedule=args["overlap_schedule"],
        num_scheduler_steps=args["num_scheduler_steps"], mem_fraction=args["mem_fraction"],
        max_total_tokens=args["max_total_tokens"])
    return resolve_draft_dtypes(speculative, dtype), engine
