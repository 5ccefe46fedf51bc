"""Buckets and warm-up: compile every program an engine can call before it serves.

The engine compiles one prefill program per shape ``(B, T)``: ``T`` a prompt-chunk bucket
(powers of two from :data:`~mtp_jax.engine.prefill_batch.MIN_PREFILL_BUCKET` to
``chunked_prefill_size``), ``B`` a power of two up to ``max_prefill_batch`` with ``B * T``
within the largest ``T`` (batched prefill, :mod:`mtp_jax.engine.prefill_batch`; ``B = 1`` for
every ``T``), and one round program per batch bucket (powers of two up to
``max_running_requests``) and variant. :func:`warmup_calls` calls each of them once with
padding rows, which write only the trash page and slot, so that serving never compiles.
Functions over a :class:`~mtp_jax.engine.scheduler.Scheduler`.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

import jax
import numpy as np

from mtp_jax.engine import startup
from mtp_jax.engine.abort import pools_guard
from mtp_jax.engine.batch import RoundBatch
from mtp_jax.engine.prefill_batch import MIN_PREFILL_BUCKET, padding_prefill_batch, prefill_top
from mtp_jax.engine.rounds import next_pow2
from mtp_jax.engine.scheduler import Scheduler
from mtp_jax.engine.variants import PrefillVariant, RoundVariant
from mtp_jax.sampling import SamplingTensors
from mtp_jax.speculative.adaptive import RequestAcceptance

__all__ = ["prefill_buckets", "prefill_shapes", "batch_buckets", "round_variants",
           "padding_round_batch", "warm_buckets", "warmup_calls", "warmup"]


def prefill_buckets(chunk_size: int, max_model_len: int) -> list[int]:
    """Prompt-chunk length buckets: powers of two from :data:`MIN_PREFILL_BUCKET` to the bucket
    of ``min(chunk_size, max_model_len)``."""
    top = prefill_top(chunk_size, max_model_len)
    out, t = [], MIN_PREFILL_BUCKET
    while t <= top:
        out.append(t)
        t *= 2
    return out


def batch_buckets(max_requests: int) -> list[int]:
    """Batch buckets: powers of two up to the bucket of ``max_requests``."""
    out, b = [], 1
    while b <= next_pow2(max_requests):
        out.append(b)
        b *= 2
    return out


def round_variants(sched: Scheduler) -> list[RoundVariant]:
    """The round variants ``sched`` calls per batch bucket, before the sampling fields are
    set: ``rounds_per_call`` rounds per call, and, with the prefix cache, the same with the
    snapshot replay (calls that may reach a snapshot boundary); with adaptive speculation,
    each also as plain decode steps (``k = 0``), or only those where no call can draft
    (:attr:`AdaptivePolicy.never_drafts`). In the order a run is likely to need them
    (what a background build follows): without the snapshot replay first, and first the
    ``k`` a fresh request's first call runs (:meth:`AdaptivePolicy.plan`)."""
    s = sched.settings
    base = [RoundVariant(k=s.k, proposer=s.proposer, rounds=s.rounds_per_call)]
    policy = sched.adaptive
    if policy is not None and policy.never_drafts:  # no call can draft: plain steps only
        base = [dataclasses.replace(base[0], k=0)]
    elif policy is not None and policy.enabled and s.k:
        plain = dataclasses.replace(base[0], k=0)
        drafts = any(policy.plan(RequestAcceptance.fresh(s.k), s.rounds_per_call))
        base = base + [plain] if drafts else [plain] + base
    if sched.prefix is None:
        return base
    return base + [dataclasses.replace(v, snapshot=True) for v in base]


def prefill_choices(sched: Scheduler) -> list[PrefillVariant]:
    """The prefill variants ``sched`` calls, before the penalties are set: with MTP and
    adaptive speculation the one that drafts (a fresh request's first) and the one that does
    not (:meth:`Scheduler.prefill_drafts`), or only the latter where no call can draft;
    else the one."""
    v = sched.prefill_variant()  # what a call that ends no prompt runs
    if v.drafts or not v.mtp or sched.adaptive.never_drafts:
        return [v]
    return [dataclasses.replace(v, drafts=True), v]


def padding_round_batch(b: int, k: int, max_pages_per_req: int) -> RoundBatch:
    """A round batch of ``b`` padding rows (they write only the trash page and slot)."""
    zi = np.zeros((b,), np.int32)
    return RoundBatch(slot=zi, live=np.zeros((b,), bool),
                      page_table=np.zeros((b, max_pages_per_req), np.int32),
                      limit=zi, max_step=zi,
                      sampling=SamplingTensors.from_params([], pad_to=b, host=True),
                      tokens=np.zeros((b, k + 1), np.int32),
                      snap_at=np.full((b,), -1, np.int32), snap_id=zi, first_cap=zi,
                      draft_cap=zi)


def prefill_shapes(sched: Scheduler, buckets: list[int], max_batch: int | None = None,
                   lean: bool = False) -> list[tuple[int, int]]:
    """The prefill shapes ``(B, T)`` a warm-up compiles for prompt-chunk ``buckets``: every
    ``T`` at ``B = 1``, and at each power of two ``B`` up to the rows a call may hold
    (``Scheduler.prefill_rows_cap``, at most ``max_batch`` requests at once) with ``B * T``
    within the engine's largest bucket (the calls :mod:`mtp_jax.engine.prefill_batch`
    forms). ``lean``: one shape, the largest ``T`` of ``buckets`` at the largest such ``B``,
    which every call pads up to."""
    s = sched.settings
    top = prefill_top(s.chunk_size, s.max_model_len)
    rows = min(sched.prefill_rows_cap(), max_batch or sched.prefill_rows_cap())
    shapes = [(b, t) for t in buckets for b in batch_buckets(rows) if b == 1 or b * t <= top]
    if lean:
        t = buckets[-1]
        return [max((bt for bt in shapes if bt[1] == t), key=lambda bt: bt[0])]
    return shapes


def warm_buckets(sched: Scheduler, max_batch: int | None = None,
                 max_prompt_len: int | None = None, lean: bool = False
                 ) -> tuple[list[tuple[int, int]], list[int]]:
    """``(prefill, batch)``: the prefill shapes ``(B, T)`` (:func:`prefill_shapes`) and round
    batch buckets a warm-up compiles. Every one, or with ``max_batch`` (requests at once) and
    ``max_prompt_len`` (tokens) those such a workload can reach; ``lean``: only the largest
    of each (the calls pad up to them, :func:`~mtp_jax.engine.rounds.ready_bucket`,
    :func:`~mtp_jax.engine.prefill_batch.call_shape`)."""
    s = sched.settings
    prefill = prefill_buckets(s.chunk_size, s.max_model_len)
    if max_prompt_len is not None:
        longest = min(max_prompt_len, s.chunk_size)
        if sched.prefix is not None and not sched.device.prefill_snapshots:
            longest = min(longest, sched.prefix.snapshot_tokens)  # chunks end on boundaries
        prefill = [t for t in prefill if t <= max(MIN_PREFILL_BUCKET, next_pow2(longest))]
    buckets = batch_buckets(sched.book.max_requests)
    if max_batch is not None:
        buckets = [b for b in buckets if b <= next_pow2(max(1, max_batch))]
    shapes = prefill_shapes(sched, prefill, max_batch, lean)
    if lean:
        return shapes, buckets[-1:]
    return shapes, buckets


def warmup_calls(sched: Scheduler, sampled: bool = True, max_batch: int | None = None,
                 max_prompt_len: int | None = None, filtering: bool | None = None,
                 lean: bool = False, greedy: bool = True,
                 penalties: bool = False) -> Callable[[], None]:
    """The program calls of :func:`warmup` (same arguments), as a function that makes them
    (each passes the pools on) without building anything ahead."""
    prefill, buckets = warm_buckets(sched, max_batch, max_prompt_len, lean)
    sampling = [{"greedy_only": True, "filtering": None}] if greedy or not sampled else []
    if sampled:
        sampling += [{"greedy_only": False, "filtering": f}
                     for f in ((False, True) if filtering is None else (filtering,))]
    pens = (False, True) if penalties else (False,)
    sampling = [{**choice, "penalties": p} for p in pens for choice in sampling]
    prefill_variants = [dataclasses.replace(v, penalties=p) for p in pens
                        for v in prefill_choices(sched)]
    max_pages = sched.book.max_pages_per_req
    st = sched.prefix.snapshot_tokens if sched.prefix is not None else None

    def run() -> None:
        for (b, t), variant in itertools.product(prefill, prefill_variants):
            sched.device.prefill(padding_prefill_batch(b, t, max_pages, st), variant)
        for choice in sampling:
            for b, variant in itertools.product(buckets, round_variants(sched)):
                sched.device.round(padding_round_batch(b, variant.k, max_pages),
                                   dataclasses.replace(variant, **choice))
    return run


def warmup(sched: Scheduler, sampled: bool = True, max_batch: int | None = None,
           max_prompt_len: int | None = None, workers: int | None = None,
           filtering: bool | None = None, lean: bool = False, background: bool = False,
           greedy: bool = True, penalties: bool = False) -> float:
    """Compile the programs ``sched`` can call, with rows that write only to the trash page and
    slot, so that no compile happens while requests are served. Returns seconds.

    Covers each prefill shape (:func:`prefill_shapes`, one variant) and each batch bucket's
    round calls (:func:`round_variants`), in the greedy-only variant (unless ``greedy`` is
    False and ``sampled`` True: no call is all greedy rows) and, with ``sampled``, the sampling
    ones: with the top-k / top-p filter (``filtering`` True), without it (False) or both
    (None); with ``penalties``, each prefill and round variant also with the presence /
    frequency penalties (:mod:`mtp_jax.sampling.penalties`). ``max_batch`` (requests at
    once) and ``max_prompt_len`` (tokens) limit it to the buckets such a workload can
    reach; ``lean`` to the largest of them (:func:`warm_buckets`), which every later call of no more rows and tokens pads up to
    (``Scheduler.ready_batch`` / ``ready_prefill``; a larger call compiles its own bucket), so
    a start-up compiles one prefill shape and one batch bucket; without ``lean`` every call
    runs at its own bucket. Programs missing from memory and from the executable cache are
    first built together (:func:`mtp_jax.engine.startup.build_ahead`, compiling on ``workers``
    threads; default :func:`mtp_jax.engine.executable_cache.compile_workers`), then the
    warm-up runs them. ``background``: the build starts on a thread of its own (prefill
    programs first) and this returns at once, running nothing; each later call waits only
    for its own program (``Engine.wait_for_programs``). Without an executable table it is a
    plain warm-up. A call that fails and leaves the pools unusable gets them made anew
    (:func:`~mtp_jax.engine.abort.pools_guard`) before its error is raised.
    """
    t0 = time.perf_counter()
    with pools_guard(sched):  # a failed call may consume the donated pools
        run = warmup_calls(sched, sampled, max_batch, max_prompt_len, filtering, lean,
                           greedy, penalties)
        prefill, buckets = warm_buckets(sched, max_batch, max_prompt_len, lean)
        sched.ready_prefill = set(prefill) if lean else None
        sched.ready_batch = set(buckets) if lean else None
        built = startup.build_ahead(sched.device.programs, run, workers, background)
        if background and built is not None:  # serving waits for each program at its call
            return time.perf_counter() - t0
        run()
        jax.block_until_ready(sched.device.pools)
    return time.perf_counter() - t0
