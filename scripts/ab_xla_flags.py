"""A/B of XLA flag sets, or of benchmark options (kernel backends), on the benchmark's round
time (GPU helper; not part of the test suite).

Runs ``python -m mtp_jax.bench`` once per variant per repeat, variants alternating (so that a
machine's drift between calls hits every variant alike), each with ``XLA_FLAGS`` = the
environment's plus the variant's, and prints every run's median round time and, per variant,
the median over repeats. A variant with a flag this jaxlib does not know is skipped with a
note: an unknown flag aborts the process (checked first in a child process that only creates
the backend). ``--bench-variant`` adds benchmark arguments per variant instead (e.g. a kernel
backend); with both options every pair of the two lists is a variant.

Usage (extra arguments after ``--`` go to the benchmark; default: batch 1, k 0, 512 tokens):
    PYTHONPATH=. python scripts/ab_xla_flags.py --config configs/Qwen3.5-2B.json \\
        --variant "" --variant "--xla_gpu_require_exclusive_lock=true" --repeats 3
    PYTHONPATH=. python scripts/ab_xla_flags.py --config configs/Qwen3.6-27B.json \
        --bench-variant "" --bench-variant "--norm-backend pallas" \
        --bench-variant "--gemv-backend pallas" --repeats 2 -- --batch 1 --k 0 \
        --decode-tokens 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DEFAULT_BENCH = ["--batch", "1", "--k", "0", "--decode-tokens", "512"]


def with_flags(extra: str) -> dict:
    """The environment with ``extra`` appended to ``XLA_FLAGS``."""
    flags = (os.environ.get("XLA_FLAGS", "") + " " + extra).strip()
    return dict(os.environ, XLA_FLAGS=flags)


def accepted(extra: str) -> bool:
    """Whether a process with these flags can create the backend."""
    done = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                          env=with_flags(extra), capture_output=True, timeout=300, check=False)
    return done.returncode == 0


def run_bench(config: str, extra: str, bench_args: list[str]) -> list[float]:
    """Median round ms of every row of one benchmark run (rows in the benchmark's order)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "mtp_jax.bench", "--config", config, *bench_args,
               "--out", out]
        done = subprocess.run(cmd, env=with_flags(extra), capture_output=True, text=True,
                              check=False)
        if done.returncode not in (0, 1) or not os.path.exists(out):
            raise RuntimeError(f"bench failed ({done.returncode}): {done.stderr[-2000:]}")
        with open(out) as f:
            return [row["round_ms"] for row in json.load(f)["results"]]


def main() -> None:
    argv = sys.argv[1:]
    bench_args = DEFAULT_BENCH
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--variant", action="append",
                   help='extra XLA flags of one variant ("" = none); repeat the option')
    p.add_argument("--bench-variant", action="append",
                   help='extra benchmark arguments of one variant ("" = none), e.g. '
                        '"--norm-backend pallas"; repeat the option')
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not args.variant and not args.bench_variant:
        p.error("give at least one --variant or --bench-variant")
    flag_sets = []
    for v in args.variant or [""]:
        if accepted(v):
            flag_sets.append(v)
        else:
            print(f"skipped (this jaxlib refuses it): {v!r}", flush=True)
    variants = [(f, b) for f in flag_sets for b in args.bench_variant or [""]]
    label = {v: " + ".join(x for x in v if x) or "(none)" for v in variants}
    times: dict[tuple, list[list[float]]] = {v: [] for v in variants}
    for r in range(args.repeats):
        for v in variants:
            ms = run_bench(args.config, v[0], bench_args + v[1].split())
            times[v].append(ms)
            print(f"repeat {r} {label[v]!r}: round ms {', '.join(f'{t:.3f}' for t in ms)}",
                  flush=True)
    for v, runs in times.items():
        per_row = [statistics.median(row) for row in zip(*runs)]
        print(f"median over {len(runs)} runs {label[v]!r}: "
              f"{', '.join(f'{t:.3f}' for t in per_row)} ms")


if __name__ == "__main__":
    main()
