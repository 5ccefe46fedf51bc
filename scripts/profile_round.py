"""Profile decode steps / speculative rounds of the engine on a random-weight real shape (GPU
machine helper; not part of the test suite).

Usage:
    python scripts/profile_round.py --config configs/Qwen3.5-2B.json --k 0 3 --batch 1 \
        --out /tmp/prof

For each k: an engine, the batch's prompts prefilled, warm-up rounds, ``--rounds`` rounds timed
without the profiler (median wall ms), then the same number traced by ``jax.profiler``. Prints,
per round: the device kernels launched, the device busy time (union of kernel intervals on the
busiest stream), the span from the first kernel's start to the last one's end, the idle time
inside that span, kernel time by category (GEMM, Triton/Pallas, XLA fusions, copies) and the
top kernels by time. The perfetto trace stays under ``--out``.

Under the profiler XLA runs a program op by op unless
``--xla_enable_command_buffers_during_profiling=true`` is set (a flag of recent jaxlibs; an
unknown flag aborts start-up, so it is only added after a child process has accepted it). This
script adds it, so the trace shows the round as the engine runs it (CUDA graphs); ``--op-by-op``
leaves it out. Profiles in ``docs/benchmarks.md`` before 2026-12-01 (session 7) were op by op:
their kernel durations hold, their host ``Execute`` times and gaps do not.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import time
from collections import defaultdict

import jax

from ab_xla_flags import accepted as xla_flag_accepted  # scripts/ (this script's folder)
from mtp_jax.bench.floor import load_config
from mtp_jax.bench.run import requests
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.kernels import OPS, add_backend_flags
from mtp_jax.models.loader import load_model


def category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("gemm", "gemv", "cutlass", "nvjet", "sm90_", "cublas", "splitk")):
        return "gemm"
    if "memcpy" in n or "memset" in n:
        return "copy"
    if any(s in n for s in ("fusion", "loop_", "input_", "reduce", "convert", "transpose",
                            "select", "gather", "scatter", "concatenate", "slice", "copy",
                            "broadcast", "iota", "dynamic")):
        return "xla fusion"
    return "other (triton/pallas)"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


CMD_BUFFERS_WHILE_PROFILING = "--xla_enable_command_buffers_during_profiling=true"


EXECUTABLE_EVENTS = ("Execute", "Thunk", "CommandBuffer", "Graph", "Buffer", "Donat")


def analyse(trace_dir: str, rounds: int, sequence: int = 0) -> str:
    traces = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    path = max(traces, key=os.path.getmtime)  # this run's, when --out held older ones
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    lines: dict[tuple, list] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            lines[(e["pid"], e.get("tid"))].append(e)
    out = ["lines (events/round, ms/round):"]
    for key, evs in sorted(lines.items(), key=lambda kv: -len(kv[1]))[:14]:
        out.append(f"  {procs.get(key[0], key[0])[:28]:28s} {threads.get(key, key[1])!s:32.32s} "
                   f"{len(evs) / rounds:8.1f} {sum(e['dur'] for e in evs) / rounds / 1e3:8.3f}")
    gpu = [k for k in lines if "gpu" in str(procs.get(k[0], "")).lower()
           or "device" in str(procs.get(k[0], "")).lower()]
    # The kernel stream: the device line with the most events whose thread is not an
    # "XLA Ops"/"XLA Modules" annotation line.
    streams = [k for k in gpu if "xla" not in str(threads.get(k, "")).lower()]
    if not streams:
        out.append("no device kernel line found")
        return "\n".join(out)
    host: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for key, evs in lines.items():
        if key not in gpu and threads.get(key, "") != "python":
            for e in evs:
                host[e["name"]][0] += 1
                host[e["name"]][1] += e["dur"]
    out.append("top host events outside python (ms/round, count/round, name):")
    ranked = sorted(host.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in ranked[:15]:
        out.append(f"  {us / rounds / 1e3:7.3f} x{n / rounds:<6.1f} {name[:100]}")
    # The executable's own host work (argument handling, command-buffer update and launch):
    # what a per-buffer or per-node host cost would show in.
    out.append("host events of the executable (ms/round, count/round, name):")
    for name, (n, us) in ranked:
        if any(w in name for w in EXECUTABLE_EVENTS):
            out.append(f"  {us / rounds / 1e3:7.3f} x{n / rounds:<6.1f} {name[:100]}")
    main = max(streams, key=lambda k: len(lines[k]))
    evs = lines[main]
    ivs = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
    busy = _union(ivs)
    span = max(e for _, e in ivs) - min(s for s, _ in ivs)
    out.append(f"kernel stream {procs.get(main[0])} / {threads.get(main)}: "
               f"{len(evs) / rounds:.0f} kernels/round, busy {busy / rounds / 1e3:.3f} ms/round, "
               f"span/round {span / rounds / 1e3:.3f} ms (idle inside span "
               f"{(span - busy) / rounds / 1e3:.3f} ms incl. gaps between rounds)")
    by_cat: dict[str, list] = defaultdict(lambda: [0, 0.0])
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in evs:
        c = by_cat[category(e["name"])]
        c[0] += 1
        c[1] += e["dur"]
        n = by_name[e["name"]]
        n[0] += 1
        n[1] += e["dur"]
    out.append("by category (kernels/round, ms/round, mean us):")
    for name, (n, us) in sorted(by_cat.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {name:24s} {n / rounds:7.1f} {us / rounds / 1e3:8.3f} {us / n:8.1f}")
    if sequence:
        out.append(f"first {sequence} kernels of the trace in order (start us, gap us, dur us, name):")
        ordered = sorted(evs, key=lambda e: e["ts"])
        t0, end = ordered[0]["ts"], ordered[0]["ts"]
        for e in ordered[:sequence]:
            out.append(f"  {e['ts'] - t0:9.1f} {e['ts'] - end:7.1f} {e['dur']:7.1f}  {e['name'][:90]}")
            end = max(end, e["ts"] + e["dur"])
    out.append("top kernels (ms/round, count/round, mean us, name):")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:40]:
        out.append(f"  {us / rounds / 1e3:7.3f} x{n / rounds:<6.1f} {us / n:8.1f}  {name[:110]}")
    return "\n".join(out)


def profile(model, cfg, k: int, batch: int, prompt_len: int, rounds: int, out: str,
            sequence: int = 0) -> str:
    eng = Engine(model, EngineConfig(max_running_requests=batch, max_model_len=prompt_len + 512,
                                     chunked_prefill_size=prompt_len, dtype=model.dtype,
                                     enable_prefix_cache=False),
                 SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3))
    for r in requests(batch, prompt_len, 10**6, cfg.vocab_size, 0):
        eng.add_request(r)
    while eng.waiting or eng.prefilling:
        eng.step()
    for _ in range(5):
        eng._run_round(eng.decoding)
    jax.block_until_ready(eng.pools)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        eng._run_round(eng.decoding)
        times.append(time.perf_counter() - t0)
    trace_dir = os.path.join(out, f"k{k}_b{batch}")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(rounds):
            eng._run_round(eng.decoding)
        jax.block_until_ready(eng.pools)
    head = (f"=== k={k} batch={batch} prompt={prompt_len}: median wall "
            f"{statistics.median(times) * 1e3:.3f} ms/round (untraced) ===")
    return head + "\n" + analyse(trace_dir, rounds, sequence)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--k", type=int, nargs="+", default=[0, 3])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sequence", type=int, default=0,
                   help="also list the first N kernels of the trace in order, with gaps")
    p.add_argument("--out", required=True)
    add_backend_flags(p)
    p.add_argument("--op-by-op", action="store_true",
                   help="profile op by op (XLA's default under a profiler), not with the CUDA "
                        "graphs the engine runs")
    args = p.parse_args()
    # Read by XLA when the backend is created, which nothing above has done yet.
    if not args.op_by_op and xla_flag_accepted(CMD_BUFFERS_WHILE_PROFILING):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                   + CMD_BUFFERS_WHILE_PROFILING).strip()
        print("profiling with command buffers (CUDA graphs)", flush=True)
    else:
        print("profiling op by op", flush=True)
    cfg = load_config(args.config)
    model = load_model(cfg=cfg, dtype=args.dtype, dummy_weight=True, with_mtp=any(args.k),
                       **{f"{op}_backend": getattr(args, f"{op}_backend") for op in OPS})
    report = []
    for k in args.k:
        text = profile(model, cfg, k, args.batch, args.prompt_len, args.rounds, args.out,
                       args.sequence)
        print(text, flush=True)
        report.append(text)
    name = os.path.splitext(os.path.basename(args.config))[0]
    with open(os.path.join(args.out, f"profile_{name}_b{args.batch}.txt"), "w") as f:
        f.write("\n\n".join(report) + "\n")


if __name__ == "__main__":
    main()
