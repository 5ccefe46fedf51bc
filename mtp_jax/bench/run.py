"""One benchmark row: a (model, batch, k) engine driven step by step.

Phases, with XLA compilations counted in each (:mod:`mtp_jax.bench.compiles`):

* ``engine_setup``: the engine and its pools;
* ``engine_warmup`` (``Settings.engine_warmup`` only): ``Engine.warmup()``, every prefill and
  batch bucket of the engine compiled as a server start-up does (the programs' first calls
  below then find them compiled);
* ``warmup``: every request's prefill (the first one times the prefill program's first call),
  the prefill-throughput calls, the warm-up rounds (the first one times the round program's
  first call) and, for k > 0, the first forced-draft call;
* ``timed``: the decode (must compile nothing);
* ``reference``: the plain-decoding reference of a k > 0 row when k = 0 was not benchmarked.

k = 0: ``decode_tokens`` timed decode steps. k > 0: first the round program's own greedy
continuation (:func:`rejected_drafts_reference`: every draft wrong, untimed), compared with
plain decoding; then for each forced accept length, a fresh prefill of the same prompts and
forced rounds (:mod:`mtp_jax.bench.forced`) against that continuation, until every request
has committed ``decode_tokens`` tokens in the timed phase. Timed rounds run as the engine runs
them with ``overlap_schedule`` (:func:`pipelined_rounds`): round i + 1 is dispatched before
round i's result is read, and a round's time is the interval between two results. The forced
drafts of round i + 1 are written on the device between the two dispatches
(:func:`~mtp_jax.bench.forced.force_on_device`); its device time is inside the round times
(a few microseconds) and its host dispatch time is reported apart (``overwrite_ms``). A k > 0
row with several rounds per call (:func:`drafted_rounds`) keeps the MTP drafts as drafted.

Sampled rows (``Settings.temperature`` > 0, with ``top_p`` / ``top_k``): every request samples
(seeded), so the programs' sampling variant runs (filtering, draws, and for k > 0 rejection
sampling of the drafts). k = 0 times decode steps as above; k > 0 takes the drafts as drafted
(:func:`drafted_rounds`, at any rounds per call: nothing can be forced into a sampled
acceptance). No exactness is checked on them (a sample has no single right continuation; the
sampling tests check the distributions); the round time does not depend on acceptance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import statistics
import time

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench.compiles import CompileWatch
from mtp_jax.bench.floor import round_bytes
from mtp_jax.bench.forced import (accept_fraction, commits_of_round, compare_to_reference,
                                  force_on_device)
from mtp_jax.cache.allocator import pages_needed
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.rounds import next_pow2
from mtp_jax.engine.requests import Request
from mtp_jax.engine.warmup import batch_buckets, prefill_buckets
from mtp_jax.sampling import SamplingParams, is_greedy


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every row shares. ``max_k``: the largest k of the run (all engines of a batch get
    the same page-table width, so k = 0 and k > 0 compute over identical tables)."""

    prompt_len: int = 1024
    decode_tokens: int = 1024
    warmup_rounds: int = 3
    page_size: int = 16
    hbm_tbps: float = 4.2
    accept_lengths: tuple[float, ...] = (2.5, 3.0, 3.5)
    prefill_reps: int = 3
    max_k: int = 3
    engine_warmup: bool = False
    draft_vocab_size: int | None = None  # k > 0 rows: the MTP draft scores the N lowest ids
    draft_head_dtype: str | None = None  # k > 0 rows: "int8": the draft's LM head in int8
    draft_layer_dtype: str | None = None  # k > 0 rows: "int8": the draft's projections in int8
    # Rounds per program call (EngineConfig.num_scheduler_steps), one row per value. k > 0:
    # the forced-draft row always runs one round per call (its drafts are written on the
    # device between rounds); each value above 1 adds a row with the drafts as drafted.
    num_scheduler_steps: tuple[int, ...] = (1,)
    # Sampled rows when temperature > 0 (every request samples with these, seeded); 0: greedy
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def sampled(self) -> bool:
        return not is_greedy(self.temperature)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The requests' parameters: greedy, or sampled with this temperature, top_p, top_k
        (``ignore_eos``: every request decodes ``max_tokens``)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_tokens=max_tokens, ignore_eos=True)

    def validate(self) -> None:
        for name in ("prompt_len", "decode_tokens", "warmup_rounds", "prefill_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be "
                                 ">= 1.")
        if not 0 <= self.max_k <= 8:
            raise ValueError(f"--k {self.max_k} must be in 0..8.")
        if not self.num_scheduler_steps:
            raise ValueError("--num-scheduler-steps needs at least one value.")
        for n in self.num_scheduler_steps:
            EngineConfig(num_scheduler_steps=n).validate()
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size {self.draft_vocab_size} must be >= 1 (hot "
                             "token ids of the draft's LM head), or omitted for the full "
                             "vocabulary.")
        SpeculativeConfig(draft_head_dtype=self.draft_head_dtype,
                          draft_layer_dtype=self.draft_layer_dtype).validate()
        try:
            self.sampling_params(1).validate()
        except ValueError as e:  # "top_p 0.0 must be ..." -> "--top-p 0.0 must be ..."
            field, _, rest = str(e).partition(" ")
            if field in ("temperature", "top_p", "top_k"):
                raise ValueError(f"--{field.replace('_', '-')} {rest}") from None
            raise

    @property
    def reference_len(self) -> int:
        """Plain-decoding tokens a forced run may need: the prefill's token, warm-up rounds
        of up to max_k + 1 tokens, the timed tokens, the last round's overshoot, the round
        dispatched ahead (overlap) and the drafts of the last round run, plus one round of
        slack for rows of a batch that end the timed phase a round after the others."""
        k = self.max_k
        return 1 + self.warmup_rounds * (k + 1) + self.decode_tokens + 3 * (k + 1) + k

    @property
    def max_model_len(self) -> int:
        """Room for the reference plus slack, minus 2 max_k + 1 so that every k gets the same
        page-table width (``pages_needed(max_model_len + 2k + 1)`` for k <= max_k)."""
        k, ps = self.max_k, self.page_size
        slack = 4 * k + 8 + 8 * max(self.num_scheduler_steps)  # multi-round overshoot
        pages = pages_needed(self.prompt_len + self.reference_len + slack, ps)
        return pages * ps - (2 * k + 1)


def requests(batch: int, prompt_len: int, max_tokens: int, vocab: int, start: int,
             params: SamplingParams | None = None):
    """``batch`` requests with random prompts, deterministic in ``start`` (the first request's
    index): greedy (``ignore_eos``) unless ``params`` is given; request i's seed is
    ``start + i``."""
    rng = np.random.default_rng(start)
    if params is None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(request_id=str(start + i), index=start + i, prompt=None,
                    prompt_ids=rng.integers(10, vocab - 10, prompt_len).tolist(), params=params,
                    seed=start + i) for i in range(batch)]


class Ledger:
    """Compile counts per phase and the first call of each program."""

    def __init__(self):
        self.phases: dict[str, CompileWatch] = {}
        self.programs: list[dict] = []

    @contextlib.contextmanager
    def phase(self, name: str, program: str | None = None):
        with CompileWatch() as w:
            yield w
        self.phases.setdefault(name, CompileWatch()).add(w)
        if program is not None:
            self.programs.append({"program": program, "first_call_s": w.seconds,
                                  "compiles": w.compiles, "cache_hits": w.cache_hits,
                                  "compile_s": w.compile_s})

    def compiles(self, name: str) -> int:
        return self.phases[name].compiles if name in self.phases else 0


def make_engine(model, batch: int, k: int, s: Settings, steps: int = 1) -> Engine:
    """An engine for ``batch`` requests plus one slot for the prefill-throughput prompt, with
    ``steps`` rounds per call (k > 0: with the reduced draft vocabulary of
    ``s.draft_vocab_size`` and the draft head and layer dtypes ``s.draft_head_dtype``,
    ``s.draft_layer_dtype``, if set)."""
    speculative = SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3,
                                    draft_vocab_size=s.draft_vocab_size if k else None,
                                    draft_head_dtype=s.draft_head_dtype if k else None,
                                    draft_layer_dtype=s.draft_layer_dtype if k else None)
    return Engine(model, EngineConfig(max_running_requests=batch + 1, page_size=s.page_size,
                                      max_model_len=s.max_model_len,
                                      chunked_prefill_size=s.prompt_len,
                                      enable_prefix_cache=False, dtype=model.dtype,
                                      num_scheduler_steps=steps),
                  speculative)


def _bucket_names(eng: Engine, batch: int, k: int, s: Settings) -> tuple[str, str]:
    t = max(16, next_pow2(s.prompt_len))
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


def _timing(times: list[float], host: list[float], rounds: int = 1) -> dict:
    """Median and p10 / p90 of the rounds' times and of their host times (seconds in, per
    call of ``rounds`` rounds; reported per round)."""
    ms, host_ms = np.asarray(times) * 1e3 / rounds, np.asarray(host) * 1e3 / rounds
    return {"round_ms": float(np.median(ms)), "round_ms_p10": float(np.percentile(ms, 10)),
            "round_ms_p90": float(np.percentile(ms, 90)), "rounds_timed": len(times) * rounds,
            "calls_timed": len(times),
            "host_ms": float(np.median(host_ms)), "host_ms_p10": float(np.percentile(host_ms, 10)),
            "host_ms_p90": float(np.percentile(host_ms, 90))}


def _context(positions: list[float]) -> dict:
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
    return {**_timing(run["times"], run["host"], steps), "context": _context(run["positions"]),
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
    return {**_timing(run["times"], run["host"], steps), "context": _context(run["positions"]),
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


def _drafts_writer(eng: Engine, reqs: list[Request], reference) -> Callable[[int], float]:
    """``force_m(m)``: writes the next round's drafts of ``reqs`` on the device, the first
    ``m`` right by ``reference`` and the rest wrong (:func:`force_on_device`); returns the
    host seconds of the dispatch."""
    slots = jnp.asarray([r.slot for r in reqs], jnp.int32)
    ref = jnp.asarray(np.asarray([list(x) for x in reference], np.int32))
    vocab = jnp.int32(eng.model.cfg.vocab_size)

    def force_m(m: int) -> float:
        t0 = time.perf_counter()
        nt = force_on_device(eng.pools.next_tokens, eng.pools.step, slots, ref, jnp.int32(m),
                             vocab)
        eng.device.pools = dataclasses.replace(eng.pools, next_tokens=nt)
        return time.perf_counter() - t0

    return force_m


def _prefill_and_force(eng: Engine, reqs: list[Request], reference, k: int, m: int,
                       ledger: Ledger, programs: tuple[str, str] | None) -> Callable[[int], float]:
    """Prefill ``reqs`` and write their first round's drafts (``m`` right); returns the
    :func:`_drafts_writer` for the rounds after. ``programs``: as
    :func:`rejected_drafts_reference` (the prefill's and the overwrite's first calls are
    recorded when given)."""
    prefill_all(eng, reqs, ledger, "warmup", programs[0] if programs else None)
    force_m = _drafts_writer(eng, reqs, reference)
    with ledger.phase("warmup", f"force_on_device[B={len(reqs)},k={k}]" if programs else None):
        force_m(m)
        jax.block_until_ready(eng.pools.next_tokens)
    return force_m


def rejected_drafts_reference(eng: Engine, reqs: list[Request], reference, k: int,
                              s: Settings, ledger: Ledger,
                              programs: tuple[str, str] | None) -> list[list[int]]:
    """The round program's own greedy continuation: prefill ``reqs``, then rounds whose drafts
    are all wrong by ``reference`` (the plain-decoding continuation), so that each commits one
    token, the target's choice at verify row 0, until every request holds ``reference_len``
    tokens (untimed, under ``warmup``). ``programs``: names of the prefill and round programs
    when this is their first call (recorded with their compile counts), else ``None``.

    With an exact engine this equals ``reference`` in float32. In 16-bit dtypes the verify's
    (k+1)-row matmuls may round a near-tie of a random-weight model differently from the
    decode step's one row, and the two continuations part there. The forced runs compare
    against this continuation, computed by the same round program whatever the accept length,
    so that such a near-tie neither hides a real mismatch nor ends their accept lengths; the
    comparison with plain decoding is reported apart (``decode_match``)."""
    force_m = _prefill_and_force(eng, reqs, reference, k, 0, ledger, programs)
    first = True
    while min(len(r.output_ids) for r in reqs) < s.reference_len:
        with ledger.phase("warmup", programs[1] if programs and first else None):
            eng.scheduler.run_round(reqs)
        with ledger.phase("warmup"):
            force_m(0)
        first = False
    out = [list(r.output_ids[:s.reference_len]) for r in reqs]
    release_all(eng, reqs)
    return out


def forced_decode(eng: Engine, reqs: list[Request], reference, accept_length: float, k: int,
                  s: Settings, ledger: Ledger) -> dict:
    """Prefill ``reqs``, then forced rounds at ``accept_length``: ``warmup_rounds`` untimed,
    then timed until each request committed ``decode_tokens`` tokens (the programs' first
    calls are :func:`rejected_drafts_reference`'s)."""
    a = accept_fraction(accept_length, k)
    force_m = _prefill_and_force(eng, reqs, reference, k, commits_of_round(a, 0) - 1, ledger,
                                 None)
    force_s: list[float] = []
    for i in range(s.warmup_rounds):
        with ledger.phase("warmup"):
            eng.scheduler.run_round(reqs)
        with ledger.phase("warmup"):
            # the alternation restarts with the timed phase: its R rounds commit floor(a R)
            force_m(commits_of_round(a, i + 1 if i + 1 < s.warmup_rounds else 0) - 1)

    def force(i: int) -> None:  # drafts of timed round i, after round i - 1 (both in flight)
        force_s.append(force_m(commits_of_round(a, i) - 1))

    tally = [0] * len(reqs)  # tokens each request committed so far (kept incrementally: the
    # check runs inside the timed loop)

    def counted(results: list[dict]) -> bool:
        for i, r in enumerate(reqs):
            tally[i] += len(results[-1].get(r, ()))
        return min(tally) >= s.decode_tokens

    with ledger.phase("timed"):
        run = pipelined_rounds(eng, reqs, counted, force)
    times, host, positions, wall = run["times"], run["host"], run["positions"], run["wall"]
    commits = [float(np.mean([len(new.get(r, ())) for r in reqs])) for new in run["results"]]
    done = [sum(len(new.get(r, ())) for new in run["results"]) for r in reqs]
    timing = _timing(times, host)
    measured = float(np.mean(commits))
    check = compare_to_reference([r.output_ids for r in reqs], reference)
    release_all(eng, reqs)
    return {"accept_length": accept_length, "accept_length_measured": measured, **timing,
            "_times": times, "_host": host, "context": _context(positions),
            "overwrite_ms": float(np.median(force_s) * 1e3) if force_s else 0.0,
            "tokens_per_s_e2e": sum(done) / wall, "wall_s": wall,
            "tokens_per_s_derived": measured * len(reqs) / (timing["round_ms"] / 1e3),
            **check}


def plain_reference(model, batch: int, s: Settings, ledger: Ledger) -> list[list[int]]:
    """Plain-decoding (k = 0) continuations of the benchmark prompts, ``reference_len``
    tokens each (untimed; compiles counted under ``reference``)."""
    with ledger.phase("reference"):
        eng = make_engine(model, batch, 0, s)
    reqs = requests(batch, s.prompt_len, 10**9, model.cfg.vocab_size, 0)
    prefill_all(eng, reqs, ledger, "reference", None)
    plain_decode(eng, reqs, s, ledger, None, warm="reference", timed=None)
    out = [list(r.output_ids[:s.reference_len]) for r in reqs]
    release_all(eng, reqs)
    del eng
    gc.collect()
    return out


def bench_one(model, batch: int, k: int, s: Settings, refs: dict,
              steps: int = 1) -> dict:
    """Benchmark one (batch, k) with ``steps`` rounds per program call; returns the result.

    ``refs``: the continuations of this batch's prompts shared by its rows, filled in here:
    ``"plain"`` (plain decoding: from the k = 0 row, or decoded first for a k > 0 row) and,
    for each k > 0 with a forced row (one round per call), ``k``: the round program's own
    greedy continuation (:func:`rejected_drafts_reference`). A k > 0 row with ``steps`` > 1
    (:func:`drafted_rounds`) is compared with both (with the second when its forced row ran
    first, as the CLI orders them).
    """
    cfg = model.cfg
    ledger = Ledger()
    if k and not s.sampled and "plain" not in refs:
        refs["plain"] = plain_reference(model, batch, s, ledger)
    with ledger.phase("engine_setup"):
        eng = make_engine(model, batch, k, s, steps)
    names = _bucket_names(eng, batch, k, s)
    res: dict = {"batch": batch, "k": k, "prompt_len": s.prompt_len,
                 "decode_tokens": s.decode_tokens, "steps_per_call": steps,
                 "draft_vocab_size": s.draft_vocab_size if k else None,
                 "draft_head_dtype": s.draft_head_dtype if k else None,
                 "draft_layer_dtype": s.draft_layer_dtype if k else None,
                 "sampling": ({"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k}
                              if s.sampled else None)}
    if s.engine_warmup:
        with ledger.phase("engine_warmup") as w:
            eng.warmup()
        buckets = {"prefill": prefill_buckets(eng.scheduler.settings.chunk_size,
                                              eng.max_model_len),
                   "batch": batch_buckets(eng.book.max_requests)}
        res["engine_warmup"] = {"buckets": buckets, **w.as_dict()}
    reqs = requests(batch, s.prompt_len, 10**9, cfg.vocab_size, 0,
                    s.sampling_params(10**9) if s.sampled else None)
    if s.sampled:
        prefill_all(eng, reqs, ledger, "warmup", names[0])
        with ledger.phase("warmup"):
            prefill_s = measure_prefill(eng, s, cfg.vocab_size)
        row = _sampled_row(eng, reqs, k, s, ledger, names)
        release_all(eng, reqs)
    elif k and steps == 1:
        row, prefill_s = _forced_row(eng, reqs, k, s, refs, ledger, names)
    else:
        prefill_all(eng, reqs, ledger, "warmup", names[0])
        with ledger.phase("warmup"):
            prefill_s = measure_prefill(eng, s, cfg.vocab_size)
        row = (_plain_row if k == 0 else _drafted_row)(eng, reqs, k, s, refs, ledger, names)
        release_all(eng, reqs)
    res.update(row)
    res["prefill_s"] = prefill_s
    res["prefill_tokens_per_s"] = s.prompt_len / prefill_s
    itemsize = 2 if model.dtype != "float32" else 4
    by = round_bytes(cfg, batch, k, round(res["context"]["mean"]), itemsize,
                     draft_vocab_size=res["draft_vocab_size"],
                     draft_head_dtype=res["draft_head_dtype"],
                     draft_layer_dtype=res["draft_layer_dtype"])
    floor = by["total"] / (s.hbm_tbps * 1e12)
    res["bytes"] = {name: float(v) for name, v in by.items()}
    res["floor_ms"] = floor * 1e3
    res["fraction_of_floor"] = floor / (res["round_ms"] / 1e3)
    res["programs"] = ledger.programs
    res["compiles"] = {name: w.as_dict() for name, w in ledger.phases.items()}
    res["compiles_timed"] = ledger.compiles("timed")
    res["compiles_warmup"] = ledger.compiles("warmup")
    res["startup_s"] = float(sum(p["first_call_s"] for p in ledger.programs))
    built = sum(p["compiles"] for p in ledger.programs)
    hits = sum(p["cache_hits"] for p in ledger.programs)
    res["startup_from_cache"] = ("none" if built == 0 else "cached" if hits == built
                                 else "cold" if hits == 0 else "mixed")
    res["compiled_programs"] = eng.compiled_program_count()
    stats = jax.devices()[0].memory_stats() or {}
    res["peak_device_bytes"] = stats.get("peak_bytes_in_use")
    del eng
    gc.collect()
    return res


def _plain_row(eng, reqs, k, s, refs, ledger, names) -> dict:
    """k = 0 (``reqs`` prefilled): :func:`plain_decode`; its continuation becomes the batch's
    plain reference unless one is there."""
    run = plain_decode(eng, reqs, s, ledger, names[1])
    refs.setdefault("plain", [list(r.output_ids[:s.reference_len]) for r in reqs])
    # exact None: plain decoding is the reference itself
    return {**run, "tokens_per_s": len(reqs) / (run["round_ms"] / 1e3), "exact": None}


def _derived(run: dict, batch: int, k: int, accept_lengths) -> dict[str, float]:
    """Tokens/s at each accept length a k-draft round can commit (1 to k + 1): accept length
    x batch / the median round time (which does not depend on acceptance)."""
    return {str(al): al * batch / (run["round_ms"] / 1e3) for al in accept_lengths
            if 1 <= al <= k + 1}


def _sampled_row(eng, reqs, k, s, ledger, names) -> dict:
    """A sampled row (``reqs`` prefilled): k = 0, :func:`plain_decode`; k > 0,
    :func:`drafted_rounds` (the measured accept length is the random model's) and the derived
    tokens/s at the accept lengths a round can commit. ``exact`` is None (not checked)."""
    if not k:
        run = plain_decode(eng, reqs, s, ledger, names[1], fill_reference=False)
        return {**run, "tokens_per_s": len(reqs) / (run["round_ms"] / 1e3), "exact": None}
    run = drafted_rounds(eng, reqs, s, ledger, names[1])
    return {**run, "exact": None,
            "tokens_per_s_at_accept_length": _derived(run, len(reqs), k, s.accept_lengths)}


def _drafted_row(eng, reqs, k, s, refs, ledger, names) -> dict:
    """k > 0 with several rounds per call (``reqs`` prefilled): :func:`drafted_rounds`, the
    derived tokens/s at the accept lengths a round can commit, and the committed tokens
    against plain decoding (``decode_match``) and the forced row's continuation
    (``rounds_match``, when that row ran)."""
    run = drafted_rounds(eng, reqs, s, ledger, names[1])
    row = {**run,
           "tokens_per_s_at_accept_length": _derived(run, len(reqs), k, s.accept_lengths)}
    outputs = [list(r.output_ids) for r in reqs]
    row["decode_match"] = compare_to_reference(_cut(outputs, refs["plain"]), refs["plain"])
    if k in refs:
        row["rounds_match"] = compare_to_reference(_cut(outputs, refs[k]), refs[k])
        row["rounds_exact"] = row["rounds_match"]["exact"]
    row["exact"] = row.get("rounds_exact", True) and row["decode_match"]["exact"]
    return row


def _forced_row(eng, reqs, k, s, refs, ledger, names) -> tuple[dict, float]:
    """k > 0, one round per call: the rounds' own continuation
    (:func:`rejected_drafts_reference`, stored as ``refs[k]``), then :func:`forced_decode` at
    each accept length that k can force. Returns ``(row, prefill seconds)``."""
    vocab = eng.model.cfg.vocab_size
    rounds_ref = rejected_drafts_reference(eng, reqs, refs["plain"], k, s, ledger, names)
    refs[k] = rounds_ref
    forced, skipped, prefill_s = [], [], None
    for al in s.accept_lengths:
        try:
            accept_fraction(al, k)
        except ValueError as e:
            skipped.append({"accept_length": al, "reason": str(e)})
            continue
        reqs = requests(len(reqs), s.prompt_len, 10**9, vocab, 0)
        forced.append(forced_decode(eng, reqs, rounds_ref, al, k, s, ledger))
        if prefill_s is None:
            with ledger.phase("warmup"):
                prefill_s = measure_prefill(eng, s, vocab)
    if not forced:
        raise ValueError(f"no accept length of {list(s.accept_lengths)} can be forced with "
                         f"k={k} (each must be in [1, {k + 1}]).")
    pooled = [t for f in forced for t in f.pop("_times")]
    row = _timing(pooled, [t for f in forced for t in f.pop("_host")])
    row["context"] = {"start": min(f["context"]["start"] for f in forced),
                      "end": max(f["context"]["end"] for f in forced),
                      "mean": float(np.mean([f["context"]["mean"] for f in forced]))}
    row["tokens_per_s_at_accept_length"] = {
        str(f["accept_length"]): f["accept_length"] * len(reqs) / (row["round_ms"] / 1e3)
        for f in forced}
    row["forced"] = forced
    row["skipped_accept_lengths"] = skipped
    row["rounds_exact"] = all(f["exact"] for f in forced)
    row["decode_match"] = compare_to_reference(rounds_ref, refs["plain"])
    row["exact"] = row["rounds_exact"] and row["decode_match"]["exact"]
    return row, prefill_s


def _cut(outputs: list[list[int]], reference: list[list[int]]) -> list[list[int]]:
    """Each output cut to its reference's length (a drafted row may run past it)."""
    return [out[:len(ref)] for out, ref in zip(outputs, reference)]
