"""Micro-benchmark of the fused add + RMSNorm + one-row projection (+ SwiGLU) kernel against the
kernels it replaces (GPU helper).

For each decode-step shape (the MLP's gate/up with SwiGLU; the mixers' in-projections), runs
16 chained layers (each layer's ``delta`` is the previous layer's first K outputs, as a decode
step feeds the next layer) with distinct weights (beyond the 50 MB L2), as:

* ``chain``: ``add_rms_norm`` (Pallas), the multiply-reduce projection (XLA), ``silu * up``
  (XLA): the engine's 2B decode path before this kernel;
* ``fused``: :func:`pallas_kernels.gemv.norm_gemv.norm_gemv` with a sweep of tiles.

Reports the device time per layer (the sum of a call's kernels from a ``jax.profiler`` trace,
per layer) and the wall time per layer of 50 pipelined calls (includes the gaps between
kernels), and the max relative error of the fused result against the chain.

Usage: PYTHONPATH=. python scripts/bench_norm_gemv.py [--shapes 2b,27b] [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemv import kernel_us  # noqa: E402

from pallas_kernels.gemv import reduce_matmul  # noqa: E402
from pallas_kernels.gemv.norm_gemv import NormGemvTiles, norm_gemv  # noqa: E402
from pallas_kernels.norm import add_rms_norm  # noqa: E402

SHAPES = {"2b": [("2B gate_up+silu", 12288, 2048, "silu_mul"), ("2B gdn_in", 8224, 2048, None)],
          "2b_qkv": [("2B attn_qkv", 5120, 2048, None)],
          "27b": [("27B gate_up+silu", 34816, 5120, "silu_mul"),
                  ("27B gdn_in", 16480, 5120, None)]}
REPS = 16
EPS = 1e-6


def chain_layer(x, d, nw, w, act):
    h, hn = add_rms_norm(x, d, nw, EPS, backend="pallas")
    p = reduce_matmul(hn, w)
    if act == "silu_mul":
        i = w.shape[0] // 2
        p = jax.nn.silu(p[..., :i]) * p[..., i:]
    return h, p


def fused_layer(tiles):
    return lambda x, d, nw, w, act: norm_gemv(x, d, nw, w, EPS, act=act, tiles=tiles)


def program(layer, act):
    def run(x, d, nws, ws):
        ys = []
        for nw, w in zip(nws, ws):
            x, y = layer(x, d, nw, w, act)
            d = y[..., :x.shape[-1]]
            ys.append(y)
        return x, ys
    return jax.jit(run)


def tile_sweep(out: int, k: int, quick: bool):
    ts = [NormGemvTiles(bn, bk, nwarps, pre, red) for bn in (8, 16) for bk in (512, 1024)
          for nwarps in (4, 8) for pre in (0, 1) for red in (False, True)]
    if quick:
        ts = [t for t in ts if t.bk == 1024 and t.num_warps == 4]
    return [t for t in ts if out % t.bn == 0 and k % t.bk == 0 and t.bn * t.bk <= 16384]


def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def measure(f, args, calls=50):
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = f(*args)
    jax.block_until_ready(out)
    wall = (time.perf_counter() - t0) / calls / REPS * 1e6
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(4):
                out = f(*args)
            jax.block_until_ready(out)
        times = kernel_us(tmp, stat=sum)
    dev = sum(us for us, _ in times.values()) / 4 / REPS
    return wall, dev, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="2b")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for name, n, k, act in [s for key in args.shapes.split(",") for s in SHAPES[key]]:
        key = jax.random.key(n + k)
        rnd = lambda i, shape, s=1.0: (jax.random.normal(jax.random.fold_in(key, i), shape)
                                       * s).astype(jnp.bfloat16)
        ws = [rnd(i, (n, k), k ** -0.5) for i in range(REPS)]
        nws = [rnd(100 + i, (k,), 0.1) for i in range(REPS)]
        x, d = rnd(200, (1, k)), rnd(201, (1, k))
        out = n // 2 if act else n
        base = program(chain_layer, act)
        ref = base(x, d, nws, ws)
        wall, dev, times = measure(base, (x, d, nws, ws))
        print(f"{name} N={n} K={k} ({n * k * 2 / 1e6:.1f} MB/layer):\n"
              f"  chain      wall {wall:6.2f} us  device {dev:6.2f} us  "
              f"({len(times)} kernel names)", flush=True)
        rows = []
        for t in tile_sweep(out, k, args.quick):
            try:
                f = program(fused_layer(t), act)
                got = f(x, d, nws, ws)
                err = max(rel_err(a, b) for a, b in zip(got[1], ref[1]))
                wall, dev, _ = measure(f, (x, d, nws, ws))
                rows.append((wall, dev, t, err))
            except Exception as e:  # noqa: BLE001 - report and go on with the sweep
                print(f"  {t}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        for wall, dev, t, err in sorted(rows, key=lambda r: r[0])[:8]:
            print(f"  fused bn={t.bn:2d} bk={t.bk:4d} w={t.num_warps} pre={int(t.preload)} "
                  f"red={int(t.reduce_each)} wall {wall:6.2f} us  device {dev:6.2f} us  "
                  f"err {err:.1e}", flush=True)
        del ws


if __name__ == "__main__":
    main()
