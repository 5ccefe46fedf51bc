"""Host cost of dispatching one compiled program against the number of its argument buffers
(GPU helper; not part of the test suite).

Why: with merged projections the untraced round got faster on the H200 while the device time
did not change (docs/benchmarks.md, session 7), which suggests a host cost per argument buffer
of ~2 us. A round takes ~230 parameter buffers (Qwen3.5-2B shape) to ~450 (Qwen3.6-35B-A3B)
plus ~90-150 pool buffers. This measures that cost directly: a program that reads one element
of each of ``n`` small buffers (and, with ``--donate``, also takes ``n`` donated buffers and
returns them updated, as the pools are), dispatched ``--calls`` times without waiting, for
several ``n``. The device work is a few tiny kernels, so the time per call is the host's.

Usage:
    PYTHONPATH=. python scripts/dispatch_cost.py --sizes 1 64 256 512 --calls 2000 [--donate]

Prints, per ``n``: microseconds per call (median of ``--repeats`` timed loops) and, at the end,
the least-squares slope in microseconds per buffer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def make_program(n: int, donate: bool):
    """``f(params, pools) -> (scalar, pools')``: reads element 0 of every parameter buffer;
    with ``donate`` adds it to every pool buffer in place (the pools are donated)."""

    def f(params, pools):
        total = sum(p[0] for p in params)
        if donate:
            pools = tuple(q.at[0].add(total) for q in pools)
        return total, pools

    return jax.jit(f, donate_argnums=(1,) if donate else (), keep_unused=True)


def time_calls(n: int, calls: int, repeats: int, donate: bool) -> float:
    """Median microseconds per dispatched call with ``n`` parameter buffers."""
    params = tuple(jnp.full((256,), i, jnp.float32) for i in range(n))
    pools = tuple(jnp.zeros((256,), jnp.float32) for _ in range(n if donate else 0))
    f = make_program(n, donate)
    out, pools = f(params, pools)  # compile
    jax.block_until_ready((out, pools))
    per_call = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out, pools = f(params, pools)
        jax.block_until_ready((out, pools))
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 64, 256, 512],
                   help="parameter-buffer counts to time")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    p.add_argument("--repeats", type=int, default=5, help="timed loops per size")
    p.add_argument("--donate", action="store_true",
                   help="also pass as many donated buffers, updated in place (like the pools)")
    args = p.parse_args()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, donate={args.donate}")
    us = []
    for n in args.sizes:
        us.append(time_calls(n, args.calls, args.repeats, args.donate))
        print(f"n={n:5d} buffers{' (+ n donated)' if args.donate else ''}: {us[-1]:8.2f} us/call",
              flush=True)
    if len(args.sizes) > 1:
        slope = np.polyfit(np.asarray(args.sizes, float), np.asarray(us), 1)[0]
        print(f"slope: {slope:.3f} us per parameter buffer"
              f"{' (plus its donated pool buffer)' if args.donate else ''}")


if __name__ == "__main__":
    main()
