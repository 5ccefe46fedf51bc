"""``python -m mtp_jax.bench profile``: where a decode step's or speculative round's time goes on
the GPU, from a ``jax.profiler`` trace of the engine on random weights of a real shape.

For each ``--k`` (0: decode steps): an engine with ``--num-scheduler-steps`` rounds per program
call (default: the engine's automatic count, 4), ``--batch`` prompts of ``--prompt-len``
tokens prefilled, 5 warm-up calls, ``--rounds`` calls timed without the profiler (the median
wall time of a waited-for call, per round: ``wall_us``), then as many traced. Every figure is
per round (a call's figures divided by its rounds). From the trace, per round: the
device kernels launched, the device busy time (the union of the kernel intervals on the
busiest kernel line; the row's time), the span from the first kernel's start to the last one's
end and the idle time inside it (gaps between rounds included), kernel time by category (GEMM,
Triton / Pallas, XLA fusions, copies), the top kernels, the host events outside Python and
those of the executable (``Execute``, command buffers, ...); ``--sequence N`` also lists the
first N kernels in order with their gaps. Printed as text, kept in the JSON row (``profile``),
and written with the trace under ``--trace-dir``. Bytes: what the round must move
(:func:`mtp_jax.bench.floor.round_bytes`), for the fraction of the HBM floor.

``--phase prefill``: the same figures per prefill call instead, one call over ``--batch``
prompts of ``--prompt-len`` tokens run again and again (k = 0: MTP off; k > 0: with the MTP
draft KV over the prompt rows and k drafts; with ``--prefill-drafts no`` the draft KV
alone), for where speculation's share of a prefill goes; no bytes floor (a prefill is bound
by FLOPs).

Under the profiler XLA runs a program op by op unless
``--xla_enable_command_buffers_during_profiling=true`` is set (a flag of recent jaxlibs; an
unknown flag aborts start-up, so it is added only after a child process accepted it): the
trace then shows the round as the engine runs it (CUDA graphs); ``--op-by-op`` leaves it out.
Needs a CUDA GPU (it is refused elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import jax

from mtp_jax.bench.floor import round_bytes
from mtp_jax.bench.phases import Ledger, prefill_all
from mtp_jax.bench.report import op_row, shape_name
from mtp_jax.bench.settings import requests
from mtp_jax.bench.subcommand import Results, config_of, parser, positive, require_gpu, run
from mtp_jax.bench.timing import Trace, is_gpu_line, kernel_lines, lines, load_trace
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.prefill_batch import ChunkRow, prefill_batch, prefill_bucket
from mtp_jax.engine.rounds import AUTO_SCHEDULER_STEPS, next_pow2
from mtp_jax.kernels import OPS, add_backend_flags
from mtp_jax.models.loader import load_model

SUMMARY = "a jax.profiler trace of the engine's rounds on the GPU: kernels, busy and idle time"
CMD_BUFFERS_WHILE_PROFILING = "--xla_enable_command_buffers_during_profiling=true"
EXECUTABLE_EVENTS = ("Execute", "Thunk", "CommandBuffer", "Graph", "Buffer", "Donat")


def build_parser() -> argparse.ArgumentParser:
    """The ``profile`` flags."""
    p = parser("profile", __doc__)
    p.add_argument("--config", required=True, help="a model config JSON (e.g. configs/*.json)")
    p.add_argument("--k", type=int, nargs="+", default=[0, 3],
                   help="drafts per round; 0 = decode steps (--phase prefill: 0 = MTP off, "
                        "k > 0 = the prefill that drafts k; default 0 3)")
    p.add_argument("--phase", choices=["round", "prefill"], default="round",
                   help="round: decode steps and rounds (the default); prefill: one prefill "
                        "call over --batch prompts of --prompt-len tokens, with k > 0 its MTP "
                        "draft KV and drafts (figures per call; --num-scheduler-steps and "
                        "--hbm-tbps unused)")
    p.add_argument("--prefill-drafts", choices=["yes", "no"], default="yes",
                   help="--phase prefill with k > 0: yes (default) times the prefill that "
                        "drafts k, no the one that writes only the draft KV (what adaptive "
                        "speculation runs where no round would verify its drafts)")
    p.add_argument("--batch", type=positive(int), default=1,
                   help="requests (--phase prefill: prompts in the call); default 1")
    p.add_argument("--prompt-len", type=positive(int), default=1024, help="default 1024")
    p.add_argument("--rounds", type=positive(int), default=20,
                   help="program calls timed, then traced (default 20)")
    p.add_argument("--num-scheduler-steps", type=positive(int), default=AUTO_SCHEDULER_STEPS,
                   help="rounds per program call (default %(default)s, the engine's automatic "
                        "count; every figure is per round)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sequence", type=int, default=0,
                   help="also list the first N kernels of the trace in order, with gaps")
    p.add_argument("--trace-dir", default="profile-traces",
                   help="where the perfetto traces and the text report go (default "
                        "%(default)s)")
    add_backend_flags(p)
    p.add_argument("--op-by-op", action="store_true",
                   help="profile op by op (XLA's default under a profiler), not with the CUDA "
                        "graphs the engine runs")
    return p


def category(name: str) -> str:
    """A kernel's category by its name: gemm, copy, xla fusion or other (triton/pallas)."""
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


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _tally(events) -> dict[str, list]:
    """``name -> [count, total us]``."""
    out: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in events:
        out[e["name"]][0] += 1
        out[e["name"]][1] += e["dur"]
    return out


def analyse(trace: Trace, rounds: int, sequence: int = 0) -> dict:
    """Per-round figures of a trace of ``rounds`` rounds (times in us): ``kernels``, ``busy_us``,
    ``span_us``, ``idle_us`` of the busiest kernel line, ``by_category`` and ``top_kernels``
    (``[name, count, us]`` per round), ``host_top`` and ``executable`` (host events outside
    Python), ``sequence`` (the first kernels: ``[start, gap, dur, name]``). Raises
    ``ValueError`` when the trace holds no GPU kernel line."""
    kern = kernel_lines(trace)
    if not kern:
        raise ValueError("the trace holds no GPU kernel line (was it taken on a GPU?).")
    main = max(kern, key=lambda key: len(kern[key]))
    evs = kern[main]
    ivs = [(e["ts"], e["ts"] + e["dur"]) for e in evs]
    busy, span = union_us(ivs), max(e for _, e in ivs) - min(s for s, _ in ivs)
    host = _tally(e for key, es in lines(trace).items()
                  if not is_gpu_line(trace, key) and trace.threads.get(key, "") != "python"
                  for e in es)
    ranked = sorted(host.items(), key=lambda kv: -kv[1][1])
    per = lambda items: [[n, c / rounds, us / rounds] for n, (c, us) in items]
    ordered = sorted(evs, key=lambda e: e["ts"])
    seq, end = [], ordered[0]["ts"]
    for e in ordered[:sequence]:
        seq.append([e["ts"] - ordered[0]["ts"], e["ts"] - end, e["dur"], e["name"]])
        end = max(end, e["ts"] + e["dur"])
    by_cat = _tally({"name": category(e["name"]), "dur": e["dur"]} for e in evs)
    return {"line": f"{trace.procs.get(main[0])} / {trace.threads.get(main)}",
            "kernels": len(evs) / rounds, "busy_us": busy / rounds, "span_us": span / rounds,
            "idle_us": (span - busy) / rounds,
            "by_category": per(sorted(by_cat.items(), key=lambda kv: -kv[1][1])),
            "top_kernels": per(sorted(_tally(evs).items(), key=lambda kv: -kv[1][1])[:40]),
            "host_top": per(ranked[:15]),
            "executable": per([kv for kv in ranked if any(w in kv[0] for w in EXECUTABLE_EVENTS)]),
            "sequence": seq}


def text_of(head: str, s: dict) -> str:
    """:func:`analyse`'s figures as the text report."""
    out = [head, f"kernel line {s['line']}: {s['kernels']:.0f} kernels/round, busy "
                 f"{s['busy_us'] / 1e3:.3f} ms/round, span {s['span_us'] / 1e3:.3f} ms "
                 f"(idle inside the span {s['idle_us'] / 1e3:.3f} ms, gaps between rounds "
                 "included)"]
    for title, rows in (("by category", s["by_category"]), ("top kernels", s["top_kernels"]),
                        ("top host events outside python", s["host_top"]),
                        ("host events of the executable", s["executable"])):
        out.append(f"{title} (ms/round, count/round, name):")
        out += [f"  {us / 1e3:7.3f} x{c:<6.1f} {name[:100]}" for name, c, us in rows]
    if s["sequence"]:
        out.append("first kernels in order (start us, gap us, dur us, name):")
        out += [f"  {t:9.1f} {g:7.1f} {d:7.1f}  {n[:90]}" for t, g, d, n in s["sequence"]]
    return "\n".join(out)


def flag_accepted(extra: str) -> bool:
    """Whether a process with ``extra`` added to ``XLA_FLAGS`` can create its backend."""
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + extra).strip())
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, timeout=300, check=False)
    return done.returncode == 0


def measure(call, sync, calls: int, per_call: int, trace_dir: str,
            sequence: int = 0) -> tuple[float, dict]:
    """``(median untraced wall seconds, analysis)`` of ``calls`` waited-for ``call()``s, then
    as many traced into ``trace_dir``; each call holds ``per_call`` rounds, and both figures
    are per round. ``sync()`` waits for the device."""
    for _ in range(5):
        call()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        sync()
        times.append((time.perf_counter() - t0) / per_call)
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(calls):
            call()
        sync()
    return statistics.median(times), analyse(load_trace(trace_dir), calls * per_call, sequence)


def profile_prefill(a, model, cfg, k: int) -> tuple[float, dict, str]:
    """``(untraced wall seconds per call, per-call analysis, trace folder)`` of one prefill
    call over ``a.batch`` prompts of ``a.prompt_len`` tokens (every chunk the whole prompt,
    the call samples the first tokens; with k > 0 the MTP draft KV and ``k`` drafts), the
    same batch run again and again (it rewrites the same pages and slots). The engine's
    chunk size and context are the call's padded ``B * T`` (a call's padded tokens stay
    within its chunk size)."""
    padded = next_pow2(a.batch) * prefill_bucket(a.prompt_len, a.prompt_len)
    eng = Engine(model, EngineConfig(max_running_requests=a.batch, max_prefill_batch=a.batch,
                                     max_model_len=padded + 64, chunked_prefill_size=padded,
                                     dtype=model.dtype,
                                     enable_prefix_cache=False),
                 SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3,
                                   adaptive=False))
    sched = eng.scheduler
    reqs = requests(a.batch, a.prompt_len, 16, cfg.vocab_size, 0)
    for r in reqs:
        sched.add(r)
        sched.admit(r)
    rows = [ChunkRow(r, 0, a.prompt_len) for r in reqs]
    batch = prefill_batch(rows, sched.prefill_shape(len(rows), a.prompt_len), sched.book,
                          None, sched.settings.k)
    variant = sched.prefill_variant(reqs)
    if k and a.prefill_drafts == "no":
        variant = dataclasses.replace(variant, drafts=False)
    trace_dir = os.path.join(a.trace_dir, f"prefill_k{k}_b{a.batch}_{a.prefill_drafts}")
    wall, s = measure(lambda: sched.device.prefill(batch, variant),
                      lambda: jax.block_until_ready(eng.pools), a.rounds, 1, trace_dir,
                      a.sequence)
    return wall, s, trace_dir


def profile(a, model, cfg, k: int) -> tuple[float, dict, str]:
    """``(untraced wall seconds per round, per-round analysis, trace folder)`` of one k; a
    call runs ``a.num_scheduler_steps`` rounds, so its figures are divided by them."""
    if a.phase == "prefill":
        return profile_prefill(a, model, cfg, k)
    steps = a.num_scheduler_steps
    room = a.prompt_len + (2 * a.rounds + 16) * steps * (k + 1) + 64
    eng = Engine(model, EngineConfig(max_running_requests=a.batch, max_model_len=room,
                                     chunked_prefill_size=a.prompt_len, dtype=model.dtype,
                                     enable_prefix_cache=False, num_scheduler_steps=steps),
                 SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3,
                                   adaptive=False))
    reqs = requests(a.batch, a.prompt_len, 10**6, cfg.vocab_size, 0)
    prefill_all(eng, reqs, Ledger(), "warmup", None)
    trace_dir = os.path.join(a.trace_dir, f"k{k}_b{a.batch}")
    wall, s = measure(lambda: eng.scheduler.run_round(reqs),
                      lambda: jax.block_until_ready(eng.pools), a.rounds, steps, trace_dir,
                      a.sequence)
    return wall, s, trace_dir


def bench(a, results: Results) -> None:
    """Every k of the flags (see the module docstring)."""
    require_gpu("profile", "run it on the GPU machine (the trace's kernel lines are the GPU's)",
                why="it reads the GPU's kernels from the trace")
    cfg = config_of(a.config)
    model = load_model(cfg=cfg, dtype=a.dtype, dummy_weight=True, with_mtp=any(a.k),
                       **{f"{op}_backend": getattr(a, f"{op}_backend") for op in OPS})
    shape = shape_name(a.config)
    os.makedirs(a.trace_dir, exist_ok=True)
    texts = []
    for k in a.k:
        wall, s, trace_dir = profile(a, model, cfg, k)
        prefill = a.phase == "prefill"
        unit = "call" if prefill else "round"
        per = "" if prefill else f"rounds/call={a.num_scheduler_steps}: "
        if prefill and k:
            per = f"drafts={a.prefill_drafts}: "
        texts.append(text_of(f"=== {a.phase} k={k} batch={a.batch} prompt={a.prompt_len} "
                             f"{per}median wall {wall * 1e3:.3f} ms/{unit} (untraced) ===", s))
        print(texts[-1], flush=True)
        context = a.prompt_len + a.rounds * a.num_scheduler_steps * (k + 1)
        nbytes = None if prefill else round_bytes(cfg, a.batch, k, context,
                                                  4 if a.dtype == "float32" else 2)["total"]
        op = "prefill call" if prefill else "round" if k else "decode step"
        case = f"{shape} B={a.batch} k={k}" + (" no drafts" if per == "drafts=no: " else "")
        row = op_row(op, case,
                     "op by op" if a.op_by_op else "command buffers", s["busy_us"] / 1e6,
                     nbytes, hbm_tbps=a.hbm_tbps, timing="device", wall_us=wall * 1e6,
                     kernels=s["kernels"], span_us=s["span_us"], trace=trace_dir)
        row["profile"] = s
        results.add(row)
    name = f"profile_{shape}_b{a.batch}" + ("_prefill" if a.phase == "prefill" else "")
    with open(os.path.join(a.trace_dir, name + ".txt"), "w") as f:
        f.write("\n\n".join(texts) + "\n")


def main(argv=None) -> int:
    """``python -m mtp_jax.bench profile``; 0, or 2 without a GPU. Adds the command-buffer
    flag to ``XLA_FLAGS`` first (unless ``--op-by-op``) where this jaxlib accepts it: read when
    the backend is created, which nothing before this has done in a fresh process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.prefill_drafts == "no" and args.phase != "prefill":
        build_parser().error("--prefill-drafts no needs --phase prefill (rounds draft as "
                             "adaptive speculation is off: every round drafts k).")
    if not args.op_by_op and flag_accepted(CMD_BUFFERS_WHILE_PROFILING):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                   + CMD_BUFFERS_WHILE_PROFILING).strip()
        print("profiling with command buffers (CUDA graphs)", file=sys.stderr, flush=True)
    elif not args.op_by_op:
        argv.append("--op-by-op")  # this jaxlib refuses the flag: XLA's default mode
        print("profiling op by op (this jaxlib does not take "
              f"{CMD_BUFFERS_WHILE_PROFILING})", file=sys.stderr, flush=True)
    return run("profile", build_parser(), bench, argv)
