"""Micro-benchmark of the step-form GDN verify / commit: XLA reference (rolled and unrolled
scan) against the Pallas (Triton) kernel, at the Qwen3.5 shapes (Dk = Dv = 128; value heads
H = 16 (2B), 32 (35B-A3B), 48 (27B)).

Each timed call runs the op on R independent copies (like R layers) and calls are issued
back to back, so that launch overhead is hidden and, where R * state > L2 (50 MB), the state comes from HBM; R is printed and ``l2``
marks cases whose copies fit in L2 (their times are optimistic). ``maxerr`` is the largest
|difference| from the first implementation of the line group (the unrolled XLA reference). Bytes per op call:
verify = state read + inputs (q, k, v, g, beta) + o written; commit = state read + written +
inputs. ``frac`` = (bytes / time) / 4.2 TB/s.

    PYTHONPATH=. python3 scripts/bench_gdn.py [--quick] [--sweep]

``--sweep`` also times the kernel over (block_v, num_warps) at H=48 (takes ~1 min more).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gdn.pallas import default_tiling, gdn_commit_pallas, gdn_verify_pallas
from pallas_kernels.gdn.reference import gdn_recurrent_reference

HBM_BYTES_PER_S = 4.2e12
L2_BYTES = 50e6
D = 128


def _inputs(key, b, t, h):
    ks = jax.random.split(key, 6)
    l2 = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    return (l2(jax.random.normal(ks[0], (b, t, h, D))) * D ** -0.5,
            l2(jax.random.normal(ks[1], (b, t, h, D))),
            jax.random.normal(ks[2], (b, t, h, D)),
            -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h))),
            jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h))),
            jax.random.normal(ks[5], (b, h, D, D)) * 0.3)


def _ops(block_v=None, num_warps=None):
    """name -> (verify fn, commit fn), each on one copy's 6 arrays."""
    tile = dict(block_v=block_v, num_warps=num_warps,
                interpret=jax.default_backend() != "gpu")  # interpret: CPU smoke runs only
    ref = lambda unroll, i: (lambda *a: gdn_recurrent_reference(*a, unroll=unroll)[i])
    return {
        "xla_rolled": (ref(1, 0), ref(1, 1)),
        "xla_unrolled": (ref(True, 0), ref(True, 1)),
        "pallas": (functools.partial(gdn_verify_pallas, **tile),
                   functools.partial(gdn_commit_pallas, **tile)),
    }


def _time(fn, copies, n_iter, donate, trials=5):
    """Seconds per call of ``fn`` over all copies: median over ``trials`` of the mean of
    ``n_iter`` back-to-back calls (dispatch overlaps the GPU work, so small cases are not
    dominated by Python). Commit feeds its donated states back in. Returns (seconds, first
    call's outputs)."""
    if donate:
        step = jax.jit(lambda xs, ss: [fn(*x, s) for x, s in zip(xs, ss)], donate_argnums=1)
        inputs = [c[:5] for c in copies]
        state = [[jnp.copy(c[5]) for c in copies]]
        first = [jnp.copy(s) for s in jax.block_until_ready(step(inputs, state[0]))]
        state[0] = jax.block_until_ready(step(inputs, [jnp.copy(c[5]) for c in copies]))

        def call():
            state[0] = step(inputs, state[0])
            return state[0]
    else:
        step = jax.jit(lambda cs: [fn(*c) for c in cs])
        first = jax.block_until_ready(step(copies))
        call = lambda: step(copies)
    jax.block_until_ready(call())
    per = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(n_iter):
            out = call()
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / n_iter)
    return statistics.median(per), first


def _bytes(b, t, h, commit):
    state = b * h * D * D * 4
    inputs = 4 * b * t * h * (3 * D + 2)
    return (2 * state if commit else state + 4 * b * t * h * D) + inputs


def _case(b, h, t, n_iter, impls, tiling=None):
    state_bytes = b * h * D * D * 4
    r = max(1, min(8, math.ceil(128e6 / state_bytes)))
    keys = jax.random.split(jax.random.key(b * 1000 + h * 10 + t), r)
    copies = [_inputs(k, b, t, h) for k in keys]
    where = "l2" if r * state_bytes < L2_BYTES else "hbm"
    ops = _ops(*(tiling or (None, None)))
    bv, nw = tiling or default_tiling(b, h, D)
    for op_i, op in enumerate(("verify", "commit")):
        nbytes = _bytes(b, t, h, op == "commit")
        ref = None if impls[0].startswith("xla") else jax.jit(
            lambda *a: gdn_recurrent_reference(*a)[op_i])(*copies[0])
        for name in impls:
            sec, out = _time(ops[name][op_i], copies, n_iter, op == "commit")
            ref = out[0] if ref is None else ref  # the first (XLA) impl is the check
            err = float(jnp.max(jnp.abs(out[0] - ref)))
            tile = f" bv={bv} warps={nw}" if name == "pallas" else ""
            per = sec / r
            print(f"{op:6s} {name:12s} B={b:2d} H={h:2d} T={t} R={r} {where:3s} "
                  f"{per * 1e6:9.2f} us  {nbytes / 1e6:8.2f} MB  "
                  f"{nbytes / per / 1e9:7.1f} GB/s  frac={nbytes / per / HBM_BYTES_PER_S:5.3f}  "
                  f"maxerr={err:.1e}{tile}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="H=48, B in {1, 32}, T=4 only")
    ap.add_argument("--sweep", action="store_true", help="also sweep block_v x num_warps")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    start = time.perf_counter()
    heads, batches, rows = ((48,), (1, 32), (4,)) if args.quick else ((16, 32, 48), (1, 8, 32),
                                                                      (1, 4))
    for h, b, t in itertools.product(heads, batches, rows):
        impls = ("xla_unrolled", "pallas") if t == 1 else ("xla_unrolled", "xla_rolled", "pallas")
        _case(b, h, t, args.iters, impls)
    if args.sweep:
        print("--- sweep (pallas, H=48, T=4)", flush=True)
        for b in (1, 8, 32):
            for bv, nw in itertools.product((16, 32, 64), (2, 4, 8)):
                _case(b, 48, 4, args.iters, ("pallas",), tiling=(bv, nw))
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
