"""Micro-benchmark: projections that read one input, separate against stacked in one matrix
(GPU helper for ``MergedLinear``; not part of the test suite).

For the decoder's projection groups of the Qwen3.5-2B, Qwen3.6-27B and Qwen3.6-35B-A3B shapes,
times the input RMSNorm followed by the group's projections three ways: ``separate`` (one
einsum per weight, as the checkpoint stores them), ``merged`` (one einsum on the weights stored
stacked, what ``load_model`` builds) and ``stacked in program`` (concatenated inside the
program, which XLA copies every call).

Each timed program runs the group on distinct weight copies (over 100 MB together, twice the
L2), each call's input depending on the previous output, ``--iters`` times in a loop inside one
program (host dispatch off the clock); the median over trials / (copies x iters) is one call.
Bandwidth = weight bytes / time.

Usage: PYTHONPATH=. python scripts/bench_merged_projections.py [--rows 1,4] [--iters 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

GROUPS = [  # (name, K, (N_j, ...)) from configs/
    ("2B GDN in", 2048, (6144, 2048, 16, 16)),
    ("35B-A3B GDN in", 2048, (8192, 4096, 32, 32)),
    ("27B GDN in", 5120, (10240, 6144, 48, 48)),
    ("2B attention qkv", 2048, (4096, 512, 512)),
    ("35B-A3B attention qkv", 2048, (8192, 512, 512)),
    ("27B attention qkv", 5120, (12288, 1024, 1024)),
    ("35B-A3B router+shared", 2048, (256, 1, 512, 512)),
]


def _norm(x, g):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)
    return (y * (1 + g.astype(jnp.float32))).astype(x.dtype)


def separate(x, ws, g, sizes):
    xn = _norm(x, g)
    return [jnp.einsum("...i,oi->...o", xn, w) for w in ws]


def merged(x, w, g, sizes):
    y = jnp.einsum("...i,oi->...o", _norm(x, g), w)
    return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)


def stacked_in_program(x, ws, g, sizes):
    return merged(x, jnp.concatenate(ws, 0), g, sizes)


def _chain(fn, sizes, iters):
    def run(x, sets, g):
        def body(_, x):
            for ws in sets:
                outs = fn(x, ws, g, sizes)
                x = x + sum((o[:, :1] * 0).astype(x.dtype) for o in outs)
            return x
        return jax.lax.fori_loop(0, iters, body, x)
    return jax.jit(run)


def _time(fn, *args, trials=9):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4",
                   help="comma-separated row counts (tokens per call: 1 = batch-1 decode)")
    p.add_argument("--iters", type=int, default=10,
                   help="loop iterations over all weight copies inside one timed program")
    args = p.parse_args()
    key = jax.random.PRNGKey(0)
    print(f"{'group':24} rows {'separate':>16} {'merged':>16} {'stacked in program':>18}")
    for name, k, ns in GROUPS:
        wbytes = sum(ns) * k * 2
        copies = min(64, max(8, -(-100_000_000 // wbytes)))
        sets = [tuple(jax.random.normal(jax.random.fold_in(key, 97 * c + j), (n, k),
                                        jnp.bfloat16) * 0.02 for j, n in enumerate(ns))
                for c in range(copies)]
        stacked = [jnp.concatenate(s, 0) for s in sets]
        g = jax.random.normal(key, (k,), jnp.bfloat16) * 0.1
        for m in (int(r) for r in args.rows.split(",")):
            x = jax.random.normal(key, (m, k), jnp.bfloat16)
            cells = []
            for fn, weights in ((separate, sets), (merged, stacked), (stacked_in_program, sets)):
                t = _time(_chain(fn, ns, args.iters), x, weights, g) / (copies * args.iters)
                cells.append(f"{t * 1e6:6.1f} us {wbytes / t / 1e12:4.2f}TB/s")
            print(f"{name:24} {m:4d} {cells[0]:>16} {cells[1]:>16} {cells[2]:>18}", flush=True)


if __name__ == "__main__":
    main()
