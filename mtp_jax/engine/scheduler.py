"""The step loop: admission, chunked prefill, rounds and per-token stops on the host.

Each :meth:`Scheduler.step`:

1. admits waiting requests (first come, first served) while a slot is free and the page pool can
   guarantee the pages of their final length (prompt + max_tokens, capped at max_model_len);
   with the prefix cache, the head waits while a request still prefilling computes a deeper
   part of its prompt than the cache holds (:meth:`PrefixStore.waits_for_prefill`);
2. prefills up to ``chunk_size`` prompt tokens (chunks of the oldest prefilling requests; a
   prompt longer than that takes several steps, interleaved with rounds), the chunks of
   several requests packed into one call (batched prefill, :mod:`mtp_jax.engine.prefill_batch`:
   up to ``max_prefill_batch`` rows a call). With the prefix cache, each chunk's call saves
   the GDN state at every snapshot boundary inside it (or at its end) into snapshot ids the
   host gives it, so chunks are cut by ``chunk_size`` and the prompt only (a family whose
   prefill cannot give states inside a chunk, qwen4_exp, ends its chunks on boundaries
   instead: ``ModelEntry.prefill_snapshots``);
3. runs one speculative round (a decode step when k = 0) for every decoding request in one
   program call over a power-of-two batch bucket; ``rounds_per_call`` rounds in a row in one
   call when it is above 1 (multi-step scheduling); with adaptive speculation, a request whose
   drafts do not pay verifies none (greedy requests draft together: in every call that
   drafts), and a call where no request drafts runs plain decode steps
   (:mod:`mtp_jax.speculative.adaptive`). With ``overlap`` that call is dispatched
   before the previous call's result is read: each slot's position and generated-token count
   advance on the device, so the host's readback, stop checks and next batch run while the
   device computes. With the prefix cache, a row whose next snapshot boundary the call may
   reach carries it and a snapshot id; the round that reaches it saves the GDN state there.
   While programs are still being built in the background (``Engine.warmup(background=True)``)
   a step that has new tokens (first tokens of a prefill) returns them before this part, so
   they surface before the round waits for its program.

Pages: a request's guaranteed pages cover its committed tokens; before a round it also takes
pages for the k+1 verify positions and the k-1 chained draft positions from the free pool when
it can (for every round of the call, and one call's worth more when the previous call is still
in flight), and its k is clamped (down to 0) where it cannot, or where ``max_tokens`` or
``max_model_len`` leave fewer tokens to emit. After the round, pages past the committed length
(plus what a round in flight may use) are freed.

The scheduler's inputs are explicit: its :class:`LoopSettings`, the :class:`PageBook`, the
:class:`PrefixStore` (or None), the :class:`DeviceState`, the stop rules and the host proposer.
Every request it holds is in exactly one of ``waiting``, ``prefilling`` and ``decoding`` at every
moment (admission and prefill completion move it last), so an error anywhere can find them all
(:mod:`mtp_jax.engine.abort`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable

import numpy as np

from mtp_jax.engine.device import DeviceState
from mtp_jax.engine.pages import PageBook
from mtp_jax.engine.prefill_batch import (MIN_PREFILL_BUCKET, ChunkRow, call_shape, chunk_length,
                                          pack_rows, plan_waves, prefill_batch, prefill_bucket,
                                          prefill_top)
from mtp_jax.engine.prefix import PrefixStore
from mtp_jax.engine.programs import RoundOutput
from mtp_jax.engine.requests import ABORT, Request
from mtp_jax.engine.rounds import (InFlightRound, batch_bucket, external_tokens, ready_bucket,
                                   round_batch, snapshot_targets, span, surely_saved)
from mtp_jax.engine.token_logprobs import call_top, record, record_first, round_logprobs
from mtp_jax.engine.variants import PrefillVariant, RoundVariant, sampling_choice
from mtp_jax.speculative.adaptive import AdaptivePolicy
from mtp_jax.speculative.external import Proposer

__all__ = ["EngineStats", "LoopSettings", "Scheduler", "MIN_PREFILL_BUCKET",
           "PREFILL_GREEDY_ONLY", "prefill_bucket"]

# Prefill programs are compiled in their sampling variant only; it serves greedy requests with
# the same tokens (argmax for greedy rows), and its extra draft-filtering work is small next to
# a prefill, while a greedy-only variant would add one program per prefill bucket to start-up.
PREFILL_GREEDY_ONLY = False
# With adaptive speculation, an MTP prefill call drafts only when a request whose prompt it
# ends will verify the drafts (Scheduler.prefill_drafts); 0 drafts in every call (an A/B).
PREFILL_SKIPS_DRAFTS = 1


@dataclasses.dataclass
class EngineStats:
    """Totals over the engine's life (seconds, tokens, calls)."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    prefill_calls: int = 0
    prefill_chunks: int = 0  # prompt chunks prefilled (rows of the prefill calls)
    rounds: int = 0
    chained_rounds: int = 0  # rounds dispatched before the previous round's result was read
    round_calls: int = 0  # program calls that ran the rounds (fewer with num_scheduler_steps)
    plain_rounds: int = 0  # rounds adaptive speculation ran as plain decode steps (k = 0)


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """The step loop's fixed settings: ``k`` drafts per round (0: plain decoding),
    ``proposer`` (``none | mtp | external``), ``rounds_per_call`` (``num_scheduler_steps``),
    ``chunk_size`` (prompt tokens per step), ``max_model_len`` (tokens), ``overlap``
    (dispatch a round before reading the previous one), the model's ``vocab_size`` and
    ``max_prefill_batch`` (requests' chunks per prefill call; 1: one request per call)."""

    k: int
    proposer: str
    rounds_per_call: int
    chunk_size: int
    max_model_len: int
    overlap: bool
    vocab_size: int
    max_prefill_batch: int = 1


class Scheduler:
    """The step loop over explicit parts (see the module docstring).

    ``stops(req, tokens) -> kept``: appends committed tokens applying every stop
    (:func:`mtp_jax.engine.stops.append_tokens` with the engine's EOS ids, tokenizer and
    ``max_model_len``); ``proposer``: the host drafter of ``proposer="external"``;
    ``adaptive``: the policy that chooses each call's k (:mod:`mtp_jax.speculative.adaptive`;
    None: every call drafts ``settings.k``)."""

    def __init__(self, settings: LoopSettings, book: PageBook, prefix: PrefixStore | None,
                 device: DeviceState, stops: Callable[[Request, list[int]], int],
                 proposer: Proposer | None = None, adaptive: AdaptivePolicy | None = None):
        self.settings, self.book, self.prefix, self.device = settings, book, prefix, device
        self.stops, self.proposer, self.adaptive = stops, proposer, adaptive
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self.inflight: InFlightRound | None = None  # a call dispatched, result not yet read
        self.stats = EngineStats()
        self.abort_count = 0  # requests aborted so far (a caller's cue to look for them)
        self._round_clock = 0.0  # when the last round result was read
        # After a lean warm-up (``mtp_jax.engine.warmup.warmup(lean=True)``): the batch
        # buckets and prefill shapes (B, T) compiled; calls pad up to the smallest that fits
        # (:func:`~mtp_jax.engine.rounds.ready_bucket`,
        # :func:`~mtp_jax.engine.prefill_batch.call_shape`). None: each call's own bucket.
        self.ready_batch: set[int] | None = None
        self.ready_prefill: set[tuple[int, int]] | None = None

    # ---- queues ------------------------------------------------------------------------------
    def final_len(self, req: Request) -> int:
        """Tokens ``req`` holds at most: prompt + max_tokens, capped at max_model_len."""
        return min(len(req.prompt_ids) + req.params.max_tokens, self.settings.max_model_len)

    def add(self, req: Request) -> None:
        """Queue ``req`` with its page guarantee; ``MemoryError`` when the pool could never
        hold it."""
        req.reserve = self.book.pages_for(self.final_len(req))
        if req.reserve > self.book.pages.size - 1:
            raise MemoryError(f"request {req.request_id!r} needs {req.reserve} KV pages "
                              f"({self.final_len(req)} tokens) but the pool has "
                              f"{self.book.pages.size - 1}; lower max_tokens or raise the KV "
                              "budget.")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self.inflight)

    def held(self) -> list[Request]:
        """Every request held, once each: queued, prefilling, decoding (finished ones not yet
        released too) and in the round in flight."""
        rows = self.inflight.rows if self.inflight is not None else []
        return list(dict.fromkeys([*self.waiting, *self.prefilling, *self.decoding, *rows]))

    def release(self, req: Request) -> None:
        """Give back what ``req`` holds: its pages (but those the prefix cache owns), its slot,
        its prefix-cache references and snapshot ids. A request that finished (not aborted)
        first inserts its committed tokens into the prefix cache. A request without a slot
        (queued, or released already) holds nothing: nothing changes."""
        if not req.slot:
            return
        if (self.prefix is not None and req.finish_reason != ABORT
                and req.prefilled == len(req.prompt_ids) and req.output_ids):
            self.book.pages.give_back(self.prefix.insert_committed(req))
        self.book.release(req)
        if self.prefix is not None:
            self.prefix.release(req)

    def release_finished(self) -> None:
        """Release finished requests that no round in flight still computes."""
        busy = set(self.inflight.rows) if self.inflight is not None else set()
        done = [r for r in self.decoding if r.finished and r not in busy]
        for r in done:
            self.release(r)
        self.decoding = [r for r in self.decoding if r not in done]

    # ---- admission and prefill ---------------------------------------------------------------
    def admit(self, req: Request) -> None:
        """Move ``req`` (a waiting request; the step loop admits the head of ``waiting``) to
        ``prefilling``: a slot, its guarantee and, with the prefix cache, the cached prefix
        (its GDN snapshot loaded into the slot)."""
        self.book.admit(req)
        if self.prefix is not None:
            sid = self.prefix.admit(req)
            if req.redraft:  # the last cached page's final draft row is for another token
                page = self.book.take(1)[0]
                self.device.copy_page(self.prefix.private_last_page(req, page), page)
            if sid is not None:
                self.device.load_snapshot(sid, req.slot)
        self.prefilling.append(req)  # in one queue or both at every moment, never in none
        self.waiting.remove(req)

    def prefill_rows_cap(self) -> int:
        """The most requests' chunks one prefill call holds: ``max_prefill_batch``, at most
        ``max_running_requests``."""
        return max(1, min(self.settings.max_prefill_batch, self.book.max_requests))

    def prefill_shape(self, rows: int, longest: int) -> tuple[int, int] | None:
        """The ``(B, T)`` shape of a prefill call of ``rows`` chunks, the longest ``longest``
        tokens, or None when not allowed (:func:`~mtp_jax.engine.prefill_batch.call_shape`
        with this engine's limits and the shapes a lean warm-up compiled)."""
        s = self.settings
        return call_shape(rows, prefill_bucket(longest, s.chunk_size), self.prefill_rows_cap(),
                          prefill_top(s.chunk_size, s.max_model_len), self.ready_prefill)

    def prefill_step(self, budget: int) -> list[Request]:
        """Prefill up to ``budget`` prompt tokens of the prefilling requests, oldest first,
        several requests' chunks per call (:mod:`mtp_jax.engine.prefill_batch`: the chunks
        are those of one request per call; waves, then calls). Each request whose prompt
        ended has its first token and is moved on (:meth:`finish_prefill`) right after its
        call. Returns those requests."""
        st = self.prefix.snapshot_tokens if self.prefix is not None else None
        done = []
        for wave in plan_waves(self.prefilling, budget, st, not self.device.prefill_snapshots):
            for rows, shape in pack_rows(wave, self.prefill_shape):
                self.prefill_call(rows, shape)
                for row in rows:
                    if row.final:
                        self.finish_prefill(row.req)
                        done.append(row.req)
        return done

    def prefill_chunk(self, req: Request, budget: int) -> int:
        """Prefill the next chunk of ``req`` alone (at most ``budget`` tokens, cut as
        :func:`~mtp_jax.engine.prefill_batch.chunk_length` cuts it) in a call of its own;
        the last chunk samples the first token. Returns its length. The request stays in
        ``prefilling`` (the caller finishes it)."""
        st = self.prefix.snapshot_tokens if self.prefix is not None else None
        n = chunk_length(req, req.prefilled, budget, st, not self.device.prefill_snapshots)
        self.prefill_call([ChunkRow(req, req.prefilled, n)], self.prefill_shape(1, n))
        return n

    def prefill_call(self, rows: list[ChunkRow], shape: tuple[int, int]) -> None:
        """One prefill call over ``rows`` (distinct requests' next chunks) at ``shape = (B,
        T)``: its batch (:func:`~mtp_jax.engine.prefill_batch.prefill_batch`: snapshot ids of
        the boundaries in each chunk, pages), then the program. A row whose chunk ends the
        prompt gets its first token (stops applied) and, when asked, its log-probabilities;
        its position is set. Its time, the call and its chunks and tokens are counted in
        :attr:`stats`."""
        s = self.settings
        batch = prefill_batch(rows, shape, self.book, self.prefix, s.k)
        for row in rows:
            row.req.redraft = False  # the first chunk rewrites the row
        t0 = time.perf_counter()
        final = [row.req for row in rows if row.final]
        if self.adaptive is not None:
            for req in final:  # its adaptive state, before its prefill decides on drafts
                if req.acceptance is None:
                    req.acceptance = self.adaptive.fresh(req.params.greedy)
        variant = self.prefill_variant(final)
        out = self.device.prefill(batch, variant)
        if variant.mtp and not variant.drafts:
            for req in final:  # its drafts are stale: its first round verifies none
                req.acceptance.drafting = False
        if self.ready_prefill is not None:
            self.ready_prefill.add(shape)  # compiled now if it was not
        host = np.asarray(out) if final else None  # the one read, for the first tokens
        for i, row in enumerate(rows):
            req = row.req
            req.prefilled += row.length
            if row.final:
                req.position = len(req.prompt_ids)
                self.stops(req, [int(host[i, 0])])  # the first token
                record_first(req, host[i], s.k, variant.logprobs)
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        self.stats.prefill_chunks += len(rows)
        self.stats.prompt_tokens += sum(row.length for row in rows)

    def prefill_variant(self, final: list[Request] = ()) -> PrefillVariant:
        """The prefill variant of a chunk; ``final``: the requests whose prompt it ends (their
        first token's log-probabilities, when asked for; their output counts, when one has
        a penalty)."""
        mtp = self.settings.proposer == "mtp"
        return PrefillVariant(k=self.settings.k, mtp=mtp, logprobs=call_top(final),
                              greedy_only=PREFILL_GREEDY_ONLY,
                              penalties=any(r.params.penalizes for r in final),
                              drafts=mtp and self.prefill_drafts(final))

    def prefill_drafts(self, final: list[Request]) -> bool:
        """Whether an MTP prefill call drafts ``d_1..d_k`` for the requests whose prompt it
        ends (``final``, their adaptive states set): always without adaptive speculation;
        with it, when one of them drafts in its first call
        (:meth:`~mtp_jax.speculative.adaptive.AdaptivePolicy.drafts_first`). So a call that
        ends no prompt drafts nothing (the chunk that ends it drafts anew), nor one whose
        greedy requests start from an estimate that does not pay (random weights, a hard
        prompt): it writes only the draft KV, and their first rounds verify no draft."""
        if self.adaptive is None or not PREFILL_SKIPS_DRAFTS:
            return True
        return any(self.adaptive.drafts_first(r.acceptance) for r in final)

    def finish_prefill(self, req: Request) -> None:
        """After ``req``'s last chunk: insert its prompt into the prefix cache, then release it
        (it stopped at its first token) or move it to ``decoding``."""
        if self.prefix is not None:
            self.book.pages.give_back(self.prefix.insert_prompt(req))
        if req.finished:
            self.release(req)
        else:
            self.book.shrink(req, req.position)
            self.decoding.append(req)
        self.prefilling.remove(req)

    # ---- rounds ------------------------------------------------------------------------------
    def dispatch(self, running: list[Request], chained: bool = False) -> InFlightRound:
        """Dispatch one call of ``rounds_per_call`` rounds over ``running`` without waiting
        for it. ``chained``: the previous call is still in flight (its result not yet read); it
        may commit up to ``rounds_per_call * (k + 1)`` tokens per row. With the prefix cache,
        rows whose next snapshot boundary the two calls may reach get a snapshot id, and the
        call runs the variant that saves it."""
        s = self.settings
        rounds = s.rounds_per_call
        # the call in flight commits at most its own k + 1 tokens a round (a plain call: 1)
        prev_k = self.inflight.k if self.inflight is not None else s.k
        ahead = rounds * (prev_k + 1) if chained else 0
        b = ready_bucket(batch_bucket(len(running), self.book.max_requests), self.ready_batch)
        first_cap, draft_cap = self.draft_caps(running, b, rounds)
        k = s.k if (first_cap.any() or draft_cap.any()) else 0
        tokens = (external_tokens(running, self.proposer, k, s.vocab_size, b)
                  if s.proposer == "external" else np.zeros((b, k + 1), np.int32))
        batch = round_batch(running, self.book, b=b, reach=ahead + span(k, rounds),
                            max_model_len=s.max_model_len, tokens=tokens)
        batch.first_cap, batch.draft_cap = first_cap, draft_cap
        if self.prefix is not None:
            batch.snap_at, batch.snap_id = snapshot_targets(
                running, batch.limit, ahead + rounds * (k + 1), self.prefix, b,
                surely_saved(self.inflight if chained else None))
        variant = RoundVariant(k=k, proposer=s.proposer, rounds=rounds,
                               snapshot=bool(np.any(batch.snap_at >= 0)),
                               logprobs=call_top(running),
                               **sampling_choice([r.params.greedy for r in running],
                                                 batch.sampling, s.vocab_size))
        t0 = time.perf_counter()
        out = self.device.round(batch, variant)
        out.readback.copy_to_host_async()  # the result travels while the host goes on
        self.stats.rounds += rounds
        self.stats.round_calls += 1
        self.stats.chained_rounds += rounds if chained else 0
        self.stats.plain_rounds += rounds if k < s.k else 0
        return InFlightRound(list(running), out, batch.snap_at, batch.snap_id, t0, rounds, k)

    def draft_caps(self, running: list[Request], bucket: int, rounds: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """``(first_cap, draft_cap)``, ``[bucket]`` int32 each: the most drafts each row of
        the next call verifies in its first round and in the others: ``settings.k``, or 0
        where the adaptive policy (:meth:`AdaptivePolicy.plan_call`) finds that the request's
        drafting does not pay (padding rows 0). The call runs plain decode steps when every
        cap is 0."""
        first, later = np.zeros((bucket,), np.int32), np.zeros((bucket,), np.int32)
        if self.adaptive is None:
            first[:len(running)] = later[:len(running)] = self.settings.k
            return first, later
        greedy = [r.params.greedy for r in running]
        for r, g in zip(running, greedy):
            if r.acceptance is None:
                r.acceptance = self.adaptive.fresh(g)
        caps = self.adaptive.plan_call([r.acceptance for r in running], greedy, rounds)
        for i, (a, b) in enumerate(caps):
            first[i], later[i] = a, b
        return first, later

    def collect(self, f: InFlightRound, later: InFlightRound | None = None
                ) -> dict[Request, list[int]]:
        """Read call ``f``'s result and apply its rounds in order on the host: append the
        committed tokens (stops checked per token), keep each snapshot whose boundary a round
        committed past (give back the others), free pages past the committed length, except
        those that ``later`` (a call dispatched after ``f``, still in flight) may use. Rows of
        requests that had already finished (in an earlier call, or an earlier round of this
        one) are ignored."""
        host = RoundOutput(np.asarray(f.out.readback), f.out.top)  # the one device-to-host copy
        emitted, accepted, num_draft = host.emitted, host.num_accepted, host.num_draft
        lps = round_logprobs(host)  # None: no row asked for log-probabilities
        now = time.perf_counter()  # overlapped rounds: count the time since the last read
        self.stats.round_seconds += now - max(f.t0, self._round_clock)
        self._round_clock = now
        new: dict[Request, list[int]] = {}
        active = [r for r in f.rows if not r.finished]
        unsaved = {i for i in range(len(f.rows)) if f.snap_at[i] >= 0}
        for j in range(f.rounds):
            for i, r in enumerate(f.rows):
                if r.finished:  # stopped or aborted earlier; this row ran on, discarded
                    continue
                n = int(accepted[j, i])
                p = int(f.snap_at[i])
                if i in unsaved and r.position < p <= r.position + n + 1:  # saved this round
                    r.snapshots[p] = int(f.snap_id[i])
                    unsaved.discard(i)
                before = len(r.output_ids)
                kept = self.stops(r, emitted[j, i, :n + 1].tolist())
                new.setdefault(r, []).extend(r.output_ids[before:])
                if lps is not None:
                    record(r, *(a[j, i] for a in lps), r.output_ids[before:])
                r.num_rounds += 1
                r.num_draft_tokens += int(num_draft[j, i])
                if r.acceptance is not None and f.k and num_draft[j, i] == f.k:
                    # a round that verified all its drafts (its index: the rounds before it)
                    r.acceptance.observe(r.num_rounds - 1, n + 1)
                    if r.params.greedy:
                        self.adaptive.greedy.observe(n + 1)
                r.num_accepted_tokens += min(n, kept)
                r.position += n + 1
        if unsaved:  # boundaries not reached (or saved by an earlier call), rows finished
            self.prefix.give_back_snapshots([int(f.snap_id[i]) for i in sorted(unsaved)])
        in_later = set(later.rows) if later is not None else set()
        for r in active:
            extra = span(later.k, later.rounds) if r in in_later else 0
            self.book.shrink(r, r.position + extra)
        return new

    def run_round(self, running: list[Request]) -> dict[Request, list[int]]:
        """One call over ``running``, waited for (no overlap)."""
        return self.collect(self.dispatch(running))

    def can_chain(self, running: list[Request], prev: InFlightRound) -> bool:
        """Whether the next call over ``running`` may be dispatched before ``prev``'s result
        is read: overlap on, drafts not from the host, every row in ``prev``."""
        return self.settings.overlap and set(running) <= set(prev.rows)

    def drain(self, new: dict[Request, list[int]]) -> None:
        """Wait for the call in flight, if any, and apply it (tokens added to ``new``)."""
        f, self.inflight = self.inflight, None
        if f is not None:
            for r, toks in self.collect(f).items():
                new.setdefault(r, []).extend(toks)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> dict[Request, list[int]]:
        """One scheduler iteration (see the module docstring). Returns the tokens each request
        gained in it. Admission and prefill wait for the call in flight first. Errors go to the
        caller (:meth:`Engine.step` recovers)."""
        new: dict[Request, list[int]] = {}
        if self.inflight is not None and (self.prefilling or (
                self.waiting and self.book.can_admit(self.waiting[0]))):
            self.drain(new)
            self.release_finished()
        while self.waiting and self.book.can_admit(self.waiting[0]) and not (
                self.prefix is not None and self.waiting[0].first is None
                and self.prefix.waits_for_prefill(self.waiting[0], self.prefilling)):
            self.admit(self.waiting[0])
        if self.waiting and not (self.prefilling or self.decoding or self.inflight):
            raise MemoryError("the next request cannot be admitted into an empty engine; "
                              "its pages exceed the pool.")
        for req in self.prefill_step(self.settings.chunk_size):
            new[req] = list(req.output_ids)
        if not (new and self.device.building()):  # else: first tokens out before a round
            self._round_step(new)                 # that may wait for its program's build
        self.release_finished()
        return new

    def _round_step(self, new: dict[Request, list[int]]) -> None:
        """The round part of :meth:`step`: dispatch the next call, chained to the one in flight
        where it may be, and apply the call whose result is due."""
        running = [r for r in self.decoding if not r.finished]
        prev = self.inflight
        if prev is not None and not (running and self.can_chain(running, prev)):
            self.drain(new)
            prev = None
            running = [r for r in self.decoding if not r.finished]
        if not running:
            return
        cur = self.dispatch(running, chained=prev is not None)
        self.inflight = cur
        if prev is not None:
            got = self.collect(prev, later=cur)
        elif not self.settings.overlap:
            self.inflight = None
            got = self.collect(cur)
        else:
            got = {}
        for r, toks in got.items():
            new.setdefault(r, []).extend(toks)
