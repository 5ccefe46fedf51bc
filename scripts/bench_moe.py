"""Micro-benchmark of the routed MoE experts (GPU machine helper).

Times, per model shape and token count N, the XLA reference (N <= 8), the previous ``Experts``
code (``old``), the ``xla`` backend (and on request each of its forms) and the ``pallas`` backend:
median over trials of back-to-back calls that cycle through several routings (so that no
expert's weights stay in L2 from one call to the next), after compile and warm-up.

Bytes = weights of the distinct experts hit (3 H I each) + x read + y written; FLOPs = 6 H I per
(token, expert) pair. Floor = max(bytes / 4.2 TB/s, FLOPs / 783 TFLOP/s) (docs: shared/GPU.md).
``err`` = max |out - base| / max |base|, base = reference (N <= 8) else the ``xla`` backend.

Usage: PYTHONPATH=. python scripts/bench_moe.py [--quick] [--sweep] [--shapes a3b,flash]
       [--ns 1,4,8,32,128,1024,8192] [--variants ref,old,xla,pallas,xla_ragged,...]
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
from pallas_kernels.moe.pallas import MoeTiles, default_tiles  # noqa: E402
from pallas_kernels.moe.reference import moe_experts_reference  # noqa: E402

HBM_BPS, PEAK_FLOPS = 4.2e12, 783e12
SHAPES = {"a3b": (256, 8, 2048, 512),  # Qwen3.6-35B-A3B: E, top_k, H, I
          "flash": (512, 10, 2560, 640)}  # Qwen3.8-Flash-Next
NS = (1, 4, 8, 32, 128, 1024, 8192)
NUM_ROUTINGS = 4
DENSE_REWRITE_LIMIT = 16e9  # skip ragged-dot variants whose dense rewrite [E, P, H] is bigger


def old_experts(x, expert_ids, gate_up, down):
    """The previous ``Experts`` computation (gathered weights / ragged_dot of swapped axes)."""
    n, top_k = expert_ids.shape
    i = down.shape[-1]
    swiglu = lambda gu: jax.nn.silu(gu[..., :i]) * gu[..., i:]
    if n * top_k < gate_up.shape[0]:
        wgu, wd = gate_up[expert_ids], down[expert_ids]
        h = swiglu(jnp.einsum("nh,nkih->nki", x.astype(wgu.dtype), wgu))
        return jnp.einsum("nki,nkhi->nkh", h, wd)
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=gate_up.shape[0]).astype(jnp.int32)
    xs = x.astype(gate_up.dtype)[order // top_k]
    h = swiglu(jax.lax.ragged_dot(xs, jnp.swapaxes(gate_up, 1, 2), sizes))
    y = jax.lax.ragged_dot(h, jnp.swapaxes(down, 1, 2), sizes)
    return jnp.zeros_like(y).at[order].set(y).reshape(n, top_k, -1)


def sweep_tiles(n_pairs, e, h, i):
    """A few alternative tilings around the default one for this regime."""
    d = default_tiles(n_pairs, e, h, i)
    if d.bm == 16:
        alts = [d._replace(sort_pairs=not d.sort_pairs), d._replace(gu_bn=16, gu_bk=512),
                d._replace(gu_bn=64, gu_bk=128, dn_bn=128, dn_bk=64),
                d._replace(num_stages=3), d._replace(num_warps=2)]
    else:
        alts = [MoeTiles(64, 64, 64, 128, 64, 4, 3), MoeTiles(128, 64, 64, 128, 64, 8, 3),
                MoeTiles(128, 64, 32, 128, 32, 4, 4), MoeTiles(128, 128, 64, 128, 64, 8, 3),
                MoeTiles(64, 32, 128, 64, 128, 4, 3)]
    ok = lambda t: i % t.gu_bn == 0 and h % t.gu_bk == 0 and h % t.dn_bn == 0 and i % t.dn_bk == 0
    return [t for t in alts if t != d and ok(t)]


def time_calls(f, arg_sets, budget_s: float, trials: int) -> float:
    """Median seconds per call; each trial runs the argument sets back to back."""
    jax.block_until_ready(f(*arg_sets[0]))  # compile
    t = time.perf_counter()
    for a in arg_sets:
        out = f(*a)
    jax.block_until_ready(out)
    est = (time.perf_counter() - t) / len(arg_sets)
    reps = max(1, min(64, int(budget_s / trials / max(est, 1e-6) / len(arg_sets))))
    per_call = []
    for _ in range(trials):
        t = time.perf_counter()
        for _ in range(reps):
            for a in arg_sets:
                out = f(*a)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t) / (reps * len(arg_sets)))
    return statistics.median(per_call)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a3b only, N in 1, 8, 128, 8192")
    ap.add_argument("--sweep", action="store_true", help="also time alternative Pallas tiles")
    ap.add_argument("--shapes", default="a3b,flash")
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--variants", default="ref,old,xla,pallas",
                    help="comma list of ref, old, xla, xla_ragged, xla_few, xla_blocks, pallas")
    args = ap.parse_args()
    jax.config.update("jax_compilation_cache_dir", "/tmp/jax_cache_bench_moe")
    shapes = ["a3b"] if args.quick else args.shapes.split(",")
    ns = (1, 8, 128, 8192) if args.quick else tuple(int(v) for v in args.ns.split(","))
    variants = args.variants.split(",")
    trials, budget = (3, 0.1) if args.quick else (5, 0.2)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; floor = max(bytes / "
          f"{HBM_BPS / 1e12} TB/s, FLOPs / {PEAK_FLOPS / 1e12:.0f} TFLOP/s)", flush=True)
    key = jax.random.key(0)
    for shape in shapes:
        e, k, h, i = SHAPES[shape]
        kg, kd, key = jax.random.split(key, 3)
        gate_up = (jax.random.normal(kg, (e, 2 * i, h), jnp.float32) * h ** -0.5).astype(
            jnp.bfloat16)
        down = (jax.random.normal(kd, (e, h, i), jnp.float32) * i ** -0.5).astype(jnp.bfloat16)
        for n in ns:
            p = n * k
            arg_sets = []
            for r in range(NUM_ROUTINGS):
                kx, kr, key = jax.random.split(key, 3)
                ids = jax.lax.top_k(jax.random.uniform(kr, (n, e)), k)[1].astype(jnp.int32)
                x = jax.random.normal(kx, (n, h), jnp.float32).astype(jnp.bfloat16)
                arg_sets.append((x, ids, gate_up, down))
            hit = np.mean([np.unique(np.asarray(a[1])).size for a in arg_sets])
            nbytes = hit * 3 * h * i * 2 + n * h * 2 + p * h * 2
            flops = 6.0 * h * i * p
            floor = max(nbytes / HBM_BPS, flops / PEAK_FLOPS)
            cases = []
            if "ref" in variants and n <= 8:
                cases.append(("ref", moe_experts_reference))
            dense_rewrite = e * p * h * 2
            if "old" in variants and (p < e or dense_rewrite <= DENSE_REWRITE_LIMIT):
                cases.append(("old", old_experts))
            if "xla" in variants:
                cases.append(("xla", lambda *a: api.moe_experts(*a, backend="xla")))
            if "xla_ragged" in variants and dense_rewrite <= DENSE_REWRITE_LIMIT:
                cases.append(("xla_ragged", api.moe_experts_xla_ragged))
            if "xla_few" in variants and p <= 4 * e:
                cases.append(("xla_few", api.moe_experts_xla_few))
            if "xla_blocks" in variants:
                cases.append(("xla_blocks", api.moe_experts_xla_blocks))
            if "pallas" in variants:
                cases.append(("pallas", lambda *a: api.moe_experts(*a, backend="pallas")))
                if args.sweep:
                    for t in sweep_tiles(p, e, h, i):
                        cases.append((f"pallas{tuple(t)}", lambda *a, t=t: api.moe_experts(
                            *a, backend="pallas", tiles=t)))
            base = None
            for name, fn in cases:
                f = jax.jit(fn)
                try:
                    out = np.asarray(f(*arg_sets[0]), np.float32)
                    if base is None and name in ("ref", "xla"):
                        base = out
                    err = (np.abs(out - base).max() / np.abs(base).max()) if base is not None \
                        else float("nan")
                    sec = time_calls(f, arg_sets, budget, trials)
                except Exception as ex:  # noqa: BLE001 - report and go on with the next case
                    print(f"{shape} N={n:<5d} {name:12s} failed: {type(ex).__name__}: "
                          f"{str(ex)[:200]}", flush=True)
                    continue
                print(f"{shape} N={n:<5d} {name:12s} {sec * 1e6:10.1f} us  experts={hit:5.1f} "
                      f"{nbytes / 1e6:8.1f} MB  {nbytes / sec / 1e12:5.2f} TB/s "
                      f"({nbytes / sec / HBM_BPS:6.1%})  {flops / sec / 1e12:6.1f} TFLOP/s "
                      f"({flops / sec / PEAK_FLOPS:6.1%})  floor {floor / sec:6.1%}  "
                      f"err {err:.1e}", flush=True)
        del gate_up, down


if __name__ == "__main__":
    main()
