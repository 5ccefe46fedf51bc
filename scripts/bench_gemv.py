"""Micro-benchmark of the few-rows projection kernel against XLA (GPU helper).

For each projection shape ``w [N, K]`` of the Qwen3.5-2B / Qwen3.6-27B decode step and row
count M, times ``x [M, K] @ w.T`` as XLA runs it and as ``pallas_kernels.gemv`` does with a
sweep of tiles. Each program runs the op on 16 distinct weights back to back (chained by
``optimization_barrier``; L2 holds no weight from one call to the next); a call's time is the
median kernel duration in a ``jax.profiler`` trace (device time, no dispatch cost; an XLA
split-K GEMM shows as two lines, the GEMM and its reduction). Bytes = N K 2; TB/s and the
fraction of 4.2 TB/s. ``err`` = max |y - ref| / max |ref| (ref: XLA with float32 sums rounded
once). ``(default)`` marks the tiles ``gemv`` picks (``default_tiles``). ``reduce`` rows are
XLA's multiply-reduce form (``pallas_kernels.gemv.reduce_form``; for several rows the same
form reduced in ``[N, M, K]`` order; ``reduce_chunked``, for K > 8192, the form reduced over
chunks of K first; ``reduce_split2`` / ``reduce_split4``, for one row and K <= 8192, the same
over 2 or 4 chunks, for small projections such as the 2B shape's 2048 x 2048, which XLA's one
row reduction reads at 1.95 TB/s). About 4 minutes for all shapes on an H200 (mostly
compiles); ``--quick`` times only XLA's dot, the reduce form and the default tiles;
``--budget-s`` stops the sweep early.

Usage: PYTHONPATH=. python scripts/bench_gemv.py [--shapes all|2b,27b,27b_more,35b,head,rows]
       [--rows 1,4] [--quick] [--budget-s 400]
"""

from __future__ import annotations

import argparse
import functools
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.gemv import (GemvTiles, check_tiles, default_tiles,  # noqa: E402
                                 few_rows_matmul, few_rows_reference)
from pallas_kernels.gemv import reduce_matmul as reduce_form  # noqa: E402

HBM_BPS = 4.2e12
SHAPES = {"2b": [("2B gate_up", 12288, 2048), ("2B down", 2048, 6144),
                 ("2B gdn_in", 8224, 2048), ("2B attn_qkv", 5120, 2048),
                 ("2B o_proj", 2048, 2048)],
          "27b": [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408)],
          "27b_more": [("27B gdn_in", 16480, 5120), ("27B gdn_out", 5120, 6144),
                       ("27B attn_qkv", 14336, 5120), ("27B o_proj", 5120, 6144)],
          "35b": [("35B gdn_in", 12352, 2048), ("35B gdn_out", 2048, 4096),
                  ("35B shared_in", 1281, 2048), ("35B shared_down", 2048, 512)],
          "head": [("2B lm_head", 248320, 2048)],
          "rows": [("2B gate_up", 12288, 2048), ("2B down", 2048, 6144),
                   ("27B gate_up", 34816, 5120), ("27B gdn_in", 16480, 5120),
                   ("27B o_proj", 5120, 6144), ("35B gdn_in", 12352, 2048)]}
REPS = 16  # distinct weights per program: 128 MB or more, beyond the 50 MB L2
RUNS = 3


def chained(fn):
    def run(x, ws):
        outs, prev = [], None
        for w in ws:
            if prev is not None:
                x, prev = jax.lax.optimization_barrier((x, prev))
            prev = fn(x, w)
            outs.append(prev)
        return outs
    return jax.jit(run)


def reduce_rows_form(x, w):
    """The multiply-reduce form for several rows, reduced in ``[N, M, K]`` order (the rows
    of one weight row next to each other), transposed back to ``[M, N]``."""
    y = jnp.sum(x.astype(jnp.float32)[None] * w.astype(jnp.float32)[:, None], axis=-1)
    return y.T.astype(w.dtype)


def reduce_sibling_form(x, w):
    """One one-row multiply-reduce per row, stacked: sibling reductions that share ``w``
    (XLA may fuse them into one multi-output reduction that reads ``w`` once)."""
    wf = w.astype(jnp.float32)
    xf = x.astype(jnp.float32)
    return jnp.stack([jnp.sum(xf[m][None, :] * wf, axis=-1) for m in range(x.shape[0])]
                     ).astype(w.dtype)


def reduce_chunked_form(x, w, chunk=8192):
    """The one-row reduce form with K split into chunks of at most ``chunk`` (a reduce over
    each chunk, then over the chunks): for K above ``reduce_form``'s MAX_K, where XLA splits
    one long row reduction itself and reads the weights slowly."""
    n, k = w.shape
    c = -(-k // chunk)
    while k % c:
        c += 1
    prod = x.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32)[None]
    y = jnp.sum(jnp.sum(prod.reshape(x.shape[0], n, c, k // c), axis=-1), axis=-1)
    return y.astype(w.dtype)


def candidates(n, k, m):
    fmas = [GemvTiles(bn, bk, "fma") for bn in (4, 8, 16, 32) for bk in (256, 512)]
    fmas += [GemvTiles(bn, 512, "fma", 8) for bn in (16, 32)]
    fmas += [GemvTiles(bn, 512, "fma", 4, 4) for bn in (8, 32)]
    fmars = [GemvTiles(bn, bk, "fmar") for bn in (8, 16, 32) for bk in (256, 512)]
    dots = [GemvTiles(bn, bk, "dot") for bn in (16, 32, 64) for bk in (128, 256)]
    ok = []
    default = default_tiles(n, k)
    for t in ([default] if default and m == 1 else []) + (fmas if m == 1 else []) + fmars + dots:
        if t in ok:
            continue
        try:
            check_tiles(t, n, k)
            ok.append(t)
        except ValueError:
            pass
    return ok


def tag(t):
    return f"gemv_{t.form}_{t.bn}_{t.bk}_{t.num_warps}_{t.num_stages}"


def kernel_us(trace_dir, stat=statistics.median):
    """``stat`` (default the median) of the device durations (us) per kernel name of the newest
    trace under trace_dir, with the kernel's count: ``{name: (us, count)}``."""
    path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
               key=os.path.getmtime)
    events = json.load(gzip.open(path))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    by = defaultdict(list)
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if "gpu" not in str(procs.get(e["pid"], "")).lower():
            continue
        if "xla" in str(threads.get((e["pid"], e.get("tid")), "")).lower():
            continue
        by[e["name"]].append(e["dur"])
    return {n: (stat(d), len(d)) for n, d in by.items()}


def device_us(fn, args, calls: int = 8) -> dict:
    """``{kernel name: device us per call}`` of ``calls`` back-to-back ``fn(*args)`` (jitted by
    the caller; one warm-up call first), from a ``jax.profiler`` trace."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        times = kernel_us(tmp, stat=sum)
    return {name: us / calls for name, (us, _) in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--quick", action="store_true",
                    help="only XLA's dot, XLA's multiply-reduce form and the default tiles")
    args = ap.parse_args()
    jax.config.update("jax_compilation_cache_dir", "/tmp/jax_cache_bench_gemv")
    shapes = ([s for key, v in SHAPES.items() if key != "rows" for s in v]
              if args.shapes == "all"
              else [s for key in args.shapes.split(",") for s in SHAPES[key]])
    rows = [int(r) for r in args.rows.split(",")]
    t0 = time.perf_counter()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; kernel times from the "
          f"profiler (median of {REPS * RUNS} calls)", flush=True)
    for name, n, k in shapes:
        if time.perf_counter() - t0 > args.budget_s:
            print("(budget spent)")
            break
        key = jax.random.key(n * 7 + k)
        ws = [(jax.random.normal(jax.random.fold_in(key, r), (n, k), jnp.float32)
               * k ** -0.5).astype(jnp.bfloat16) for r in range(REPS)]
        gb = n * k * 2
        for m in rows:
            x = jax.random.normal(jax.random.fold_in(key, 99 + m), (m, k), jnp.float32
                                  ).astype(jnp.bfloat16)
            ref = few_rows_reference(x, ws[0]).astype(jnp.float32)
            progs = [("xla", chained(few_rows_reference))]
            errs = {}
            if m >= 1:
                fn = reduce_form if m == 1 else reduce_rows_form
                y = jax.jit(fn)(x, ws[0]).astype(jnp.float32)
                errs["gemv_reduce"] = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
                progs.append(("reduce", chained(fn)))
            if m > 1:
                y = jax.jit(reduce_sibling_form)(x, ws[0]).astype(jnp.float32)
                errs["gemv_sibling"] = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
                progs.append(("sibling", chained(reduce_sibling_form)))
            if m == 1 and k > 8192:
                progs.append(("reduce_chunked", chained(reduce_chunked_form)))
            elif m == 1:  # shorter rows, more of them: more loads in flight on small N
                for parts in (2, 4):
                    progs.append((f"reduce_split{parts}", chained(
                        functools.partial(reduce_chunked_form, chunk=k // parts))))
            tiles = candidates(n, k, m)
            if args.quick:
                tiles = [t for t in tiles if t == default_tiles(n, k)]
            for t in tiles:
                fn = functools.partial(few_rows_matmul, tiles=t, name=tag(t))
                try:
                    y = jax.jit(fn)(x, ws[0]).astype(jnp.float32)
                    errs[tag(t)] = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
                    f = chained(fn)
                    jax.block_until_ready(f(x, ws))
                except Exception as e:  # noqa: BLE001 - report and go on with the sweep
                    print(f"  {t}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                progs.append((tag(t), f))
            jax.block_until_ready(progs[0][1](x, ws))
            rows_out = []
            for label, f in progs:  # one trace per XLA program: their fusion names collide
                if label.startswith("gemv_"):
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    with jax.profiler.trace(tmp):
                        for _ in range(RUNS):
                            jax.block_until_ready(f(x, ws))
                    for nm, (us, c) in kernel_us(tmp).items():
                        if c >= REPS * RUNS:
                            err = errs.get({"reduce": "gemv_reduce",
                                            "sibling": "gemv_sibling"}.get(label))
                            extra = f" err {err:.1e}" if err is not None else ""
                            rows_out.append((us, f"{label} {nm[:40]}", extra))
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp):
                    for _ in range(RUNS):
                        for label, f in progs:
                            if label.startswith("gemv_"):
                                jax.block_until_ready(f(x, ws))
                times = kernel_us(tmp)
            for nm, (us, c) in times.items():
                if nm.startswith("gemv_"):
                    err = max((v for tg, v in errs.items() if nm.startswith(tg)),
                              default=float("nan"))
                    rows_out.append((us, nm, f" err {err:.1e}"))
            rows_out.sort()
            default = default_tiles(n, k)
            print(f"{name} N={n} K={k} M={m} ({gb / 1e6:.1f} MB):", flush=True)
            for i, (us, nm, extra) in enumerate(rows_out):
                mark = " (default)" if m == 1 and default and nm.startswith(tag(default)) else ""
                if i < 12 or mark:
                    tbps = gb / us / 1e6
                    print(f"  {us:7.2f} us {tbps:5.2f} TB/s {tbps * 1e12 / HBM_BPS:4.0%}  "
                          f"{nm}{extra}{mark}", flush=True)
        del ws
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
