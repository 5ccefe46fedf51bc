"""Per-call metadata of the compiled programs, as pytrees (bucket sizes come from shapes)."""

from __future__ import annotations

import dataclasses

import jax

from mtp_jax.sampling import SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillBatch:
    """One prompt (or prompts) padded to a length bucket.

    input_ids: ``[B, T]`` int32 (padded past ``length``); length: ``[B]`` int32 prompt tokens;
    slot: ``[B]`` int32; page_table: ``[B, max_pages]`` int32; sampling: ``[B]`` parameters;
    step: ``[B]`` int32 random-stream step of the first sampled token (0).
    """

    input_ids: jax.Array
    length: jax.Array
    slot: jax.Array
    page_table: jax.Array
    sampling: SamplingTensors
    step: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundBatch:
    """One speculative round (or a decode step when k = 0) over a batch bucket.

    slot: ``[B]`` int32 (trash slot 0 for padding rows); live: ``[B]`` bool;
    position: ``[B]`` int32 position ``c`` of the pending token (= tokens in the target KV);
    page_table: ``[B, max_pages]`` int32 covering positions up to ``c + 2k``;
    sampling: ``[B]``; step: ``[B]`` int32 generated-token count at the round's start;
    tokens: ``[B, k+1]`` int32 ``[pending, d_1..d_k]`` supplied by the host (external proposer);
    ignored by MTP / plain rounds, which read the slot's ``next_tokens``.
    """

    slot: jax.Array
    live: jax.Array
    position: jax.Array
    page_table: jax.Array
    sampling: SamplingTensors
    step: jax.Array
    tokens: jax.Array
