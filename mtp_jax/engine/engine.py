"""The serving loop: admission, chunked prefill, rounds, and per-token stops on the host.

One ``Engine`` owns a loaded model, its pools and its compiled programs. Each :meth:`step`:

1. admits waiting requests (first come, first served) while a slot is free and the page pool can
   guarantee the pages of their final length (prompt + max_tokens, capped at max_model_len);
2. prefills up to ``chunked_prefill_size`` prompt tokens (one chunk of the oldest prefilling
   request per call; a prompt longer than that takes several steps, interleaved with rounds);
3. runs one speculative round (a decode step when k = 0) for every decoding request in one
   program call over a power-of-two batch bucket; ``num_scheduler_steps`` rounds in a row in
   one call when it is above 1 (multi-step scheduling). With ``overlap_schedule`` (the default)
   that call is dispatched before the previous call's result is read: each slot's position and
   generated-token count advance on the device, so the host's readback, stop checks and next
   batch run while the device computes.

Pages: a request's guaranteed pages cover its committed tokens; before a round it also takes
pages for the k+1 verify positions and the k-1 chained draft positions from the free pool when it
can (for every round of the call, and one call's worth more when the previous call is still in
flight), and its k is clamped
(down to 0) where it cannot, or where ``max_tokens`` or ``max_model_len`` leave fewer tokens to
emit. After the round, pages past the committed length (plus what a round in flight may use)
are freed.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections import deque
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache.allocator import FreeList, pages_needed
from mtp_jax.checks import check_scheduler_steps
from mtp_jax.config import ConfigError, EngineConfig, SpecConfig
from mtp_jax.engine.abort import AbortMixin
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.engine.memory import plan_memory, planned_weights_bytes
from mtp_jax.engine.pools import Pools, make_pools
from mtp_jax.cache.radix import RadixCache
from mtp_jax.engine.programs import LOAD_SNAPSHOT, SAVE_SNAPSHOT, RoundOutput
from mtp_jax.engine.requests import ABORT, Request
from mtp_jax.engine.stops import append_tokens
from mtp_jax.engine.warmup import (MIN_PREFILL_BUCKET, PREFILL_GREEDY_ONLY, WarmupMixin,
                                   next_pow2)
from mtp_jax.models.draft_head import with_draft_head
from mtp_jax.models.loader import DTYPES, LoadedModel
from mtp_jax.sampling import SamplingTensors
from mtp_jax.spec.draft_vocab import hot_token_ids
from mtp_jax.spec.external import Proposer, propose



def clamp_num_draft(k: int, position: int, allocated_tokens: int, emitted: int,
                    max_tokens: int, prompt_len: int, max_model_len: int) -> int:
    """Drafts a row can verify this round: at most k, with the verify positions
    ``position .. position + n`` inside the allocated pages, and no more than the tokens the
    request may still emit (``max_tokens`` and ``max_model_len``) minus the bonus token."""
    room_pages = allocated_tokens - position - 1
    room_tokens = min(max_tokens - emitted, max_model_len - prompt_len - emitted) - 1
    return max(0, min(k, room_pages, room_tokens))


def _warn_multistep_near_snapshots(n: int, k: int, prefix: RadixCache | None) -> None:
    """Warn when multi-step calls would often fall back to single, waited-for rounds: calls
    within ``2 n (k + 1)`` tokens of a prefix-cache snapshot boundary do, and boundaries come
    every ``snapshot_tokens``."""
    if prefix is None or n == 1:
        return
    reach, every = 2 * n * (k + 1), prefix.snapshot_tokens
    if 4 * reach > every:
        warnings.warn(f"num_scheduler_steps {n} with {k} drafts per round and the prefix cache "
                      f"on: calls within {reach} tokens of a snapshot boundary (every {every} "
                      f"tokens) run one round without overlap, about {min(1, reach / every):.0%}"
                      " of them, which loses much of the gain. Lower num_scheduler_steps "
                      "(--num-scheduler-steps), turn the prefix cache off "
                      "(--disable-prefix-cache, enable_prefix_cache=False), or, using the "
                      "Engine directly, raise EngineConfig.snapshot_interval_pages.",
                      MultiStepWarning, stacklevel=3)


class MultiStepWarning(UserWarning):
    """Multi-step scheduling settings that lose most of its gain."""


def _all_greedy(reqs: Iterable[Request]) -> bool:
    """Every request greedy: the programs' greedy-only variant (no sampling path) serves them."""
    return all(r.params.temperature <= 0 for r in reqs)


def sampling_variant(reqs: Iterable[Request], sampling: SamplingTensors, vocab_size: int) -> dict:
    """The static sampling keywords of a round over ``reqs`` (``sampling``: their host rows):
    ``greedy_only`` when every request is greedy (no sampling path traced), else ``filtering``,
    whether some row filters by top-k / top-p
    (:meth:`~mtp_jax.sampling.SamplingTensors.filters_any`), so that the program holds no
    run-time test of either (on a GPU each would be a host round trip per sampling site; the
    2B sampled round lost about 0.15 ms to three of them, ``docs/benchmarks.md``, session 21)."""
    if _all_greedy(reqs):
        return {"greedy_only": True}
    return {"greedy_only": False, "filtering": sampling.filters_any(vocab_size)}


@dataclasses.dataclass
class EngineStats:
    """Totals over the engine's life (seconds, tokens, calls)."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    prefill_calls: int = 0
    rounds: int = 0
    chained_rounds: int = 0  # rounds dispatched before the previous round's result was read
    round_calls: int = 0  # program calls that ran the rounds (fewer with num_scheduler_steps)


@dataclasses.dataclass
class InFlightRound:
    """A dispatched call of ``rounds`` rounds: its rows (requests, in batch order), its device
    output, the snapshot rows/ids it was given and the host time it was dispatched at."""

    rows: list[Request]
    out: object
    snap_row: np.ndarray
    snap_id: np.ndarray
    t0: float
    rounds: int = 1


class Engine(WarmupMixin, AbortMixin):
    def __init__(self, model: LoadedModel, engine_cfg: EngineConfig, spec: SpecConfig,
                 proposer: Proposer | None = None, tokenizer=None):
        engine_cfg.validate()
        spec.validate(model.cfg)
        if spec.algorithm == "mtp" and not model.has_mtp:
            raise ConfigError("speculative_algorithm='mtp' needs the mtp.* draft, which was not "
                              "loaded.")
        if spec.algorithm == "external" and proposer is None:
            raise ConfigError("speculative_algorithm='external' needs a proposer callable "
                              "(request_id, token_ids_so_far, k) -> k token ids.")
        check_scheduler_steps(spec, engine_cfg)
        hot = hot_token_ids(spec.algorithm, spec.draft_vocab_size, spec.token_map_path,
                            model.cfg.vocab_size)
        # The draft's own LM head (hot ids and/or int8 rows) and int8 layer, made once.
        model = with_draft_head(model, hot, spec.draft_head_dtype, spec.draft_layer_dtype)
        self.model, self.cfg, self.spec = model, engine_cfg, spec
        self.proposer, self.tokenizer = proposer, tokenizer
        self.k = spec.k
        self.rounds_per_call = engine_cfg.num_scheduler_steps
        self.draft_vocab_size = None if hot is None else int(hot.size)  # None: all V ids
        self.draft_head_dtype = spec.draft_head_dtype  # None: the model dtype
        self.draft_layer_dtype = spec.draft_layer_dtype  # None: the model dtype
        self.proposer_kind = spec.algorithm
        mc = model.cfg
        self.max_model_len = min(engine_cfg.max_model_len, mc.max_position_embeddings)
        self.page_size = engine_cfg.page_size
        # A page table row covers max_model_len plus the verify window and the draft chain.
        self.max_pages_per_req = pages_needed(self.max_model_len + 2 * self.k + 1, self.page_size)
        mtp = self.proposer_kind == "mtp"
        self.prefix = (RadixCache(self.page_size, engine_cfg.snapshot_interval_pages)
                       if engine_cfg.enable_prefix_cache else None)
        _warn_multistep_near_snapshots(self.rounds_per_call, self.k, self.prefix)
        n_snap = 0
        if self.prefix is not None:
            n_snap = (engine_cfg.max_prefix_snapshots if engine_cfg.max_prefix_snapshots
                      is not None else 4 * engine_cfg.max_running_requests)
        stats = jax.devices()[0].memory_stats() or {}
        self.plan = plan_memory(mc, dtype=model.dtype, page_size=self.page_size,
                                max_running_requests=engine_cfg.max_running_requests,
                                max_model_len=self.max_model_len, k=self.k, mtp=mtp,
                                weights_bytes=planned_weights_bytes(
                                    mc, model.dtype, model.has_mtp, spec if mtp else None),
                                device_bytes=stats.get("bytes_limit"),
                                mem_fraction=engine_cfg.mem_fraction,
                                max_total_tokens=engine_cfg.max_total_tokens,
                                snapshots=n_snap)
        num_pages = engine_cfg.num_pages or self.plan.num_pages
        slots = engine_cfg.max_running_requests + 1
        self.pools: Pools = make_pools(mc, num_pages=num_pages, page_size=self.page_size,
                                       slots=slots, k=self.k, mtp=self.proposer_kind == "mtp",
                                       dtype=DTYPES[model.dtype], num_snapshots=n_snap)
        self.pages = FreeList(num_pages, "KV pages")
        self.snapshot_ids = FreeList(n_snap + 1, "prefix snapshots") if n_snap else None
        self.slots = FreeList(slots, "request slots")
        self.programs = model.programs
        self._leaves = model.param_leaves
        self.stats = EngineStats()
        self.eos_ids = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())
        self.chunk_size = engine_cfg.chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.decoding: list[Request] = []
        self._inflight: InFlightRound | None = None  # a round dispatched, result not yet read
        # Rounds may be dispatched before the previous result is read (not with host drafts).
        self.overlap = engine_cfg.overlap_schedule and self.proposer_kind != "external"
        self._round_clock = 0.0  # when the last round result was read

    # ---- pages -------------------------------------------------------------------------------
    def _outstanding_reserve(self) -> int:
        return sum(max(0, r.reserve - len(r.pages)) for r in self.prefilling + self.decoding)

    def _available_pages(self) -> int:
        """Free pages plus pages the prefix cache could evict."""
        return self.pages.num_free + (self.prefix.evictable_pages() if self.prefix else 0)

    def _take_pages(self, n: int) -> list[int]:
        if self.pages.num_free < n and self.prefix is not None:
            self._give_back_evicted(*self.prefix.evict(n - self.pages.num_free))
        return self.pages.take(n)

    def _give_back_evicted(self, pages, snapshots) -> None:
        self.pages.give_back(pages)
        if snapshots:
            self.snapshot_ids.give_back(snapshots)

    def flush_cache(self) -> None:
        """Drop every prefix-cache entry no running request uses."""
        if self.prefix is not None:
            self._give_back_evicted(*self.prefix.flush())

    def _take_snapshot_id(self) -> int | None:
        if self.snapshot_ids.num_free:
            return self.snapshot_ids.take()[0]
        return self.prefix.evict_snapshot()

    def _final_len(self, req: Request) -> int:
        return min(len(req.prompt_ids) + req.params.max_tokens, self.max_model_len)

    def _can_admit(self, req: Request) -> bool:
        need = pages_needed(self._final_len(req), self.page_size)
        return (self.slots.num_free > 0
                and self._available_pages() - self._outstanding_reserve() >= need)

    def _grow(self, req: Request, num_tokens: int) -> None:
        """Give ``req`` pages for ``num_tokens`` positions: from its guarantee first, then from
        the free pool beyond what other requests are guaranteed; stops short when it runs out."""
        want = min(pages_needed(num_tokens, self.page_size), self.max_pages_per_req)
        while len(req.pages) < want:
            spare = self._available_pages() - self._outstanding_reserve()
            if len(req.pages) >= req.reserve and spare <= 0:
                break
            req.pages += self._take_pages(1)

    def _shrink(self, req: Request, num_tokens: int) -> None:
        keep = pages_needed(num_tokens, self.page_size)
        if len(req.pages) > keep:
            self.pages.give_back(req.pages[keep:])  # never prefix-cache pages (all < keep)
            del req.pages[keep:]

    def _release(self, req: Request) -> None:
        """Give back what ``req`` holds: its pages (but those the prefix cache owns), its slot,
        its prefix-cache references and snapshot ids. A request that finished (not aborted)
        first inserts its committed tokens into the prefix cache. A request without a slot
        (queued, or released already) holds nothing: nothing changes."""
        if not req.slot:
            return
        if (self.prefix is not None and req.finish_reason != ABORT
                and req.prefilled == len(req.prompt_ids) and req.output_ids):
            self._insert_committed(req)
        self.pages.give_back([p for p in req.pages if p not in req.tree_pages])
        self.slots.give_back([req.slot])
        if self.prefix is not None:
            self.prefix.release(req.prefix_nodes)
            if req.snapshots:
                self.snapshot_ids.give_back(list(req.snapshots.values()))
        req.pages, req.slot, req.prefix_nodes, req.tree_pages, req.snapshots = [], 0, [], set(), {}

    # ---- prefix cache ------------------------------------------------------------------------
    def _admit_from_cache(self, req: Request) -> None:
        """Reuse the longest cached prefix: shared pages, the GDN snapshot into the slot, and
        prefill resumes after it."""
        path = self.prefix.match(req.prompt_ids)
        self.prefix.acquire(path, len(req.prompt_ids))
        if not path:
            return
        req.prefix_nodes = list(path)
        req.pages = [n.page for n in path]
        req.tree_pages = set(req.pages)
        req.prefilled = req.cached_tokens = len(path) * self.page_size
        self.pools = LOAD_SNAPSHOT(self.pools, jnp.asarray([path[-1].snapshot], jnp.int32),
                                   jnp.asarray([req.slot], jnp.int32))

    def _snapshot_after_chunk(self, req: Request) -> None:
        end = req.prefilled
        if end % self.prefix.snapshot_tokens or end in req.snapshots:
            return
        sid = self._take_snapshot_id()
        if sid is None:
            return
        self.pools = SAVE_SNAPSHOT(self.pools, jnp.asarray([req.slot], jnp.int32),
                                   jnp.asarray([sid], jnp.int32))
        req.snapshots[end] = sid

    def _insert_committed(self, req: Request) -> None:
        """At a request's end, insert the full pages of its committed tokens (prompt and kept
        output; the last output token is the lookahead), with the snapshots taken on the way.
        Nothing past a stop is inserted: the committed count is the kept tokens minus the
        pending one."""
        tokens = req.prompt_ids + req.output_ids
        committed = min(len(tokens) - 1, req.position)
        held, owned, unused = self.prefix.insert(tokens, committed, req.pages, req.snapshots)
        self.prefix.release(held)  # the request is leaving; the tree keeps the pages
        req.tree_pages |= set(owned)
        if unused:
            self.snapshot_ids.give_back(unused)
        req.snapshots = {}

    def _insert_prompt(self, req: Request) -> None:
        """Insert the prompt's full pages (committed; the first output token is the lookahead
        of a page ending at the prompt's end)."""
        tokens = req.prompt_ids + req.output_ids[:1]
        held, owned, unused = self.prefix.insert(tokens, len(req.prompt_ids), req.pages,
                                                 req.snapshots)
        req.prefix_nodes += held
        req.tree_pages |= set(owned)
        if unused:
            self.snapshot_ids.give_back(unused)
        req.snapshots = {}

    def _table(self, reqs: list[Request | None]) -> np.ndarray:
        t = np.zeros((len(reqs), self.max_pages_per_req), np.int32)
        for i, r in enumerate(reqs):
            if r is not None:
                t[i, :len(r.pages)] = r.pages
        return t

    @staticmethod
    def sampling_rows(reqs: list[Request | None]) -> SamplingTensors:
        """The host sampling rows of ``reqs`` (``None``: a greedy padding row, placed last)."""
        rows = [(r.params.temperature, r.params.top_k, r.params.top_p, r.seed)
                for r in reqs if r is not None]
        return SamplingTensors.from_params(rows, pad_to=len(reqs), host=True)  # padding at the end

    # ---- stops -------------------------------------------------------------------------------
    def _append(self, req: Request, tokens: Iterable[int]) -> int:
        return append_tokens(req, tokens, self.eos_ids, self.tokenizer, self.max_model_len)

    # ---- programs ----------------------------------------------------------------------------
    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Prefill the next chunk (at most ``budget`` tokens) of ``req``; returns its length."""
        n_prompt = len(req.prompt_ids)
        start = req.prefilled
        n = min(budget, n_prompt - start)
        if self.prefix is not None:  # end chunks on snapshot boundaries
            st = self.prefix.snapshot_tokens
            n = min(n, (start // st + 1) * st - start)
        t = min(max(MIN_PREFILL_BUCKET, next_pow2(n)), max(MIN_PREFILL_BUCKET,
                                                            next_pow2(self.chunk_size)))
        ids = np.zeros((1, t), np.int32)
        nxt = np.zeros((1, t), np.int32)
        ids[0, :n] = req.prompt_ids[start:start + n]
        following = req.prompt_ids[start + 1:start + n + 1]
        nxt[0, :len(following)] = following
        self._grow(req, start + n + 2 * self.k + 1)
        batch = PrefillBatch(
            input_ids=np.asarray(ids), next_ids=np.asarray(nxt),
            start=np.asarray([start], np.int32), length=np.asarray([n], np.int32),
            prompt_len=np.asarray([n_prompt], np.int32), slot=np.asarray([req.slot], np.int32),
            page_table=np.asarray(self._table([req])), sampling=self.sampling_rows([req]),
            step=np.zeros((1,), np.int32))
        t0 = time.perf_counter()
        first, self.pools = self.programs.prefill(self._leaves, self.pools, batch, k=self.k,
                                                  mtp=self.proposer_kind == "mtp",
                                                  greedy_only=PREFILL_GREEDY_ONLY)
        req.prefilled += n
        if self.prefix is not None:
            self._snapshot_after_chunk(req)
        if req.prefilled == n_prompt:
            first = int(np.asarray(first)[0])
            req.position = n_prompt
            self._append(req, [first])
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        self.stats.prompt_tokens += n
        return n

    def _span(self, rounds: int) -> int:
        """Positions past a request's position that a call of ``rounds`` rounds may write
        (verify rows and chained drafts of its last round)."""
        return (rounds - 1) * (self.k + 1) + 2 * self.k + 1

    def _rounds_for(self, running: list[Request], ahead: int) -> int:
        """Rounds of the next call: ``num_scheduler_steps``, or 1 when the prefix cache is on
        and some row may reach a snapshot boundary within the call (snapshots are saved in
        single rounds)."""
        n = self.rounds_per_call
        if n == 1:
            return n
        return 1 if self._near_snapshot(running, ahead + n * (self.k + 1)) else n

    def _near_snapshot(self, running: list[Request], reach: int) -> bool:
        """Whether the prefix cache is on and some row's next snapshot boundary lies within
        ``reach`` tokens of its position."""
        if self.prefix is None:
            return False
        st = self.prefix.snapshot_tokens
        return any((r.position // st + 1) * st <= r.position + reach for r in running)

    def _round_batch(self, running: list[Request], ahead: int,
                     rounds: int = 1) -> tuple[RoundBatch, bool]:
        """The batch of a call of ``rounds`` rounds over ``running``, dispatched ``ahead`` tokens
        at most past each request's known position (the previous call, still in flight, commits
        up to its rounds times k + 1; 0 when nothing is in flight). Returns ``(batch,
        snapshot)`` (``snapshot``: some row may save a prefix-cache snapshot; only single rounds
        with nothing in flight do)."""
        b = min(next_pow2(len(running)), next_pow2(self.cfg.max_running_requests))
        rows: list[Request | None] = list(running) + [None] * (b - len(running))
        limit = np.zeros((b,), np.int32)
        max_step = np.zeros((b,), np.int32)
        for i, r in enumerate(running):
            self._grow(r, r.position + ahead + self._span(rounds))
            limit[i] = len(r.pages) * self.page_size
            max_step[i] = min(r.params.max_tokens, self.max_model_len - len(r.prompt_ids))
        snap_row = np.full((b,), -1, np.int32)
        snap_id = np.zeros((b,), np.int32)
        if self.prefix is not None and not ahead and rounds == 1:
            st = self.prefix.snapshot_tokens
            for i, r in enumerate(running):
                n = clamp_num_draft(self.k, r.position, limit[i], len(r.output_ids),
                                    r.params.max_tokens, len(r.prompt_ids), self.max_model_len)
                # A boundary p with c < p <= c + num_draft + 1 is reached after row p - 1 - c.
                p = (r.position // st + 1) * st
                if p <= r.position + n + 1 and p not in r.snapshots:
                    sid = self._take_snapshot_id()
                    if sid is not None:
                        snap_row[i], snap_id[i] = p - 1 - r.position, sid
        tokens = np.zeros((b, self.k + 1), np.int32)
        if self.proposer_kind == "external":
            for i, r in enumerate(running):
                tokens[i, 0] = r.output_ids[-1]
                tokens[i, 1:] = propose(self.proposer, r.request_id, r.prompt_ids + r.output_ids,
                                        self.k, self.model.cfg.vocab_size)
        batch = RoundBatch(
            slot=np.asarray([r.slot if r else 0 for r in rows], np.int32),
            live=np.asarray([r is not None for r in rows], bool),
            page_table=np.asarray(self._table(rows)), limit=limit, max_step=max_step,
            sampling=self.sampling_rows(rows), tokens=tokens, snap_row=snap_row, snap_id=snap_id)
        return batch, bool(np.any(snap_row >= 0))

    def _dispatch_round(self, running: list[Request], chained: bool = False) -> InFlightRound:
        """Dispatch one call (``num_scheduler_steps`` rounds, or 1: :meth:`_rounds_for`) over
        ``running`` without waiting for it. ``chained``: the previous call is still in flight
        (its result not yet read); it may commit up to ``num_scheduler_steps * (k + 1)``
        tokens per row."""
        ahead = self.rounds_per_call * (self.k + 1) if chained else 0
        rounds = self._rounds_for(running, ahead)
        batch, snapshot = self._round_batch(running, ahead, rounds)
        t0 = time.perf_counter()
        static = {"rounds": rounds} if rounds > 1 else {}
        out, self.pools = self.programs.round(self._leaves, self.pools, batch, k=self.k,
                                              proposer=self.proposer_kind,
                                              snapshot=snapshot, **static,
                                              **sampling_variant(running, batch.sampling,
                                                                 self.model.cfg.vocab_size))
        out.readback.copy_to_host_async()  # the result travels while the host goes on
        self.stats.rounds += rounds
        self.stats.round_calls += 1
        self.stats.chained_rounds += rounds if chained else 0
        return InFlightRound(list(running), out, batch.snap_row, batch.snap_id, t0, rounds)

    def _collect(self, f: InFlightRound, later: InFlightRound | None = None
                 ) -> dict[Request, list[int]]:
        """Read call ``f``'s result and apply its rounds in order on the host: append the
        committed tokens (stops checked per token), keep or give back its snapshots, free pages
        past the committed length, except those that ``later`` (a call dispatched after ``f``,
        still in flight) may use. Rows of requests that had already finished (in an earlier
        call, or an earlier round of this one) are ignored."""
        host = RoundOutput(np.asarray(f.out.readback))  # the call's one device-to-host copy
        emitted, accepted, num_draft = host.emitted, host.num_accepted, host.num_draft
        now = time.perf_counter()  # overlapped rounds: count the time since the last read
        self.stats.round_seconds += now - max(f.t0, self._round_clock)
        self._round_clock = now
        new: dict[Request, list[int]] = {}
        active = [r for r in f.rows if not r.finished]
        for j in range(f.rounds):
            for i, r in enumerate(f.rows):
                if r.finished:  # stopped or aborted earlier; this row ran on, discarded
                    if f.snap_row[i] >= 0:  # aborted while its single round was in flight
                        self.snapshot_ids.give_back([int(f.snap_id[i])])
                    continue
                n = int(accepted[j, i])
                if f.snap_row[i] >= 0:  # single rounds only: keep it if its row was committed
                    if f.snap_row[i] <= n:
                        r.snapshots[int(r.position + f.snap_row[i] + 1)] = int(f.snap_id[i])
                    else:
                        self.snapshot_ids.give_back([int(f.snap_id[i])])
                before = len(r.output_ids)
                kept = self._append(r, emitted[j, i, :n + 1].tolist())
                new.setdefault(r, []).extend(r.output_ids[before:])
                r.num_rounds += 1
                r.num_draft_tokens += int(num_draft[j, i])
                r.num_accepted_tokens += min(n, kept)
                r.position += n + 1
        in_later = set(later.rows) if later is not None else set()
        for r in active:
            self._shrink(r, r.position + (self._span(later.rounds) if r in in_later else 0))
        return new

    def _run_round(self, running: list[Request]) -> dict[Request, list[int]]:
        """One round over ``running``, waited for (no overlap)."""
        return self._collect(self._dispatch_round(running))

    def _can_chain(self, running: list[Request], prev: InFlightRound) -> bool:
        """Whether the next round over ``running`` may be dispatched before ``prev``'s result
        is read: overlap on, drafts not from the host, every row in ``prev`` and none able to
        reach a prefix-cache snapshot boundary in either round (those rounds run waited for,
        with the exact snapshot row)."""
        if not self.overlap:
            return False
        if not set(running) <= set(prev.rows):
            return False
        return not self._near_snapshot(running, 2 * self.rounds_per_call * (self.k + 1))

    def _drain(self, new: dict[Request, list[int]]) -> None:
        """Wait for the round in flight, if any, and apply it."""
        f, self._inflight = self._inflight, None
        if f is not None:
            for r, toks in self._collect(f).items():
                new.setdefault(r, []).extend(toks)

    def _release_finished(self) -> None:
        """Release finished requests that no round in flight still computes."""
        busy = set(self._inflight.rows) if self._inflight is not None else set()
        done = [r for r in self.decoding if r.finished and r not in busy]
        for r in done:
            self._release(r)
        self.decoding = [r for r in self.decoding if r not in done]

    # ---- resizing ------------------------------------------------------------------------------
    def resize_cache(self, *, num_pages: int | None = None,
                     max_running_requests: int | None = None) -> None:
        """Resize the pools while no request is in flight.

        ``num_pages``: a new KV pool (target and draft KV rebuilt, prefix cache flushed).
        ``max_running_requests``: a new slot pool (GDN state, pending tokens, draft
        distributions); the KV pool, the draft KV and the cached prefixes are kept.
        Raises ``RuntimeError`` while requests run, ``ConfigError`` for a pool too small for one
        full-length request. Another error (e.g. out of device memory for the new pool) leaves
        the old sizes, with pools made anew when the old ones were already given up (the
        prefix cache then empty).
        """
        if self.has_work():
            raise RuntimeError("resize_cache needs an idle engine; finish or drain the running "
                               "requests first.")
        with self._pools_guard():
            self._resize(num_pages, max_running_requests)

    def _resize(self, num_pages: int | None, max_running_requests: int | None) -> None:
        """:meth:`resize_cache` on an idle engine."""
        mc, dtype = self.model.cfg, DTYPES[self.model.dtype]
        mtp = self.proposer_kind == "mtp"
        if num_pages is not None:
            if num_pages - 1 < self.max_pages_per_req:
                raise ConfigError(f"num_pages {num_pages} cannot hold one request of "
                                  f"max_model_len={self.max_model_len} "
                                  f"({self.max_pages_per_req} pages + the trash page).")
            self.flush_cache()
            self.prefix = (RadixCache(self.page_size, self.cfg.snapshot_interval_pages)
                           if self.prefix is not None else None)
            if self.snapshot_ids is not None:
                self.snapshot_ids = FreeList(self.snapshot_ids.size, "prefix snapshots")
            self.pools = dataclasses.replace(self.pools, kv=None, draft_kv=None)
            fresh = make_pools(mc, num_pages=num_pages, page_size=self.page_size, slots=1,
                               k=self.k, mtp=mtp, dtype=dtype)
            self.pools = dataclasses.replace(self.pools, kv=fresh.kv, draft_kv=fresh.draft_kv)
            self.pages = FreeList(num_pages, "KV pages")
        if max_running_requests is not None:
            if max_running_requests < 1:
                raise ConfigError(f"max_running_requests {max_running_requests} must be >= 1.")
            slots = max_running_requests + 1
            fresh = make_pools(mc, num_pages=1, page_size=self.page_size, slots=slots, k=self.k,
                               mtp=mtp, dtype=dtype)
            self.pools = dataclasses.replace(self.pools, gdn=fresh.gdn,
                                             next_tokens=fresh.next_tokens,
                                             draft_probs=fresh.draft_probs,
                                             position=fresh.position, step=fresh.step)
            self.slots = FreeList(slots, "request slots")
            self.cfg = dataclasses.replace(self.cfg, max_running_requests=max_running_requests)

    # ---- loop --------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        req.reserve = pages_needed(self._final_len(req), self.page_size)
        if req.reserve > self.pages.size - 1:
            raise MemoryError(f"request {req.request_id!r} needs {req.reserve} KV pages "
                              f"({self._final_len(req)} tokens) but the pool has "
                              f"{self.pages.size - 1}; lower max_tokens or raise the KV budget.")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding or self._inflight)

    def step(self) -> dict[Request, list[int]]:
        """One scheduler iteration. Returns the tokens each request gained in it.

        With ``overlap_schedule`` the round of this step is dispatched before the previous
        round's result is read, so the host's work (reading, stop checks, the next batch)
        overlaps the device's; tokens then surface one step after the round that made them.
        Admission, prefill and rounds that may save a prefix-cache snapshot wait for the round
        in flight first.

        On an exception (a program failing, a host-side error, ``KeyboardInterrupt``) every
        request the engine held is aborted (``finish_reason`` ``"abort"``, everything it held
        given back, the round in flight dropped unread; :meth:`_recover`) and the exception
        is re-raised as it was: the engine is then empty and serves new requests as a fresh
        one would."""
        try:
            return self._step()
        except BaseException as err:
            self._recover(err)
            raise

    def _step(self) -> dict[Request, list[int]]:
        """:meth:`step` without the recovery from errors."""
        new: dict[Request, list[int]] = {}
        if self._inflight is not None and (self.prefilling or (
                self.waiting and self._can_admit(self.waiting[0]))):
            self._drain(new)
            self._release_finished()
        while self.waiting and self._can_admit(self.waiting[0]):
            req = self.waiting[0]  # in a queue at every moment, for _recover to find
            req.slot = self.slots.take()[0]
            if self.prefix is not None:
                self._admit_from_cache(req)
            self.prefilling.append(self.waiting.popleft())
        if self.waiting and not (self.prefilling or self.decoding or self._inflight):
            raise MemoryError("the next request cannot be admitted into an empty engine; "
                              "its pages exceed the pool.")
        budget = self.chunk_size
        while self.prefilling and budget > 0:
            req = self.prefilling[0]
            budget -= self._prefill_chunk(req, budget)
            if req.prefilled == len(req.prompt_ids):
                new[req] = list(req.output_ids)
                if self.prefix is not None:
                    self._insert_prompt(req)
                if req.finished:
                    self._release(req)
                else:
                    self._shrink(req, req.position)
                    self.decoding.append(req)
                self.prefilling.pop(0)
        running = [r for r in self.decoding if not r.finished]
        prev = self._inflight
        if prev is not None and not (running and self._can_chain(running, prev)):
            self._drain(new)
            prev = None
            running = [r for r in self.decoding if not r.finished]
        if running:
            cur = self._dispatch_round(running, chained=prev is not None)
            self._inflight = cur
            if prev is not None:
                got = self._collect(prev, later=cur)
            elif not self.overlap:
                self._inflight = None
                got = self._collect(cur)
            else:
                got = {}
            for r, toks in got.items():
                new.setdefault(r, []).extend(toks)
        self._release_finished()
        return new

    def run(self, requests: list[Request], on_round: Callable[[list[Request]], None] | None = None):
        """Serve ``requests`` to completion (each gets ``finish_reason`` set). An error in a
        step is raised after every request in the engine was aborted (:meth:`step`); one in
        ``add_request`` after ``requests`` were aborted."""
        try:
            for r in requests:
                self.add_request(r)
        except BaseException:
            self.abort(requests)
            raise
        while self.has_work():
            self.step()
            if on_round is not None:
                on_round(requests)
        return requests

    def compiled_program_count(self) -> int:
        """Programs compiled so far for this model (its engines share the jit caches)."""
        return self.programs.compiled_count()
