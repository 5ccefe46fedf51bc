"""Host cost of launching one compiled program of many small kernels (a CUDA graph under XLA's
command buffers) when the addresses of its inputs and outputs stay the same between calls or
change (GPU helper; not part of the test suite).

Why: in the Qwen3.5-2B decode round ``cuGraphLaunch`` alone took 1.2-1.4 ms of host time per
round for ~370 kernel nodes (docs/benchmarks.md, session 11), where replaying a CUDA graph
usually costs tens of microseconds. XLA updates a command buffer when an address it recorded
changes; the round's per-step inputs (tokens, page table) and its outputs are new buffers at
every call. This separates the two causes: a program of ``--nodes`` chained small kernels
(``optimization_barrier`` between steps keeps them apart) whose first kernel reads a small
``feed`` array and whose state is donated (same address every call), called

* ``stable``: with the same ``feed`` array every call, returning only the donated state;
* ``fresh feed``: with a new ``feed`` array every call (as the engine uploads its batch);
* ``fresh feed + output``: as above, also returning a new small array (the engine's readback);

and, per variant, the median wall time per call over ``--calls`` calls dispatched back to back,
and the mean host duration of ``cuGraphLaunch`` and of ``GpuExecutable::ExecuteThunks`` in a
``jax.profiler`` trace of 50 calls (command buffers kept on under the profiler where the jaxlib
takes ``--xla_enable_command_buffers_during_profiling``). If only the fresh variants are slow,
the launch pays for the command buffer's update, not per node.

Usage: PYTHONPATH=. python scripts/launch_cost.py [--nodes 350] [--calls 500]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_xla_flags import accepted  # noqa: E402  (scripts/)

FLAG = "--xla_enable_command_buffers_during_profiling=true"


def build(nodes: int, with_output: bool):
    import jax
    import jax.numpy as jnp

    def f(state, feed):
        x = state + feed[0].astype(state.dtype)
        for i in range(nodes - 1):
            x = jax.lax.optimization_barrier(jnp.sin(x) * 0.5 + float(i % 7))
        return (x, jnp.sum(x[:8])) if with_output else x

    return jax.jit(f, donate_argnums=(0,))


def host_events(trace_dir: str) -> dict[str, float]:
    path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
               key=os.path.getmtime)
    durs: dict[str, list] = {}
    for e in json.load(gzip.open(path))["traceEvents"]:
        if e.get("ph") == "X" and "dur" in e:
            for key in ("cuGraphLaunch", "ExecuteThunks"):
                if key in e["name"]:
                    durs.setdefault(key, []).append(e["dur"])
    return {k: statistics.mean(v) for k, v in durs.items()}


def run(variant: str, nodes: int, calls: int) -> str:
    import jax
    import jax.numpy as jnp
    import numpy as np

    f = build(nodes, variant.endswith("output"))
    fresh = variant != "stable"
    state = jnp.zeros((4096,), jnp.float32)
    feed = jnp.asarray(np.arange(8, dtype=np.int32))
    host_feed = np.arange(8, dtype=np.int32)

    def call(state):
        out = f(state, jnp.asarray(host_feed) if fresh else feed)
        return out[0] if isinstance(out, tuple) else out

    for _ in range(5):
        state = call(state)
    jax.block_until_ready(state)
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            state = call(state)
        jax.block_until_ready(state)
        walls.append((time.perf_counter() - t0) / calls * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(50):
                state = call(state)
            jax.block_until_ready(state)
        ev = host_events(tmp)
    return (f"{variant:22s} wall/call {statistics.median(walls):8.1f} us   cuGraphLaunch "
            f"{ev.get('cuGraphLaunch', float('nan')):8.1f} us   ExecuteThunks "
            f"{ev.get('ExecuteThunks', float('nan')):8.1f} us")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=350)
    p.add_argument("--calls", type=int, default=500)
    args = p.parse_args()
    if accepted(FLAG):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip()
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.nodes} kernels per "
          f"program, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    for variant in ("stable", "fresh feed", "fresh feed + output"):
        print(run(variant, args.nodes, args.calls), flush=True)


if __name__ == "__main__":
    main()
