"""Engine start-up time: ``Engine.warmup()`` on random weights, in a fresh process with an empty
cache folder (cold) and again in a fresh process on the filled folder (cached).

Prints, per program, how it came to be in memory (``disk``: loaded from the executable cache;
``built``: traced, lowered, compiled, saved) with the seconds of each step, and per run the
totals: model load, engine creation, warm-up, and a second warm-up pass (dispatch only; it
must not compile). Issue 5's targets on the GPU machine: warm-up <= 120 s cold, <= 15 s cached.

    python scripts/time_startup.py --config configs/Qwen3.5-2B.json
    python scripts/time_startup.py                   # the built-in default model
    python scripts/time_startup.py --config configs/Qwen3.5-2B.json --mode jit   # before: the
        # jitted functions with jax's persistent cache only (per-call seconds)
    python scripts/time_startup.py --config ... --threads 1   # compile one at a time

As ``Engine.warmup`` does, the table mode first records the warm-up's calls, then traces them
in turn and compiles them on $MTP_JAX_COMPILE_THREADS threads (default min(4, cpus // 4) with
>= 8 cpus; ``--threads``), then runs the warm-up (timed call by call).

The defaults match ``python -m mtp_jax.bench --batch 1 --prompt-len 1024 --engine-warmup``:
max_running_requests 2, chunked_prefill_size 1024, k 3, no prefix cache (11 programs: 7 prefill buckets, 2 round buckets x greedy and sampled).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None,
                   help="configs/*.json (random weights); default: the built-in default model")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, f32 on CPU), bfloat16...")
    p.add_argument("--k", type=int, default=3, help="speculative_num_steps (0: no MTP)")
    p.add_argument("--max-running-requests", type=int, default=2)
    p.add_argument("--chunked-prefill-size", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pages (default: from device memory, as the engine sizes them)")
    p.add_argument("--prefix-cache", action="store_true", help="also the snapshot variants")
    p.add_argument("--greedy-only", action="store_true", help="warm-up without sampled variants")
    p.add_argument("--mode", choices=("table", "jit"), default="table",
                   help="table: the executable cache (default); jit: the jitted functions with "
                        "jax's persistent cache only (the old path)")
    p.add_argument("--threads", type=int, default=None, help="sets $MTP_JAX_COMPILE_THREADS")
    p.add_argument("--cache-dir", default=None,
                   help="cache folder (default: a new temporary folder, removed at the end)")
    p.add_argument("--runs", nargs="+", default=["cold", "cached"],
                   help="runs, each a fresh process on the same folder (default: cold cached)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


class TimedPrograms:
    """Programs whose calls are timed one by one (each waits for its result)."""

    def __init__(self, programs):
        self.inner, self.calls = programs, []

    def _timed(self, name, fn, leaves, pools, batch, static):
        import jax

        t0 = time.perf_counter()
        out, pools = fn(leaves, pools, batch, **static)
        jax.block_until_ready(pools)
        shape = "x".join(map(str, jax.tree_util.tree_leaves(batch)[0].shape))
        self.calls.append({"program": f"{name}[{shape}] " + ",".join(
            f"{k}={v}" for k, v in sorted(static.items())), "call_s": time.perf_counter() - t0})
        return out, pools

    def prefill(self, leaves, pools, batch, **static):
        return self._timed("prefill", self.inner.prefill, leaves, pools, batch, static)

    def round(self, leaves, pools, batch, **static):
        return self._timed("round", self.inner.round, leaves, pools, batch, static)

    def compiled_count(self):
        return self.inner.compiled_count()

    def __getattr__(self, name):
        return getattr(self.inner, name)


def generate(eng, vocab: int) -> list[list[int]]:
    """Greedy tokens of two fixed random prompts (the runs must agree: a loaded program
    computes what a freshly compiled one does)."""
    import numpy as np

    from mtp_jax.engine.requests import Request, SamplingParams

    rng = np.random.default_rng(0)
    reqs = [Request(request_id=str(i), index=i, prompt=None,
                    prompt_ids=rng.integers(10, vocab - 10, n).tolist(),
                    params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), seed=0)
            for i, n in enumerate((5, 40))]
    eng.run(reqs)
    return [r.output_ids for r in reqs]


def child(args) -> dict:
    """One start-up in this process; returns its timings."""
    t_start = time.perf_counter()
    import jax

    from mtp_jax.compile_cache import enable_compilation_cache
    from mtp_jax.config import EngineConfig, SpeculativeConfig
    from mtp_jax.engine import startup
    from mtp_jax.engine.engine import Engine
    from mtp_jax.models.loader import load_model

    enable_compilation_cache(args.cache_dir)
    t0 = time.perf_counter()
    if args.config:
        from mtp_jax.bench.floor import load_config

        model = load_model(cfg=load_config(args.config), dtype=args.dtype, dummy_weight=True,
                           with_mtp=args.k > 0)
    else:
        from mtp_jax.default_model import default_model_path

        model = load_model(default_model_path(), args.dtype, with_mtp=args.k > 0)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = Engine(model, EngineConfig(max_running_requests=args.max_running_requests,
                                     dtype=model.dtype, max_model_len=args.max_model_len,
                                     chunked_prefill_size=args.chunked_prefill_size,
                                     enable_prefix_cache=args.prefix_cache,
                                     num_pages=args.num_pages),
                 SpeculativeConfig(algorithm="mtp" if args.k else "none", num_steps=args.k or 3))
    engine_s = time.perf_counter() - t0
    programs = eng.programs
    if args.mode == "jit":
        import dataclasses

        programs = eng.programs = dataclasses.replace(programs, executables=None)
    table = programs.executables
    t0 = time.perf_counter()
    build_s = 0.0
    if table is not None:  # what Engine.warmup does first, timed apart
        build_s = startup.build_warmup_programs(eng, sampled=not args.greedy_only)
    eng.programs = TimedPrograms(programs)
    eng.warmup(sampled=not args.greedy_only)
    warmup_s = time.perf_counter() - t0
    first_calls = list(eng.programs.calls)
    count = eng.compiled_program_count()
    t0 = time.perf_counter()
    eng.warmup(sampled=not args.greedy_only)
    again_s = time.perf_counter() - t0
    tokens = generate(eng, model.cfg.vocab_size)
    from mtp_jax.engine import executable_key as ek

    key_parts = {k: ek.digest(v)[:12] for k, v in ek.environment_parts().items()}
    key_parts["model"] = ek.model_digest(model.graphdef)[:12]
    return {"tokens": tokens, "key_parts": key_parts, "load_s": load_s, "engine_s": engine_s,
            "warmup_s": warmup_s, "build_s": build_s,
            "second_warmup_s": again_s, "programs": count,
            "compiled_after_warmup": eng.compiled_program_count() - count,
            "calls": first_calls,
            "records": [] if table is None else [dict(vars(r), total_s=r.total_s)
                                                 for r in table.records],
            "table": None if table is None else table.stats(),
            "process_s": time.perf_counter() - t_start,
            "backend": f"{jax.default_backend()} {jax.devices()[0].device_kind}",
            "cpus": os.cpu_count()}


def show(name: str, r: dict) -> None:
    print(f"== {name}: {r['backend']}, {r['cpus']} cpus, {r['programs']} programs")
    print(f"  {'program':64s} {'call':>6s} {'source':>6s} {'trace':>6s} {'lower':>6s} "
          f"{'compile':>7s} {'load':>6s} {'save':>6s}")
    first = r["calls"]  # the first warm-up's calls
    recs = r["records"] if len(r["records"]) == len(first) else [{}] * len(first)
    for c, rec in zip(first, recs):  # both in call order: every call of the first pass missed
        print(f"  {c['program'][:64]:64s} {c['call_s']:6.2f} {rec.get('source', '-'):>6s} "
              + " ".join(f"{rec.get(k, 0.0):6.2f}" for k in ("trace_s", "lower_s"))
              + f" {rec.get('compile_s', 0.0):7.2f} "
              + " ".join(f"{rec.get(k, 0.0):6.2f}" for k in ("load_s", "save_s")))
    if r["records"]:
        tot = {k: sum(x[k] for x in r["records"]) for k in
               ("trace_s", "lower_s", "compile_s", "load_s", "save_s")}
        print("  steps total: " + " ".join(f"{k[:-2]} {v:.1f}s" for k, v in tot.items()))
    print(f"  load model {r['load_s']:.1f}s, engine {r['engine_s']:.1f}s, warm-up "
          f"{r['warmup_s']:.1f}s (of it build ahead {r['build_s']:.1f}s), second warm-up "
          f"{r['second_warmup_s']:.2f}s, compiles after warm-up {r['compiled_after_warmup']}, "
          f"process {r['process_s']:.1f}s, table {r['table']}")


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads is not None:
        os.environ["MTP_JAX_COMPILE_THREADS"] = str(args.threads)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return 0
    own = args.cache_dir is None
    folder = args.cache_dir or tempfile.mkdtemp(prefix="mtp_jax_startup_")
    results = {}
    try:
        for run in args.runs:
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--cache-dir", folder]
            cmd += [a for a in (argv if argv is not None else sys.argv[1:])
                    if a not in ("--child",)]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
                print(f"error: run {run!r} failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            results[run] = json.loads(lines[-1][len("RESULT "):])
            results[run]["wall_s"] = time.perf_counter() - t0
            show(run, results[run])
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    same = len({json.dumps(v["tokens"]) for v in results.values()}) == 1
    moved = sorted({k for v in results.values() for k, d in v["key_parts"].items()
                    if d != next(iter(results.values()))["key_parts"][k]})
    if moved:  # a cached run that rebuilt: which part of the executable-cache key changed
        print(f"note: executable-cache key parts differ between runs: {', '.join(moved)}")
    print("summary: " + ", ".join(f"{k} warm-up {v['warmup_s']:.1f}s" for k, v in
                                  results.items())
          + f"; greedy outputs identical across runs: {'yes' if same else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
