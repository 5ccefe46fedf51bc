"""Micro-benchmark of the few-pairs routed-experts kernels (decode / verify rows; GPU helper).

Qwen3.6-35B-A3B shape (E 256, top-8, H 2048, I 512, bf16). Per token count N, times the MoE
block's routed part ``[N, H] = sum_j w_j expert_j(x)`` as the model runs it:

* ``xla``: the ``xla`` backend (gather-reduce form below E pairs, blocks form at E and above)
  and, where that differs, ``xla_few`` (the gather-reduce form forced);
* ``few``: the ``pallas`` backend, i.e. the few-pairs kernels with the weighted sum fused;
* ``gate_up`` / ``down``: each few-pairs kernel alone (bytes: 2/3 and 1/3 of the experts');
* ``grouped`` (N = 32, and with ``--sweep``): the grouped-matmul kernel + XLA weighted sum;
* with ``--sweep``: ``few_pairs`` (the few-pairs kernels writing per-pair rows, weighted sum in
  XLA) and ``few`` with alternative tiles around the default, one line each.

About 50 s on an H200 (mostly compiles; a second run reuses /tmp/jax_cache_bench_moe_few),
``--quick`` about 20 s, ``--sweep`` adds about 25 s per N (use ``--ns``).

Each timed program runs the op ``--reps`` times back to back on distinct routings (chained by
``optimization_barrier`` so that XLA neither reorders nor merges them, as successive layers
would), so L2 holds no expert from one call to the next and host dispatch is off the clock;
the median over trials / reps is one call. Bytes = distinct experts hit x 3 H I x 2 B (per
kernel: its share) + x read + output written; fraction of 4.2 TB/s (shared/GPU.md). ``err`` =
max |out - ref| / max |ref|, ref = the XLA reference in float32 weighted by the routing weights.

Usage: PYTHONPATH=. python scripts/bench_moe_few.py [--quick] [--sweep] [--ns 1,4,8,32]
       [--reps 8] [--trials 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels.moe import api  # noqa: E402
from pallas_kernels.moe.few import (FewTiles, check_few_tiles, default_few_tiles,  # noqa: E402
                                    few_down, few_gate_up)
from pallas_kernels.moe.pallas import moe_experts_pallas  # noqa: E402
from pallas_kernels.moe.reference import moe_experts_reference  # noqa: E402

HBM_BPS = 4.2e12
E, K, H, I = 256, 8, 2048, 512  # Qwen3.6-35B-A3B routed experts
NS = (1, 4, 8, 32)


def weighted_sum(y, w):
    """``[N, top_k, H]``, ``[N, top_k]`` -> ``[N, H]`` in ``y.dtype`` (as ``Experts`` does)."""
    return jnp.sum(y.astype(jnp.float32) * w.astype(jnp.float32)[..., None], axis=1).astype(
        y.dtype)


def sweep_tiles(d: FewTiles) -> list[FewTiles]:
    """A few alternatives around the default tiles (valid at the A3B shape)."""
    alts = [d._replace(num_stages=3), d._replace(num_stages=5), d._replace(num_warps=2),
            d._replace(num_warps=8), d._replace(gu_bk=d.gu_bk * 2), d._replace(dn_bk=d.dn_bk // 2),
            d._replace(gu_bn=d.gu_bn * 2, gu_bk=max(64, d.gu_bk // 2)),
            d._replace(gu_bn=d.gu_bn // 2, gu_bk=d.gu_bk * 2),
            d._replace(dn_bh=d.dn_bh * 2, dn_bk=max(64, d.dn_bk // 2)),
            d._replace(dn_bh=d.dn_bh // 2, dn_bk=d.dn_bk * 2)]
    out = []
    for t in alts:
        try:
            check_few_tiles(t, H, I)
        except ValueError:
            continue
        if t != d and t not in out:
            out.append(t)
    return out


def chained(fn):
    """jit of ``fn`` applied to each routing in turn, each call after the previous one."""
    def run(xs, idss, ws, gu, dn):
        outs, prev = [], None
        for x, ids, w in zip(xs, idss, ws):
            if prev is not None:
                x, prev = jax.lax.optimization_barrier((x, prev))
            prev = fn(x, ids, w, gu, dn)
            outs.append(prev)
        return outs
    return jax.jit(run)


def time_call(f, args, trials: int) -> float:
    """Median seconds of one call of ``f(*args)`` over ``trials`` after compile and warm-up."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in 1, 4, 32; xla and few only")
    ap.add_argument("--sweep", action="store_true", help="also time alternative few tiles")
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--reps", type=int, default=8, help="calls (routings) per timed program")
    ap.add_argument("--trials", type=int, default=15)
    args = ap.parse_args()
    jax.config.update("jax_compilation_cache_dir", "/tmp/jax_cache_bench_moe_few")
    ns = (1, 4, 32) if args.quick else tuple(int(v) for v in args.ns.split(","))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; A3B E={E} top-{K} H={H} "
          f"I={I} bf16; {args.reps} chained calls per program; fraction of "
          f"{HBM_BPS / 1e12} TB/s", flush=True)
    t_start = time.perf_counter()
    kg, kd, key = jax.random.split(jax.random.key(0), 3)
    gu = (jax.random.normal(kg, (E, 2 * I, H), jnp.float32) * H ** -0.5).astype(jnp.bfloat16)
    dn = (jax.random.normal(kd, (E, H, I), jnp.float32) * I ** -0.5).astype(jnp.bfloat16)
    expert_bytes = 3 * H * I * 2
    for n in ns:
        p = n * K
        xs, idss, ws = [], [], []
        for _ in range(args.reps):
            kx, kr, key = jax.random.split(key, 3)
            probs = jax.nn.softmax(jax.random.normal(kr, (n, E)), axis=-1)
            w, ids = jax.lax.top_k(probs, K)
            xs.append(jax.random.normal(kx, (n, H), jnp.float32).astype(jnp.bfloat16))
            idss.append(ids.astype(jnp.int32))
            ws.append(w / jnp.sum(w, axis=-1, keepdims=True))
        hit = float(np.mean([np.unique(np.asarray(i)).size for i in idss]))
        ref = jax.lax.map(lambda a: moe_experts_reference(a[0][None], a[1][None], gu, dn)[0],
                          (xs[0], idss[0]))
        ref = np.einsum("nkh,nk->nh", np.asarray(ref, np.float32), np.asarray(ws[0]))
        tiles = default_few_tiles(p, n, H, I)
        io = n * H * 2 * 2  # x read + [N, H] written
        cases = [("xla", lambda x, i, w, g, d: api.moe_experts_weighted(x, i, w, g, d),
                  hit * expert_bytes + io, None)]
        if p >= E * api.FEW_PAIRS_PER_EXPERT:
            cases.append(("xla_few", lambda x, i, w, g, d: weighted_sum(
                api.moe_experts_xla_few(x, i, g, d), w), hit * expert_bytes + io, None))
        cases.append(("few", lambda x, i, w, g, d: api.moe_experts_weighted(
            x, i, w, g, d, backend="pallas"), hit * expert_bytes + io, None))
        if args.sweep:
            cases.append(("few_pairs", lambda x, i, w, g, d: weighted_sum(
                api.moe_experts(x, i, g, d, backend="pallas"), w), hit * expert_bytes + io, None))
        if not args.quick:
            cases += [
                ("gate_up", lambda x, i, w, g, d: few_gate_up(x, i, g, tiles),
                 hit * expert_bytes * 2 / 3 + n * H * 2 + p * I * 2, "skip"),
                ("down", lambda h, i, w, g, d: few_down(h, i, d, w, jnp.bfloat16, tiles),
                 hit * expert_bytes / 3 + p * I * 2 + n * H * 2, "h")]
            if n == 32 or args.sweep:
                cases.append(("grouped", lambda x, i, w, g, d: weighted_sum(
                    moe_experts_pallas(x, i, g, d), w),
                    hit * expert_bytes + io, None))
        if args.sweep:
            for t in sweep_tiles(tiles):
                cases.append((f"few{tuple(t)}", lambda x, i, w, g, d, t=t:
                              api.moe_experts_weighted(x, i, w, g, d, backend="pallas",
                                                       few_tiles=t),
                              hit * expert_bytes + io, None))
        print(f"N={n} pairs={p} experts hit {hit:.1f} (mean of {args.reps} routings), default "
              f"few tiles {tuple(tiles)}", flush=True)
        for name, fn, nbytes, special in cases:
            inputs = xs
            if special == "h":  # the down kernel alone reads the gate/up kernel's output
                inputs = [few_gate_up(x, i, gu, tiles) for x, i in zip(xs, idss)]
            f = chained(fn)
            try:
                out = f(inputs, idss, ws, gu, dn)[0]
                err = float("nan") if special == "skip" else float(
                    np.abs(np.asarray(out, np.float32) - ref).max() / np.abs(ref).max())
                sec = time_call(f, (inputs, idss, ws, gu, dn), args.trials) / args.reps
            except Exception as ex:  # noqa: BLE001 - report and go on with the next case
                print(f"  N={n:<3d} {name:12s} failed: {type(ex).__name__}: {str(ex)[:300]}",
                      flush=True)
                continue
            print(f"  N={n:<3d} {name:28s} {sec * 1e6:8.1f} us  {nbytes / 1e6:7.1f} MB  "
                  f"{nbytes / sec / 1e12:5.2f} TB/s ({nbytes / sec / HBM_BPS:6.1%})  "
                  f"err {err:.1e}", flush=True)
    print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
