"""The engine phases of one benchmark row: the engine, prefills, plain decode steps, rounds
with the drafts as drafted, and the overlapped round loop they all time
(:func:`pipelined_rounds`), with XLA compilations counted per phase (:class:`Ledger`)."""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable

import jax
import numpy as np

from mtp_jax.bench.compiles import CompileWatch
from mtp_jax.bench.settings import Settings, requests
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request
from mtp_jax.engine.rounds import next_pow2


class Ledger:
    """Compile counts per phase and the first call of each program."""

    def __init__(self):
        self.phases: dict[str, CompileWatch] = {}
        self.programs: list[dict] = []

    @contextlib.contextmanager
    def phase(self, name: str, program: str | None = None):
        """Count the block's compilations under phase ``name``; with ``program``, also record
        the block as that program's first call (seconds, executables built, cache hits)."""
        with CompileWatch() as w:
            yield w
        self.phases.setdefault(name, CompileWatch()).add(w)
        if program is not None:
            self.programs.append({"program": program, "first_call_s": w.seconds,
                                  "compiles": w.compiles, "cache_hits": w.cache_hits,
                                  "compile_s": w.compile_s})

    def compiles(self, name: str) -> int:
        """XLA executables built in phase ``name`` (0 when it never ran)."""
        return self.phases[name].compiles if name in self.phases else 0


def make_engine(model, batch: int, k: int, s: Settings, steps: int = 1) -> Engine:
    """An engine for ``batch`` requests plus one slot for the prefill-throughput prompt, with
    ``steps`` rounds per call (0: the engine's choice) and the prefix cache as
    ``s.prefix_cache`` says (k > 0: with the reduced draft vocabulary of
    ``s.draft_vocab_size`` and the draft head and layer dtypes ``s.draft_head_dtype``,
    ``s.draft_layer_dtype``, if set). With the prefix cache, the round variants of the
    batch's buckets (with and without the snapshot replay) are compiled here, so that a call
    that reaches a boundary in the timed phase compiles nothing."""
    speculative = SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3,
                                    draft_vocab_size=s.draft_vocab_size if k else None,
                                    draft_head_dtype=s.draft_head_dtype if k else None,
                                    draft_layer_dtype=s.draft_layer_dtype if k else None,
                                    adaptive=False)  # forced and timed rounds draft every time
    eng = Engine(model, EngineConfig(max_running_requests=batch + 1, page_size=s.page_size,
                                     max_model_len=s.max_model_len,
                                     chunked_prefill_size=s.chunk_size,
                                     enable_prefix_cache=s.prefix_cache, dtype=model.dtype,
                                     num_scheduler_steps=steps or None),
                 speculative)
    if s.prefix_cache:
        eng.warmup(sampled=s.sampled, max_batch=batch + 1, max_prompt_len=1)
    return eng


def bucket_names(eng: Engine, batch: int, k: int, s: Settings) -> tuple[str, str]:
    """The row's program names as the tables show them: ``("prefill[T=1024,k=3]",
    "round[B=1,k=3,steps=4,sampled]")`` (T and B the padded buckets)."""
    t = max(16, next_pow2(s.chunk_size))
    b = min(next_pow2(batch), next_pow2(eng.cfg.max_running_requests))
    steps = f",steps={eng.rounds_per_call}" if eng.rounds_per_call > 1 else ""
    steps += ",sampled" if s.sampled else ""
    return f"prefill[T={t},k={k}]", f"round[B={b},k={k}{steps}]"


def prefill_all(eng: Engine, reqs: list[Request], ledger: Ledger, phase: str,
                first_program: str | None) -> None:
    """Admit ``reqs`` and prefill each whole prompt (no round in between), as ``Engine.step``
    does; the first request's prefill is recorded as ``first_program``'s first call."""
    sched = eng.scheduler
    for r in reqs:
        sched.add(r)
        sched.admit(r)
    for i, r in enumerate(reqs):
        with ledger.phase(phase, first_program if i == 0 else None):
            while r.prefilled < len(r.prompt_ids):
                sched.prefill_chunk(r, sched.settings.chunk_size)
            sched.finish_prefill(r)
            jax.block_until_ready(eng.pools)


def release_all(eng: Engine, reqs: list[Request]) -> None:
    """Free the slots and pages of ``reqs`` and drop them from the decoding queue."""
    sched = eng.scheduler
    for r in reqs:
        sched.release(r)
    sched.decoding = [r for r in sched.decoding if r not in reqs]


def measure_prefill(eng: Engine, s: Settings, vocab: int) -> float:
    """Median seconds of ``prefill_reps`` prefills of one ``prompt_len`` prompt (compiled
    program, timed alone, in the spare slot)."""
    times = []
    for rep in range(s.prefill_reps):
        extra = requests(1, s.prompt_len, 2, vocab, 10**6 + rep)[0]
        sched = eng.scheduler
        sched.add(extra)
        sched.admit(extra)
        jax.block_until_ready(eng.pools)
        t0 = time.perf_counter()
        while extra.prefilled < s.prompt_len:
            sched.prefill_chunk(extra, sched.settings.chunk_size)
        jax.block_until_ready(eng.pools)
        times.append(time.perf_counter() - t0)
        sched.release(extra)
        sched.prefilling.remove(extra)
    return statistics.median(times)


def round_timing(times: list[float], host: list[float], rounds: int = 1) -> dict:
    """Median and p10 / p90 of the rounds' times and of their host times (seconds in, per
    call of ``rounds`` rounds; reported per round)."""
    ms, host_ms = np.asarray(times) * 1e3 / rounds, np.asarray(host) * 1e3 / rounds
    return {"round_ms": float(np.median(ms)), "round_ms_p10": float(np.percentile(ms, 10)),
            "round_ms_p90": float(np.percentile(ms, 90)), "rounds_timed": len(times) * rounds,
            "calls_timed": len(times),
            "host_ms": float(np.median(host_ms)), "host_ms_p10": float(np.percentile(host_ms, 10)),
            "host_ms_p90": float(np.percentile(host_ms, 90))}


def context_span(positions: list[float]) -> dict:
    """``{"start", "end", "mean"}`` of the rounds' mean start positions (tokens)."""
    return {"start": int(min(positions)), "end": int(max(positions)),
            "mean": float(np.mean(positions))}


def plain_decode(eng: Engine, reqs: list[Request], s: Settings, ledger: Ledger,
                 round_program: str | None, warm: str = "warmup",
                 timed: str | None = "timed", fill_reference: bool = True) -> dict:
    """Warm-up calls, calls for ``decode_tokens`` timed steps (``timed=None``: untimed,
    counted under ``warm``), then (``fill_reference``) untimed calls until each request holds
    ``reference_len`` tokens. A call runs the engine's ``rounds_per_call`` steps; times are
    per step."""
    steps = eng.rounds_per_call
    with ledger.phase(warm, round_program):
        eng.scheduler.run_round(reqs)
    with ledger.phase(warm):
        for _ in range(s.warmup_rounds - 1):
            eng.scheduler.run_round(reqs)
    with ledger.phase(timed or warm):
        run = pipelined_rounds(eng, reqs, lambda got: len(got) * steps >= s.decode_tokens)
    with ledger.phase(warm):
        while fill_reference and min(len(r.output_ids) for r in reqs) < s.reference_len:
            eng.scheduler.run_round(reqs)
    tokens = len(run["times"]) * steps
    return {**round_timing(run["times"], run["host"], steps),
            "context": context_span(run["positions"]),
            "tokens_per_s_e2e": tokens * len(reqs) / run["wall"], "wall_s": run["wall"],
            "steps_per_call": steps}


def drafted_rounds(eng: Engine, reqs: list[Request], s: Settings, ledger: Ledger,
                   round_program: str) -> dict:
    """k > 0 with the engine's ``rounds_per_call`` rounds per call (above 1, or a sampled row),
    the drafts as the MTP head drafted them (a multi-round call runs its rounds without the
    host, so nothing can be forced between them; a sampled acceptance cannot be forced):
    warm-up calls (``warmup_rounds`` rounds, at least one call), then calls until each request
    committed ``decode_tokens`` tokens. Times are per round; the round
    time does not depend on acceptance (fixed shapes), the measured accept length does (low
    with random weights). Leaves the requests' outputs in place."""
    steps = eng.rounds_per_call
    with ledger.phase("warmup", round_program):
        eng.scheduler.run_round(reqs)
    with ledger.phase("warmup"):
        for _ in range(-(-s.warmup_rounds // steps) - 1):
            eng.scheduler.run_round(reqs)
    tally = [0] * len(reqs)

    def counted(results: list[dict]) -> bool:
        for i, r in enumerate(reqs):
            tally[i] += len(results[-1].get(r, ()))
        return min(tally) >= s.decode_tokens

    with ledger.phase("timed"):
        run = pipelined_rounds(eng, reqs, counted)
    rounds = len(run["times"]) * steps
    return {**round_timing(run["times"], run["host"], steps),
            "context": context_span(run["positions"]),
            "accept_length_measured": sum(tally) / (rounds * len(reqs)),
            "tokens_per_s_e2e": sum(tally) / run["wall"], "wall_s": run["wall"],
            "steps_per_call": steps}


def pipelined_rounds(eng: Engine, reqs: list[Request], done: Callable[[list[dict]], bool],
                     before_dispatch: Callable[[int], None] | None = None) -> dict:
    """Rounds over ``reqs`` as ``Engine.step`` runs them with ``overlap_schedule``: round i + 1
    is dispatched before round i's result is read. Stops after the round whose result makes
    ``done(results so far)`` true (one dict of new tokens per round; called once after each
    result, inside the timed loop, so it should be cheap), then waits for the round
    dispatched ahead (applied, not counted). ``before_dispatch(i)`` runs before round i >= 1
    is dispatched (device work chained between rounds).

    Returns ``{"times": seconds between consecutive results (the first from the start),
    "host": the host's seconds of each of those intervals (``before_dispatch``, the dispatch
    and the collect, without the wait for the round's result), "positions": each counted
    round's mean start position, "results", "wall": seconds from the start to the last
    counted result}``. A round whose host time is close to its time is bound by the host."""
    times, host, positions, results = [], [], [], []
    t_start = t_last = time.perf_counter()
    prev = eng.scheduler.dispatch(reqs)
    while True:
        t0 = time.perf_counter()
        if before_dispatch is not None:
            before_dispatch(len(results) + 1)
        cur = eng.scheduler.dispatch(reqs, chained=True)
        positions.append(float(np.mean([r.position for r in reqs])))  # where prev started
        t1 = time.perf_counter()
        jax.block_until_ready(prev.out.readback)  # the device's part, not the host's
        t2 = time.perf_counter()
        results.append(eng.scheduler.collect(prev, later=cur))
        now = time.perf_counter()
        times.append(now - t_last)
        host.append((t1 - t0) + (now - t2))
        t_last, prev = now, cur
        if done(results):
            break
    eng.scheduler.collect(prev)
    return {"times": times, "host": host, "positions": positions, "results": results,
            "wall": t_last - t_start}
