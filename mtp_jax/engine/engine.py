"""``Engine``: one loaded model served with continuous batching and speculative rounds.

The engine is a small facade over explicit parts, each with its own file:

* :class:`~mtp_jax.engine.pages.PageBook` — KV pages, request slots, per-request guarantees;
* :class:`~mtp_jax.engine.prefix.PrefixStore` — the radix tree of committed pages and the GDN
  snapshot ids (``None`` with the prefix cache off);
* :class:`~mtp_jax.engine.device.DeviceState` — the state pools and the compiled programs;
* :class:`~mtp_jax.engine.scheduler.Scheduler` — the step loop over those (admit, prefill
  chunk, dispatch, collect, stops);
* :mod:`~mtp_jax.engine.abort` and :mod:`~mtp_jax.engine.warmup` — functions over the
  scheduler.

It sizes the pools from the memory plan (:mod:`mtp_jax.engine.memory`), makes the parts and
answers the public calls (``add_request``, ``step``, ``run``, ``abort``, ``warmup``,
``resize_cache``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Iterable

import jax
import jax.numpy as jnp

from mtp_jax.cache.allocator import pages_needed
from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig, check_scheduler_steps
from mtp_jax.engine import abort as abort_ops
from mtp_jax.engine import warmup as warmup_ops
from mtp_jax.engine.batch import sampling_rows
from mtp_jax.engine.device import DeviceState, PoolShape
from mtp_jax.engine.memory import plan_memory, planned_weights_bytes, prefix_snapshots
from mtp_jax.engine.pages import PageBook
from mtp_jax.engine.prefix import PrefixStore
from mtp_jax.engine.requests import Request
from mtp_jax.engine.rounds import auto_rounds_per_call
from mtp_jax.engine.scheduler import LoopSettings, Scheduler
from mtp_jax.engine.stops import append_tokens
from mtp_jax.models.draft_head import with_draft_head
from mtp_jax.models.loaded import DTYPES, LoadedModel
from mtp_jax.models.registry import entry_of
from mtp_jax.speculative.adaptive import policy_for
from mtp_jax.speculative.draft_dtypes import resolve_draft_dtypes
from mtp_jax.speculative.draft_vocab import hot_token_ids
from mtp_jax.speculative.external import Proposer

__all__ = ["Engine", "MultiStepWarning"]


class MultiStepWarning(UserWarning):
    """Multi-step scheduling settings that lose most of its gain."""


def _warn_multistep_near_snapshots(n: int, k: int, prefix: PrefixStore | None) -> None:
    """Warn when two overlapped calls of ``n`` rounds may commit more than the tokens between
    prefix-cache snapshot boundaries (``2 n (k + 1) > snapshot_tokens``): a call saves only
    the first boundary it reaches, so some are passed unsaved (fewer cache hits)."""
    if prefix is None or n == 1:
        return
    reach, every = 2 * n * (k + 1), prefix.snapshot_tokens
    if reach > every:
        warnings.warn(f"num_scheduler_steps {n} with {k} drafts per round and the prefix cache "
                      f"on: two overlapped calls may commit {reach} tokens, more than the "
                      f"{every} between snapshot boundaries, so some boundaries pass unsaved "
                      "(fewer prefix-cache hits). Leave num_scheduler_steps automatic (the "
                      "default), lower it, or, using the Engine directly, raise "
                      "EngineConfig.snapshot_interval_pages.", MultiStepWarning, stacklevel=4)


class Engine:
    """Serve requests on ``model`` (a :class:`~mtp_jax.models.loaded.LoadedModel` of a family
    the batched engine serves).

    Args: ``engine_cfg`` (sizes, scheduling), ``speculative`` (algorithm, k, draft options),
    ``proposer`` (the host drafter of ``algorithm="external"``), ``tokenizer`` (for stop
    strings and its EOS ids). Raises ``ConfigError`` for settings that cannot run on this
    model, before any pool is made.
    """

    def __init__(self, model: LoadedModel, engine_cfg: EngineConfig,
                 speculative: SpeculativeConfig, proposer: Proposer | None = None,
                 tokenizer=None):
        engine_cfg.validate()
        speculative.validate(model.cfg)
        speculative = resolve_draft_dtypes(speculative, model.dtype)  # "auto" -> int8 / model
        if speculative.algorithm == "mtp" and not model.has_mtp:
            raise ConfigError("speculative_algorithm='mtp' needs the mtp.* draft, which was not "
                              "loaded.")
        if speculative.algorithm == "external" and proposer is None:
            raise ConfigError("speculative_algorithm='external' needs a proposer callable "
                              "(request_id, token_ids_so_far, k) -> k token ids.")
        check_scheduler_steps(speculative, engine_cfg)
        family = entry_of(model.cfg)
        if family.check_engine is not None:
            family.check_engine(model.cfg, engine_cfg, speculative)
        hot = hot_token_ids(speculative.algorithm, speculative.draft_vocab_size,
                            speculative.token_map_path, model.cfg.vocab_size)
        # The draft's own LM head (hot ids and/or int8 rows) and int8 layer, made once.
        model = with_draft_head(model, hot, speculative.draft_head_dtype,
                                speculative.draft_layer_dtype)
        self.model, self.cfg, self.speculative = model, engine_cfg, speculative
        self.tokenizer = tokenizer
        self.k = speculative.k
        self.draft_vocab_size = None if hot is None else int(hot.size)  # None: all V ids
        mc, mtp = model.cfg, speculative.algorithm == "mtp"
        self.max_model_len = min(engine_cfg.max_model_len, mc.max_position_embeddings)
        self.page_size = engine_cfg.page_size
        # A page table row covers max_model_len plus the verify window and the draft chain.
        self.max_pages_per_req = pages_needed(self.max_model_len + 2 * self.k + 1,
                                              self.page_size)
        n_snap = prefix_snapshots(engine_cfg)
        stats = jax.devices()[0].memory_stats() or {}
        self.plan = plan_memory(mc, dtype=model.dtype, page_size=self.page_size,
                                max_running_requests=engine_cfg.max_running_requests,
                                max_model_len=self.max_model_len, k=self.k, mtp=mtp,
                                weights_bytes=planned_weights_bytes(
                                    mc, model.dtype, model.has_mtp,
                                    speculative if mtp else None)
                                - getattr(model, "weight_bytes_saved", 0)
                                + getattr(model, "extra_weight_bytes", 0),
                                device_bytes=stats.get("bytes_limit"),
                                mem_fraction=engine_cfg.mem_fraction,
                                max_total_tokens=engine_cfg.max_total_tokens,
                                snapshots=n_snap)
        num_pages = engine_cfg.num_pages or self.plan.num_pages
        slots = engine_cfg.max_running_requests + 1
        # Pages hold draft KV only with MTP: only then is a page keyed with its next token.
        self.prefix = (PrefixStore(self.page_size, engine_cfg.snapshot_interval_pages, n_snap,
                                   lookahead=mtp)
                       if engine_cfg.enable_prefix_cache else None)
        rounds = engine_cfg.num_scheduler_steps
        if rounds is None:
            rounds = auto_rounds_per_call(self.k, speculative.algorithm,
                                          self.prefix.snapshot_tokens if self.prefix else None)
        else:
            _warn_multistep_near_snapshots(rounds, self.k, self.prefix)
        self.book = PageBook(num_pages, slots, self.page_size, self.max_pages_per_req,
                             self.prefix)
        self.device = DeviceState(model, PoolShape(mc, self.page_size, self.k, mtp,
                                                   DTYPES[model.dtype]),
                                  num_pages, slots, n_snap)
        eos_ids = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())
        stops = functools.partial(append_tokens, eos_ids=eos_ids, tokenizer=tokenizer,
                                  max_model_len=self.max_model_len)
        self.scheduler = Scheduler(
            LoopSettings(k=self.k, proposer=speculative.algorithm,
                         rounds_per_call=rounds,
                         chunk_size=engine_cfg.chunked_prefill_size,
                         max_model_len=self.max_model_len,
                         # Host drafts come with each round's batch: no round runs ahead.
                         overlap=(engine_cfg.overlap_schedule
                                  and speculative.algorithm != "external"),
                         vocab_size=mc.vocab_size,
                         max_prefill_batch=engine_cfg.max_prefill_batch),
            self.book, self.prefix, self.device, stops, proposer,
            adaptive=policy_for(mc, speculative, jnp.dtype(DTYPES[model.dtype]).itemsize,
                                self.draft_vocab_size))

    # ---- views -------------------------------------------------------------------------------
    @property
    def pools(self):
        """The state pools (:class:`~mtp_jax.cache.pools.Pools`), as the last program left
        them."""
        return self.device.pools

    @property
    def stats(self):
        """:class:`~mtp_jax.engine.scheduler.EngineStats` over the engine's life."""
        return self.scheduler.stats

    @property
    def abort_count(self) -> int:
        """Requests aborted so far (a streaming caller's cue to look for them)."""
        return self.scheduler.abort_count

    @property
    def rounds_per_call(self) -> int:
        return self.scheduler.settings.rounds_per_call

    @property
    def proposer_kind(self) -> str:
        """Who drafts: ``none``, ``mtp`` or ``external``."""
        return self.speculative.algorithm

    @property
    def draft_head_dtype(self) -> str | None:
        return self.speculative.draft_head_dtype  # None: the model dtype

    @property
    def draft_layer_dtype(self) -> str | None:
        return self.speculative.draft_layer_dtype  # None: the model dtype

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queue ``req``; ``MemoryError`` when its final length can never fit the KV pool."""
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> dict[Request, list[int]]:
        """One scheduler iteration (:meth:`~mtp_jax.engine.scheduler.Scheduler.step`). Returns
        the tokens each request gained in it.

        With ``overlap_schedule`` the round of this step is dispatched before the previous
        round's result is read, so the host's work (reading, stop checks, the next batch)
        overlaps the device's; tokens then surface one step after the round that made them.

        On an exception (a program failing, a host-side error, ``KeyboardInterrupt``) every
        request the engine held is aborted (``finish_reason`` ``"abort"``, everything it held
        given back, the round in flight dropped unread; :func:`~mtp_jax.engine.abort.recover`)
        and the exception is re-raised as it was: the engine is then empty and serves new
        requests as a fresh one would."""
        try:
            return self.scheduler.step()
        except BaseException as err:
            abort_ops.recover(self.scheduler, err)
            raise

    def run(self, requests: list[Request],
            on_round: Callable[[list[Request]], None] | None = None) -> list[Request]:
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

    def abort(self, requests: Iterable[Request] | None = None) -> list[Request]:
        """Abort ``requests`` (default: all); :func:`mtp_jax.engine.abort.abort`."""
        return abort_ops.abort(self.scheduler, requests)

    def make_ready(self) -> list[Request]:
        """Abort what an earlier call left and renew unreadable pools;
        :func:`mtp_jax.engine.abort.make_ready`."""
        return abort_ops.make_ready(self.scheduler)

    # ---- programs ----------------------------------------------------------------------------
    def warmup(self, sampled: bool = True, max_batch: int | None = None,
               max_prompt_len: int | None = None, workers: int | None = None,
               filtering: bool | None = None, lean: bool = False,
               background: bool = False, greedy: bool = True,
               penalties: bool = False) -> float:
        """Compile every program serving can call (``lean``: only the largest buckets, which
        later calls pad up to; ``background``: on a thread, each call waiting only for its own
        program); :func:`mtp_jax.engine.warmup.warmup`. Returns seconds."""
        return warmup_ops.warmup(self.scheduler, sampled, max_batch, max_prompt_len, workers,
                                 filtering, lean, background, greedy, penalties)

    def warmup_for(self, requests: list[Request], lean: bool = False,
                   background: bool = False) -> float:
        """Compile what serving ``requests`` can call: their prompt-length and batch buckets
        (``lean``: the largest of each, which the calls then pad up to: one prefill and one
        batch bucket compiled), sampling variants (greedy only where a request is greedy, with
        or without the top-k / top-p filter where one samples; with the penalties where one
        has them) and prefix-cache snapshot variants (:meth:`warmup`, ``background``
        included). Returns seconds."""
        if not requests:
            return 0.0
        sampled = [r for r in requests if not r.params.greedy]
        vocab = self.model.cfg.vocab_size
        filters = {sampling_rows([r]).filters_any(vocab) for r in sampled}
        return self.warmup(sampled=bool(sampled),
                           filtering=filters.pop() if len(filters) == 1 else None,
                           max_batch=len(requests),
                           max_prompt_len=max(len(r.prompt_ids) for r in requests), lean=lean,
                           background=background,
                           greedy=any(r.params.greedy for r in requests),
                           penalties=any(r.params.penalizes for r in requests))

    def wait_for_programs(self, cancel: bool = False, timeout: float | None = None) -> bool:
        """Wait until no background build (``warmup(background=True)``) runs, at most
        ``timeout`` seconds; returns whether none does. ``cancel``: drop the programs it is not
        compiling yet (a later call builds its own);
        :meth:`~mtp_jax.engine.executable_cache.ExecutableTable.wait`."""
        table = self.device.programs.executables
        return True if table is None else table.wait(cancel, timeout)

    def program_wait_seconds(self) -> float:
        """Seconds calls have spent getting programs that were not in memory (waiting for a
        background build, or building or loading them; 0.0 without an executable table)."""
        table = self.device.programs.executables
        return table.waited_s if table is not None else 0.0

    def warmup_calls(self, sampled: bool = True, max_batch: int | None = None,
                     max_prompt_len: int | None = None,
                     filtering: bool | None = None) -> Callable[[], None]:
        """:func:`mtp_jax.engine.warmup.warmup_calls` of this engine."""
        return warmup_ops.warmup_calls(self.scheduler, sampled, max_batch, max_prompt_len,
                                       filtering)

    def compiled_program_count(self) -> int:
        """Programs compiled so far for this model (its engines share the jit caches)."""
        return self.device.programs.compiled_count()

    # ---- cache -------------------------------------------------------------------------------
    def flush_cache(self) -> None:
        """Drop every prefix-cache entry no running request uses."""
        if self.prefix is not None:
            self.book.pages.give_back(self.prefix.flush())

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
        # new pool shapes: the programs a lean warm-up compiled no longer serve them
        self.scheduler.ready_batch = self.scheduler.ready_prefill = None
        with abort_ops.pools_guard(self.scheduler):
            if num_pages is not None:
                if num_pages - 1 < self.max_pages_per_req:
                    raise ConfigError(f"num_pages {num_pages} cannot hold one request of "
                                      f"max_model_len={self.max_model_len} "
                                      f"({self.max_pages_per_req} pages + the trash page).")
                self.flush_cache()
                if self.prefix is not None:
                    self.prefix.clear()
                self.device.replace_kv(num_pages)
                self.book.resize(num_pages=num_pages)
            if max_running_requests is not None:
                if max_running_requests < 1:
                    raise ConfigError(f"max_running_requests {max_running_requests} must be "
                                      ">= 1.")
                self.device.replace_slots(max_running_requests + 1)
                self.book.resize(num_slots=max_running_requests + 1)
                self.cfg = dataclasses.replace(self.cfg,
                                               max_running_requests=max_running_requests)
