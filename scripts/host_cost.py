"""Where the host's time of a decode round goes (GPU helper; not part of the test suite).

Builds a bench engine (random weights of ``--config``, one request of ``--prompt-len`` tokens,
``--k``), then measures, in milliseconds per round (medians of ``--rounds``):

* ``serial``: rounds run one at a time, each split into ``batch`` (the host builds the round's
  batch: :meth:`Engine._round_batch`), ``pack`` (one int32 buffer), ``dispatch`` (the compiled
  program's call returns), ``wait`` (until the result is on the device), ``readback`` (the one
  device-to-host copy) and ``apply`` (the rest of :meth:`Engine._collect`);
* ``raw``: the compiled program called back to back with the same batch buffer (numpy, on the
  device, or put on the device before each call) and its own output pools, no engine Python
  (host dispatch only, and the interval per round once the device is the bottleneck);
* ``pipelined``: :func:`mtp_jax.bench.run.pipelined_rounds` as the bench runs it (round and
  host times), then the same under ``cProfile`` (the top functions by own time).

Usage:
    PYTHONPATH=. python scripts/host_cost.py --config configs/Qwen3.5-2B.json --k 0 [--pack-small-params]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import jax
import numpy as np

from mtp_jax.bench.floor import load_config
from mtp_jax.bench.run import Ledger, Settings, make_engine, pipelined_rounds, prefill_all, requests
from mtp_jax.engine.packing import pack
from mtp_jax.kernels import OPS, add_backend_flags
from mtp_jax.models.loader import load_model


def ms(xs) -> str:
    return f"{statistics.median(xs) * 1e3:7.3f}"


def serial(eng, reqs, rounds: int) -> dict:
    parts = {n: [] for n in ("batch", "pack", "dispatch", "wait", "readback", "apply")}
    for _ in range(rounds):
        t0 = time.perf_counter()
        batch, snapshot = eng._round_batch(reqs, 0)
        t1 = time.perf_counter()
        buf, spec = pack(batch)
        t2 = time.perf_counter()
        f = eng._dispatch_round(reqs)  # includes batch + pack again: subtracted below
        t3 = time.perf_counter()
        jax.block_until_ready(f.out.readback)
        t4 = time.perf_counter()
        np.asarray(f.out.readback)
        t5 = time.perf_counter()
        eng._collect(f)
        t6 = time.perf_counter()
        parts["batch"].append(t1 - t0)
        parts["pack"].append(t2 - t1)
        parts["dispatch"].append(max(0.0, (t3 - t2) - (t2 - t0)))
        parts["wait"].append(t4 - t3)
        parts["readback"].append(t5 - t4)
        parts["apply"].append(t6 - t5)
    return parts


def raw(eng, reqs, rounds: int) -> dict:
    batch, _ = eng._round_batch(reqs, 0)
    buf, spec = pack(batch)
    table = eng.programs.executables
    key = next(k for k in table._compiled if k[0] == "round")
    fn = table._compiled[key][0]
    leaves, pools = eng._leaves, eng.pools
    dev_buf = jax.device_put(buf)
    out = {"dispatch_np": [], "dispatch_dev": [], "dispatch_put": [], "interval": []}
    for name, b in (("dispatch_np", buf), ("dispatch_dev", dev_buf), ("dispatch_put", None)):
        jax.block_until_ready(pools)
        t_start = time.perf_counter()
        for _ in range(rounds):
            t0 = time.perf_counter()
            res, pools = fn(leaves, pools, jax.device_put(buf) if b is None else b)
            out[name].append(time.perf_counter() - t0)
        jax.block_until_ready(pools)
        out["interval"].append((time.perf_counter() - t_start) / rounds)
    eng.pools = pools
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pack-small-params", action="store_true")
    add_backend_flags(p)
    args = p.parse_args()
    cfg = load_config(args.config)
    model = load_model(cfg=cfg, dtype=args.dtype, dummy_weight=True, with_mtp=args.k > 0,
                       pack_small_params=args.pack_small_params,
                       **{f"{op}_backend": getattr(args, f"{op}_backend") for op in OPS})
    s = Settings(prompt_len=args.prompt_len, decode_tokens=4 * args.rounds, max_k=args.k)
    eng = make_engine(model, 1, args.k, s)
    reqs = requests(1, s.prompt_len, 10**9, cfg.vocab_size, 0)
    prefill_all(eng, reqs, Ledger(), "warmup", None)
    for _ in range(5):
        eng._run_round(reqs)
    n_args = len(jax.tree_util.tree_leaves((eng._leaves, eng.pools)))
    print(f"{args.config} k={args.k} pack_small_params={args.pack_small_params}: "
          f"{len(jax.tree_util.tree_leaves(eng._leaves))} parameter buffers, "
          f"{len(jax.tree_util.tree_leaves(eng.pools))} pool buffers ({n_args} in all)")
    parts = serial(eng, reqs, args.rounds)
    print("serial (ms, median):", "  ".join(f"{n} {ms(v)}" for n, v in parts.items()))
    r = raw(eng, reqs, args.rounds)
    print(f"raw: dispatch with numpy batch {ms(r['dispatch_np'])}, with device batch "
          f"{ms(r['dispatch_dev'])}, with device_put per call {ms(r['dispatch_put'])}; "
          "interval " + " / ".join(f"{x * 1e3:.3f}" for x in r["interval"]) + " ms per call")
    run = pipelined_rounds(eng, reqs, lambda got: len(got) >= args.rounds)
    print(f"pipelined: round {ms(run['times'])} ms, host {ms(run['host'])} ms")
    prof = cProfile.Profile()
    prof.enable()
    run = pipelined_rounds(eng, reqs, lambda got: len(got) >= args.rounds)
    prof.disable()
    print(f"pipelined under cProfile: round {ms(run['times'])} ms, host {ms(run['host'])} ms")
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
