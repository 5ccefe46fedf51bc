"""Buckets and warm-up of the :class:`mtp_jax.engine.engine.Engine` (a mixin of it).

The engine compiles one prefill program per prompt-chunk bucket (powers of two from
:data:`MIN_PREFILL_BUCKET` to ``chunked_prefill_size``) and one round program per batch bucket
(powers of two up to ``max_running_requests``) and variant. :meth:`WarmupMixin.warmup` calls
each of them once with padding rows, which write only the trash page and slot, so that serving
never compiles.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable

import jax
import numpy as np

from mtp_jax.engine import startup
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.sampling import SamplingTensors

MIN_PREFILL_BUCKET = 16

# Prefill programs are compiled in their sampling variant only; it serves greedy requests with
# the same tokens (argmax for greedy rows), and its extra draft-filtering work is small next to
# a prefill, while a greedy-only variant would add one program per prefill bucket to start-up.
PREFILL_GREEDY_ONLY = False


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


class WarmupMixin:
    """Bucket lists and warm-up calls; uses the engine's ``cfg``, ``chunk_size``,
    ``max_model_len``, ``prefix``, ``programs``, ``pools``, ``k``, ``proposer_kind``,
    ``rounds_per_call``, ``max_pages_per_req``, ``_leaves`` and ``_pools_guard``."""

    def prefill_buckets(self) -> list[int]:
        top = max(MIN_PREFILL_BUCKET, next_pow2(min(self.chunk_size, self.max_model_len)))
        out, t = [], MIN_PREFILL_BUCKET
        while t <= top:
            out.append(t)
            t *= 2
        return out

    def batch_buckets(self) -> list[int]:
        out, b = [], 1
        while b <= next_pow2(self.cfg.max_running_requests):
            out.append(b)
            b *= 2
        return out

    def warmup(self, sampled: bool = True, max_batch: int | None = None,
               max_prompt_len: int | None = None, workers: int | None = None,
               filtering: bool | None = None) -> float:
        """Compile the programs this engine can call, with rows that write only to the trash
        page and slot, so that no compile happens while requests are served. Returns seconds.

        Covers each prefill length bucket (one variant, :data:`PREFILL_GREEDY_ONLY`) and each
        batch bucket's round calls (:meth:`round_variants`), in the greedy-only variant and,
        with ``sampled``, the sampling ones: with the top-k / top-p filter (``filtering``
        True), without it (False) or both (None; the engine's ``sampling_variant``). ``max_batch``
        (requests at once) and ``max_prompt_len`` (tokens) limit it to the buckets such a
        workload can reach. Programs missing from memory and from the executable cache are
        first built together
        (:func:`mtp_jax.engine.startup.build_ahead`, compiling on ``workers`` threads; default
        :func:`mtp_jax.engine.executable_cache.compile_workers`), then the warm-up runs them.
        A call that fails and leaves the pools unusable gets them made anew
        (``Engine._pools_guard``) before its error is raised.
        """
        t0 = time.perf_counter()
        with self._pools_guard():  # a failed call may consume the donated pools
            run = self.warmup_calls(sampled, max_batch, max_prompt_len, filtering)
            startup.build_ahead(self.programs, run, workers)
            run()
            jax.block_until_ready(self.pools)
        return time.perf_counter() - t0

    def warmup_calls(self, sampled: bool = True, max_batch: int | None = None,
                     max_prompt_len: int | None = None,
                     filtering: bool | None = None) -> Callable[[], None]:
        """The program calls of :meth:`warmup` (same arguments), as a function that makes them
        (each passes the pools on) without building anything ahead."""
        prefill = self.prefill_buckets()
        if max_prompt_len is not None:
            longest = min(max_prompt_len, self.chunk_size)
            if self.prefix is not None:  # chunks end on snapshot boundaries
                longest = min(longest, self.prefix.snapshot_tokens)
            prefill = [t for t in prefill if t <= max(MIN_PREFILL_BUCKET, next_pow2(longest))]
        rounds = self.batch_buckets()
        if max_batch is not None:
            rounds = [b for b in rounds if b <= next_pow2(max(1, max_batch))]

        variants = [{"greedy_only": True}]
        if sampled:
            variants += [{"greedy_only": False, "filtering": f}
                         for f in ((False, True) if filtering is None else (filtering,))]

        def run() -> None:
            self._warmup_prefill(prefill)
            for variant in variants:
                self._warmup_rounds(variant, rounds)
        return run

    def _warmup_prefill(self, prefill_buckets) -> None:
        mtp = self.proposer_kind == "mtp"
        for t in prefill_buckets:
            z = np.zeros((1, t), np.int32)
            batch = PrefillBatch(
                input_ids=z, next_ids=z, start=np.zeros((1,), np.int32),
                length=np.zeros((1,), np.int32), prompt_len=np.ones((1,), np.int32),
                slot=np.zeros((1,), np.int32),
                page_table=np.zeros((1, self.max_pages_per_req), np.int32),
                sampling=SamplingTensors.from_params([], pad_to=1, host=True),
                step=np.zeros((1,), np.int32))
            _, self.pools = self.programs.prefill(self._leaves, self.pools, batch, k=self.k,
                                                  mtp=mtp, greedy_only=PREFILL_GREEDY_ONLY)

    def round_variants(self) -> list[dict]:
        """The static keywords of the round calls this engine makes per batch bucket and
        sampling variant: ``num_scheduler_steps`` rounds per call, plus, with the prefix cache,
        single rounds without and with a snapshot (calls that may reach a snapshot boundary).
        ``rounds`` is given only above 1 (single-round calls keep their compile keys)."""
        n = self.rounds_per_call
        out = [{"snapshot": False, **({"rounds": n} if n > 1 else {})}]
        if self.prefix is not None:
            out += ([{"snapshot": False}] if n > 1 else []) + [{"snapshot": True}]
        return out

    def _warmup_rounds(self, sampling: dict, batch_buckets) -> None:
        for b, static in itertools.product(batch_buckets, self.round_variants()):
            batch = self.padding_round_batch(b)
            out, self.pools = self.programs.round(self._leaves, self.pools, batch, k=self.k,
                                                  proposer=self.proposer_kind,
                                                  **sampling, **static)

    def padding_round_batch(self, b: int) -> RoundBatch:
        """A round batch of ``b`` padding rows (they write only the trash page and slot)."""
        zi = np.zeros((b,), np.int32)
        return RoundBatch(slot=zi, live=np.zeros((b,), bool),
                          page_table=np.zeros((b, self.max_pages_per_req), np.int32),
                          limit=zi, max_step=zi,
                          sampling=SamplingTensors.from_params([], pad_to=b, host=True),
                          tokens=np.zeros((b, self.k + 1), np.int32),
                          snap_row=np.full((b,), -1, np.int32), snap_id=zi)

