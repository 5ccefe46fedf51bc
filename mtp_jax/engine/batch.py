"""Per-call metadata of the compiled programs, as pytrees (bucket sizes come from shapes)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from mtp_jax.sampling import SamplingTensors


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillBatch:
    """One prefill chunk per row, padded to a length bucket.

    input_ids: ``[B, T]`` int32, prompt tokens ``start .. start+length-1`` (padded);
    next_ids: ``[B, T]`` int32, the token after each (``prompt[start+1 ..]``; the row at the
      prompt's last position is replaced by the sampled first token inside the program);
    start: ``[B]`` int32 position of the chunk's first token (0 resets the slot's GDN state);
    length: ``[B]`` int32 chunk tokens; prompt_len: ``[B]`` int32 whole prompt;
    slot: ``[B]`` int32; page_table: ``[B, max_pages]`` int32; sampling: ``[B]``;
    step: ``[B]`` int32 random-stream step of the first sampled token (0);
    snap_at: ``[B, S]`` int32 prefix-cache boundaries inside the chunk (positions: the committed
      length whose slot state is saved, in ``start+1 .. start+length``; -1: none);
      snap_id: ``[B, S]`` int32 snapshot ids to save them in (0: the trash snapshot). ``S`` is
      :func:`snapshot_slots` of ``T`` (0 without the prefix cache), so it adds no program.
      A family without ``ModelEntry.prefill_snapshots`` saves only a boundary at the chunk's
      end (its chunks end on boundaries).
    redraft: ``[B]`` bool, the chunk resumes a prefix-cache hit whose last page's final draft-KV
      row was written for another next token: the program rewrites the draft KV at
      ``start - 1`` from the slot's hidden (:func:`mtp_jax.engine.snapshots.redraft_row`).
    The first token and drafts are only meaningful for a row whose chunk ends the prompt.
    """

    input_ids: jax.Array
    next_ids: jax.Array
    start: jax.Array
    length: jax.Array
    prompt_len: jax.Array
    slot: jax.Array
    page_table: jax.Array
    sampling: SamplingTensors
    step: jax.Array
    snap_at: jax.Array
    snap_id: jax.Array
    redraft: jax.Array


def snapshot_slots(t: int, snapshot_tokens: int | None) -> int:
    """``S``, the snapshot targets of a prefill chunk bucket of ``t`` tokens: the most
    boundaries (every ``snapshot_tokens``) that ``t`` consecutive positions can cross,
    ``ceil(t / snapshot_tokens)``; 0 without the prefix cache (``None``)."""
    return 0 if snapshot_tokens is None else -(-t // snapshot_tokens)


def snapshot_rows(targets: dict[int, int], s: int) -> tuple:
    """One row's ``(snap_at [1, s], snap_id [1, s])`` int32 numpy arrays of ``targets``
    (boundary position -> snapshot id, at most ``s``), padded with ``-1`` / ``0``."""
    snap_at = np.full((1, s), -1, np.int32)
    snap_id = np.zeros((1, s), np.int32)
    for j, (p, sid) in enumerate(sorted(targets.items())):
        snap_at[0, j], snap_id[0, j] = p, sid
    return snap_at, snap_id


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RoundBatch:
    """One speculative round (or a decode step when k = 0) over a batch bucket.

    The position of each row's pending token and its generated-token count are not here: the
    round reads them from the pools (``Pools.position`` / ``Pools.step`` of the slot), so a round
    can be dispatched while the previous one still runs.

    slot: ``[B]`` int32 (trash slot 0 for padding rows); live: ``[B]`` bool;
    page_table: ``[B, max_pages]`` int32; pages past a row's allocation are the trash page;
    limit: ``[B]`` int32, positions ``>= limit`` have no page: nothing is written there, and the
      drafts are clamped so that the verify rows stay below it;
    max_step: ``[B]`` int32, the most tokens the request may generate in all
      (``min(max_tokens, max_model_len - prompt_len)``): drafts are clamped so that a round's
      tokens never pass it;
    sampling: ``[B]``;
    tokens: ``[B, k+1]`` int32 ``[pending, d_1..d_k]`` supplied by the host (external proposer);
      ignored by MTP / plain rounds, which read the slot's ``next_tokens``;
    snap_at: ``[B]`` int32, a prefix-cache boundary (a position: the committed length whose
      GDN state is saved; -1: none); snap_id: ``[B]`` int32 snapshot id to save it in (0 =
      trash). Each round of the call whose verify rows reach the boundary saves the state after
      row ``snap_at - 1 - position`` (the round's start); the host keeps the snapshot only if
      a round committed that row (a later round overwrites one saved from a rejected row);
    first_cap, draft_cap: ``[B]`` int32, the most drafts each row verifies in the call's first
      round and in its other rounds (adaptive speculation: 0 for a request that does not
      draft in this call, and in the first round after a call it did not draft in; else k).

    A round takes no host-looked-up inputs: a family with such inputs looks them up from
    inside its program (qwen4_exp: :mod:`~mtp_jax.models.qwen4_exp.ple_callback`), so rounds
    need not wait for the host.
    """

    slot: jax.Array
    live: jax.Array
    page_table: jax.Array
    limit: jax.Array
    max_step: jax.Array
    sampling: SamplingTensors
    tokens: jax.Array
    snap_at: jax.Array
    snap_id: jax.Array
    first_cap: jax.Array
    draft_cap: jax.Array


def sampling_rows(reqs: list) -> SamplingTensors:
    """The host sampling rows of ``reqs`` (:class:`~mtp_jax.engine.requests.Request`s; ``None``:
    a greedy padding row, placed last): ``[len(reqs)]`` numpy fields."""
    rows = [(r.params.temperature, r.params.top_k, r.params.top_p, r.seed, r.params.min_p,
             r.params.presence_penalty, r.params.frequency_penalty)
            for r in reqs if r is not None]
    return SamplingTensors.from_params(rows, pad_to=len(reqs), host=True)  # padding at the end
