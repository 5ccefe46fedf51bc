"""A round call's host side: its batch, its reach in positions, and its record while in flight.

Pure helpers of the step loop (:mod:`mtp_jax.engine.scheduler`), each a function of its inputs:
what a call of ``rounds`` rounds may write past a request's position (:func:`span`), which
prefix-cache snapshot a call may save (:func:`snapshot_targets`), the drafts of a host
proposer (:func:`external_tokens`), and the padded :class:`~mtp_jax.engine.batch.RoundBatch`
(:func:`round_batch`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtp_jax.engine.batch import RoundBatch, sampling_rows
from mtp_jax.engine.pages import PageBook
from mtp_jax.engine.prefix import PrefixStore
from mtp_jax.engine.requests import Request
from mtp_jax.speculative.external import Proposer, propose

__all__ = ["AUTO_SCHEDULER_STEPS", "auto_rounds_per_call", "InFlightRound", "span", "next_pow2",
           "batch_bucket", "ready_bucket", "snapshot_targets", "surely_saved",
           "external_tokens", "round_batch"]


# Rounds per program call the engine chooses: on the H200 the 2B decode step took 1.58 ms at
# one per call (the host sets the pace) and 1.29 ms at 4, and 8 ran no faster than 4
# (docs/benchmarks.md).
AUTO_SCHEDULER_STEPS = 4


def auto_rounds_per_call(k: int, algorithm: str, snapshot_tokens: int | None) -> int:
    """The rounds per program call when ``num_scheduler_steps`` is automatic:
    :data:`AUTO_SCHEDULER_STEPS`; 1 for a host proposer (its drafts come with each round);
    with the prefix cache (``snapshot_tokens``: tokens between snapshot boundaries, ``None``
    when off), lowered so that two overlapped calls commit at most ``snapshot_tokens``
    (``2 n (k + 1)``), so none passes a boundary without saving its snapshot."""
    if algorithm == "external":
        return 1
    n = AUTO_SCHEDULER_STEPS
    if snapshot_tokens is not None:
        n = min(n, max(1, snapshot_tokens // (2 * (k + 1))))
    return n


@dataclasses.dataclass
class InFlightRound:
    """A dispatched call of ``rounds`` rounds of ``k`` drafts each: its rows (requests, in
    batch order), its device output, the snapshot boundaries/ids it was given and the host
    time it was dispatched at."""

    rows: list[Request]
    out: object
    snap_at: np.ndarray
    snap_id: np.ndarray
    t0: float
    rounds: int = 1
    k: int = 0


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def batch_bucket(num_rows: int, max_requests: int) -> int:
    """The batch bucket of ``num_rows`` requests: a power of two, at most the bucket of
    ``max_requests``."""
    return min(next_pow2(num_rows), next_pow2(max_requests))


def ready_bucket(natural: int, ready: set[int] | None) -> int:
    """The bucket a call runs at: the smallest of ``ready`` (buckets whose programs a lean
    warm-up compiled) that holds ``natural`` (the call's own bucket), its padding rows writing
    only the trash page and slot; ``natural`` when ``ready`` is None (every bucket allowed) or
    none is large enough (that bucket is compiled on this call and joins ``ready``)."""
    if ready is None:
        return natural
    larger = [b for b in ready if b >= natural]
    if larger:
        return min(larger)
    ready.add(natural)
    return natural


def span(k: int, rounds: int) -> int:
    """Positions past a request's position that a call of ``rounds`` rounds with ``k`` drafts
    may write (verify rows and chained drafts of its last round)."""
    return (rounds - 1) * (k + 1) + 2 * k + 1


def max_step(req: Request, max_model_len: int) -> int:
    """The most tokens ``req`` may generate in all."""
    return min(req.params.max_tokens, max_model_len - len(req.prompt_ids))


def surely_saved(inflight: InFlightRound | None) -> dict[Request, int]:
    """The boundaries that ``inflight`` (the call still in flight) carries and is sure to
    reach, by request: every round commits at least one token of a live row, so a call of
    ``rounds`` rounds commits past each boundary within ``rounds`` tokens of the position its
    rows started from (the host's ``Request.position`` until that call is collected). A
    request that stops first needs no later snapshot."""
    if inflight is None:
        return {}
    return {r: int(at) for r, at in zip(inflight.rows, inflight.snap_at)
            if 0 <= at <= r.position + inflight.rounds}


def snapshot_targets(running: list[Request], limit: np.ndarray, reach: int,
                     prefix: PrefixStore, b: int, saved: dict[Request, int] | None = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """For a call that may commit up to ``reach`` tokens past each request's position (its
    own rounds plus those of a call still in flight): each request's next prefix-cache
    boundary when the call may reach it (below ``limit``, not already saved, nor in ``saved``:
    :func:`surely_saved` of the call in flight), and a snapshot id to save it in. The program
    saves the state at the boundary in whichever round commits past it
    (:class:`~mtp_jax.engine.batch.RoundBatch`); a call reaches at most the first boundary.
    Returns ``(snap_at [b], snap_id [b])`` int32 (-1 / 0: none)."""
    snap_at = np.full((b,), -1, np.int32)
    snap_id = np.zeros((b,), np.int32)
    st = prefix.snapshot_tokens
    saved = saved or {}
    for i, r in enumerate(running):
        p = (r.position // st + 1) * st  # committed length at the next boundary
        if (p <= min(r.position + reach, int(limit[i])) and p not in r.snapshots
                and saved.get(r) != p):
            # out of ids: give up a shallower own snapshot only for a boundary max_tokens lets
            # the request commit past (a call that stops short gives the id back, lost)
            sure = p <= len(r.prompt_ids) + r.params.max_tokens - 1
            sid = prefix.take_snapshot_id(r if sure else None, p)
            if sid is not None:
                snap_at[i], snap_id[i] = p, sid
    return snap_at, snap_id


def external_tokens(running: list[Request], proposer: Proposer, k: int, vocab_size: int,
                    b: int) -> np.ndarray:
    """``[b, k+1]`` int32: each request's pending token and the ``k`` drafts its host
    proposer gives (checked by :func:`~mtp_jax.speculative.external.propose`)."""
    tokens = np.zeros((b, k + 1), np.int32)
    for i, r in enumerate(running):
        tokens[i, 0] = r.output_ids[-1]
        tokens[i, 1:] = propose(proposer, r.request_id, r.prompt_ids + r.output_ids, k,
                                vocab_size)
    return tokens


def round_batch(running: list[Request], book: PageBook, *, b: int, reach: int,
                max_model_len: int, tokens: np.ndarray) -> RoundBatch:
    """The padded batch of a round call over ``running`` (``b`` rows, padding last), saving no
    snapshot (set ``snap_at`` / ``snap_id`` after, :func:`snapshot_targets`) and every row
    verifying up to k drafts in every round (``first_cap`` / ``draft_cap``). Each request first
    takes pages for ``reach`` positions past its position, when it can
    (:meth:`PageBook.grow`); ``limit`` is then the end of its pages. ``tokens``: ``[b, k+1]``
    host drafts (zeros when the drafts are on the device)."""
    rows: list[Request | None] = list(running) + [None] * (b - len(running))
    limit = np.zeros((b,), np.int32)
    steps = np.zeros((b,), np.int32)
    for i, r in enumerate(running):
        book.grow(r, r.position + reach)
        limit[i] = len(r.pages) * book.page_size
        steps[i] = max_step(r, max_model_len)
    return RoundBatch(
        slot=np.asarray([r.slot if r else 0 for r in rows], np.int32),
        live=np.asarray([r is not None for r in rows], bool),
        page_table=book.table(rows), limit=limit, max_step=steps,
        sampling=sampling_rows(rows), tokens=tokens,
        snap_at=np.full((b,), -1, np.int32), snap_id=np.zeros((b,), np.int32),
        first_cap=np.full((b,), tokens.shape[1] - 1, np.int32),
        draft_cap=np.full((b,), tokens.shape[1] - 1, np.int32))
