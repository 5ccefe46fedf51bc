"""Batched prefill: which prompt chunks a scheduler step prefills and how they are packed into
prefill calls of several requests each.

The policy, in three pure steps (the scheduler runs them, :meth:`Scheduler.prefill_step`):

1. **Chunks** (:func:`plan_waves`). A step's token budget (``chunked_prefill_size``) is spent
   as with one request per call: the oldest prefilling request first, each chunk
   ``min(budget left, prompt left)`` tokens, cut at the next prefix-cache snapshot boundary for
   a family whose prefill cannot save states inside a chunk (``ModelEntry.prefill_snapshots``
   False). So a request's chunk boundaries, and the snapshot boundaries its chunks save, are
   those of one-request prefill; only the number of calls changes.
2. **Waves**. A request that takes several chunks in one step (chunks cut at boundaries) has
   its i-th chunk in wave i: a call never holds two chunks of one request, since the second
   starts from the state the first leaves. Waves run in order.
3. **Calls** (:func:`pack_rows`). A wave's chunks, longest first, are cut into runs; a run of
   R chunks is one call of shape ``(B, T)``: ``B = next_pow2(R)`` rows (padding rows write only
   the trash page and slot), ``T`` the prefill bucket of its longest chunk. A run is allowed
   when ``R <= max_prefill_batch`` (and ``max_running_requests``) and ``B * T`` is at most the
   top prefill bucket (the bucket of ``min(chunked_prefill_size, max_model_len)``): a batched
   program holds no more rows than the largest one-request prefill program, so it needs no more
   activation memory. Among the allowed cuts, the one with the fewest padded tokens plus
   :data:`CALL_TOKENS` per call (then the fewest calls), by a dynamic program over the sorted
   chunks: short chunks of similar buckets share a call, one long chunk does not drag short
   ones up to its bucket.

After a lean warm-up the calls may only take the compiled shapes (``Scheduler.ready_prefill``):
a run takes the ready shape with the fewest padded tokens that holds it (``B' >= B``,
``T' >= T``), a run that none holds is not formed, and a single chunk that none holds compiles
its own shape (as before batching). The lean warm-up compiles one prefill shape
(:func:`mtp_jax.engine.warmup.prefill_shapes`).

``max_prefill_batch = 1`` gives one request per call (the behaviour before batching).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from mtp_jax.engine.batch import PrefillBatch, sampling_rows, snapshot_rows, snapshot_slots
from mtp_jax.engine.pages import PageBook
from mtp_jax.engine.prefix import PrefixStore
from mtp_jax.engine.requests import Request
from mtp_jax.engine.rounds import next_pow2

__all__ = ["MIN_PREFILL_BUCKET", "CALL_TOKENS", "ChunkRow", "prefill_bucket", "prefill_top",
           "chunk_length", "plan_waves", "call_shape", "pack_rows", "prefill_batch",
           "padding_prefill_batch"]

MIN_PREFILL_BUCKET = 16

# A prefill call's fixed cost in prompt tokens, for choosing between fewer calls and fewer
# padded tokens (pack_rows): the launch of its kernels, the MTP draft chain, the first token's
# readback. An estimate, not a measurement: a call of a 2B-4B model that reads its weights
# once costs about what a few hundred more prompt tokens cost on an H200.
CALL_TOKENS = 256


def prefill_bucket(n: int, chunk_size: int) -> int:
    """The length bucket ``T`` of a prefill chunk of ``n`` tokens: a power of two from
    :data:`MIN_PREFILL_BUCKET` up to the bucket of ``chunk_size``."""
    top = max(MIN_PREFILL_BUCKET, next_pow2(chunk_size))
    return min(max(MIN_PREFILL_BUCKET, next_pow2(n)), top)


def prefill_top(chunk_size: int, max_model_len: int) -> int:
    """The largest prefill bucket an engine compiles (tokens): the bucket of
    ``min(chunk_size, max_model_len)``; a batched call's ``B * T`` stays within it."""
    return max(MIN_PREFILL_BUCKET, next_pow2(min(chunk_size, max_model_len)))


@dataclasses.dataclass(frozen=True, eq=False)
class ChunkRow:
    """One request's prompt chunk in a prefill call: positions ``start .. start+length-1``."""

    req: Request
    start: int
    length: int

    @property
    def final(self) -> bool:
        """Whether the chunk ends the prompt (its call samples the first token)."""
        return self.start + self.length == len(self.req.prompt_ids)


def chunk_length(req: Request, start: int, budget: int, snapshot_tokens: int | None,
                 cut_at_boundary: bool) -> int:
    """Tokens of ``req``'s chunk from ``start``: at most ``budget`` and the prompt's rest; with
    ``cut_at_boundary`` (and the prefix cache: ``snapshot_tokens`` not None), ending at the
    next snapshot boundary."""
    n = min(budget, len(req.prompt_ids) - start)
    if snapshot_tokens is not None and cut_at_boundary:
        n = min(n, (start // snapshot_tokens + 1) * snapshot_tokens - start)
    return n


def plan_waves(prefilling: list[Request], budget: int, snapshot_tokens: int | None,
               cut_at_boundary: bool) -> list[list[ChunkRow]]:
    """The chunks a step prefills with ``budget`` tokens (policy step 1), grouped in waves
    (step 2): wave i holds each request's i-th chunk of the step, in ``prefilling`` order.
    Requests are served oldest first until the budget is spent, as one request per call
    would; ``snapshot_tokens`` / ``cut_at_boundary``: as :func:`chunk_length`."""
    waves: list[list[ChunkRow]] = []
    for req in prefilling:
        start, i = req.prefilled, 0
        while budget > 0 and start < len(req.prompt_ids):
            n = chunk_length(req, start, budget, snapshot_tokens, cut_at_boundary)
            if i == len(waves):
                waves.append([])
            waves[i].append(ChunkRow(req, start, n))
            start, budget, i = start + n, budget - n, i + 1
        if budget <= 0:
            break
    return waves


def call_shape(rows: int, t: int, max_rows: int, top: int,
               ready: set[tuple[int, int]] | None) -> tuple[int, int] | None:
    """The ``(B, T)`` shape of a call of ``rows`` chunks whose longest has bucket ``t``, or
    None when such a call is not allowed (policy step 3): more than ``max_rows`` rows, or
    ``B * T`` above ``top`` (one row is always allowed). ``ready``: the shapes a lean warm-up
    compiled (None: every shape allowed); the call then takes the ready shape with the fewest
    padded tokens that holds it (then the fewest rows), none for several rows when none does,
    and its own shape for one row (compiled on first use)."""
    natural = (next_pow2(rows), t)
    if rows > 1 and (rows > max_rows or natural[0] * t > top):
        return None
    if ready is None:
        return natural
    holds = [s for s in ready if s[0] >= natural[0] and s[1] >= t]
    if holds:
        return min(holds, key=lambda s: (s[0] * s[1], s[0]))
    return natural if rows == 1 else None


def pack_rows(rows: list[ChunkRow], shape_of: Callable[[int, int], tuple[int, int] | None],
              call_tokens: int = CALL_TOKENS) -> list[tuple[list[ChunkRow], tuple[int, int]]]:
    """Cut one wave's chunks into calls (policy step 3). ``shape_of(count, longest)``: the
    shape of a call of ``count`` chunks whose longest has ``longest`` tokens, or None when not
    allowed (never None for one chunk; a count that is not allowed stays so with more rows).
    The chunks are sorted longest first (stable) and cut into consecutive runs minimising the
    padded tokens (``B * T``) plus ``call_tokens`` per call, then the number of calls.
    Returns ``[(chunks, (B, T))]``, the longest chunks' call first."""
    order = sorted(rows, key=lambda r: -r.length)
    n = len(order)
    best: list[tuple[int, int, int, tuple[int, int] | None]] = [(0, 0, n, None)] * (n + 1)
    for i in range(n - 1, -1, -1):
        choice = None
        for j in range(i + 1, n + 1):
            shape = shape_of(j - i, order[i].length)
            if shape is None:
                break
            cost = (shape[0] * shape[1] + call_tokens + best[j][0], 1 + best[j][1])
            if choice is None or cost < choice[:2]:
                choice = (*cost, j, shape)
        best[i] = choice
    calls, i = [], 0
    while i < n:
        _, _, j, shape = best[i]
        calls.append((order[i:j], shape))
        i = j
    return calls


def prefill_batch(rows: list[ChunkRow], shape: tuple[int, int], book: PageBook,
                  prefix: PrefixStore | None, k: int) -> PrefillBatch:
    """The :class:`PrefillBatch` of a call over ``rows`` at ``shape = (B, T)`` (rows first,
    then padding rows: trash slot and page, length 0). For each row it first takes, with the
    prefix cache, the snapshot ids of the boundaries in its chunk
    (:meth:`PrefixStore.chunk_snapshots`, recorded in the request) and pages for the chunk,
    its first token and ``k`` drafts' chain (:meth:`PageBook.grow`). Raises ValueError when
    the rows do not fit the shape."""
    b, t = shape
    if len(rows) > b or any(r.length > t for r in rows):
        raise ValueError(f"prefill rows {[r.length for r in rows]} do not fit shape {shape}.")
    s = snapshot_slots(t, prefix.snapshot_tokens if prefix is not None else None)
    ids, nxt = np.zeros((b, t), np.int32), np.zeros((b, t), np.int32)
    start, length, prompt_len = (np.zeros((b,), np.int32) for _ in range(3))
    snap_at, snap_id = np.full((b, s), -1, np.int32), np.zeros((b, s), np.int32)
    redraft = np.zeros((b,), bool)
    for i, row in enumerate(rows):
        req, a, n = row.req, row.start, row.length
        ids[i, :n] = req.prompt_ids[a:a + n]
        following = req.prompt_ids[a + 1:a + n + 1]
        nxt[i, :len(following)] = following
        start[i], length[i], prompt_len[i] = a, n, len(req.prompt_ids)
        targets = prefix.chunk_snapshots(req, a, a + n) if prefix is not None else {}
        snap_at[i:i + 1], snap_id[i:i + 1] = snapshot_rows(targets, s)
        redraft[i] = req.redraft
        book.grow(req, a + n + 2 * k + 1)
    reqs: list[Request | None] = [r.req for r in rows] + [None] * (b - len(rows))
    return PrefillBatch(
        input_ids=ids, next_ids=nxt, start=start, length=length, prompt_len=prompt_len,
        slot=np.asarray([r.slot if r else 0 for r in reqs], np.int32),
        page_table=book.table(reqs), sampling=sampling_rows(reqs),
        step=np.zeros((b,), np.int32), snap_at=snap_at, snap_id=snap_id, redraft=redraft)


def padding_prefill_batch(b: int, t: int, max_pages_per_req: int,
                          snapshot_tokens: int | None) -> PrefillBatch:
    """A prefill batch of shape ``(b, t)`` of padding rows only (they write only the trash
    page and slot): what a warm-up calls to compile that shape."""
    z, zb = np.zeros((b, t), np.int32), np.zeros((b,), np.int32)
    s = snapshot_slots(t, snapshot_tokens)
    return PrefillBatch(
        input_ids=z, next_ids=z, start=zb, length=zb, prompt_len=np.ones((b,), np.int32),
        slot=zb, page_table=np.zeros((b, max_pages_per_req), np.int32),
        sampling=sampling_rows([None] * b), step=zb,
        snap_at=np.full((b, s), -1, np.int32), snap_id=np.zeros((b, s), np.int32),
        redraft=np.zeros((b,), bool))
