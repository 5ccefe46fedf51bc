"""The one timing helper of the bench's subcommands: the wall-clock median of jitted calls, and
device time read from ``jax.profiler`` traces.

* :func:`wall_seconds`: untimed warm-up calls first (the first one compiles), then ``reps``
  repeats of ``calls`` back-to-back calls, each repeat ended by ``jax.block_until_ready`` on
  the last call's output; a repeat's time over ``calls`` is one call; the median over repeats.
  With ``calls`` above 1 the host's dispatch overlaps the device's work (launch costs hidden);
  with 1 every call is waited for (its dispatch counted).
* :func:`device_seconds`: the GPU kernels' durations in a ``jax.profiler`` trace of ``calls``
  back-to-back calls, summed, over ``calls``: device time only, no dispatch or gaps. Needs a
  GPU (a CPU trace holds no GPU kernel line).
* :func:`load_trace` / :func:`kernel_lines` / :func:`kernel_durations`: the newest trace under
  a folder, its GPU kernel lines and durations by kernel name (``python -m mtp_jax.bench
  profile`` reads more of it).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable

import jax


def wall_seconds(call: Callable[[], Any], *, reps: int = 5, calls: int = 1,
                 warmup: int = 1) -> float:
    """Median wall seconds of one ``call()`` (a zero-argument function dispatching jitted
    work and returning its output): ``warmup`` untimed calls (waited for), then ``reps``
    repeats of ``calls`` back-to-back calls, each repeat waited for once at its end
    (``jax.block_until_ready``). Raises ``ValueError`` for ``reps``, ``calls`` below 1 or
    ``warmup`` below 0."""
    if reps < 1 or calls < 1 or warmup < 0:
        raise ValueError(f"wall_seconds: reps {reps} and calls {calls} must be >= 1, warmup "
                         f"{warmup} >= 0.")
    for _ in range(warmup):
        jax.block_until_ready(call())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = call()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


@dataclasses.dataclass
class Trace:
    """A ``jax.profiler`` trace: its complete events (``ph == "X"``, with ``dur`` in us), and
    the names of its processes (``pid -> name``) and threads (``(pid, tid) -> name``)."""

    events: list[dict]
    procs: dict
    threads: dict


def load_trace(trace_dir: str) -> Trace:
    """The newest ``*.trace.json.gz`` under ``trace_dir`` (a ``jax.profiler.trace`` folder).
    Raises ``FileNotFoundError`` naming the folder when it holds none."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no "
                                "trace (was jax.profiler.trace used on this folder?).")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        events = json.load(f)["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return Trace([e for e in events if e.get("ph") == "X" and "dur" in e], procs, threads)


def lines(trace: Trace) -> dict[tuple, list[dict]]:
    """Every line of the trace: ``(pid, tid) -> its complete events``."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for e in trace.events:
        out[(e["pid"], e.get("tid"))].append(e)
    return out


def is_gpu_line(trace: Trace, key: tuple) -> bool:
    """Whether line ``(pid, tid)`` belongs to a GPU process."""
    return "gpu" in str(trace.procs.get(key[0], "")).lower()


def kernel_lines(trace: Trace) -> dict[tuple, list[dict]]:
    """The GPU lines that hold kernels: GPU processes' lines except XLA's annotation lines
    (``XLA Ops``, ``XLA Modules``), whose events span the kernels they launched."""
    return {key: evs for key, evs in lines(trace).items()
            if is_gpu_line(trace, key)
            and "xla" not in str(trace.threads.get(key, "")).lower()}


def kernel_durations(trace: Trace) -> dict[str, list[float]]:
    """``{kernel name: [duration us, ...]}`` over the trace's kernel lines."""
    out: dict[str, list[float]] = defaultdict(list)
    for evs in kernel_lines(trace).values():
        for e in evs:
            out[e["name"]].append(float(e["dur"]))
    return dict(out)


def device_seconds(call: Callable[[], Any], *, calls: int = 8, warmup: int = 1) -> float:
    """Device seconds of one ``call()``: ``warmup`` untimed calls, then a ``jax.profiler``
    trace of ``calls`` back-to-back calls (waited for at the end); the GPU kernels' durations
    summed, over ``calls``. Raises ``RuntimeError`` when the trace holds no GPU kernel (no GPU:
    use :func:`wall_seconds`)."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(calls):
                out = call()
            jax.block_until_ready(out)
        durations = kernel_durations(load_trace(tmp))
    if not durations:
        raise RuntimeError(f"device_seconds: the trace holds no GPU kernel (JAX runs on "
                           f"{jax.default_backend()!r}); device time needs a GPU, time the "
                           "calls with wall_seconds instead.")
    return sum(sum(d) for d in durations.values()) / calls / 1e6
