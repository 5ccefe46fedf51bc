"""Micro-benchmark of the fused GDN decode step (``gdn_decode``: one state read, output and new
state) against the verify + commit pair it replaces in a plain decode round, for the XLA
reference and the Pallas (Triton) kernels, at the Qwen3.5 shapes (Dk = Dv = 128, T = 1;
value heads H = 48 (27B; Hk 16) and 16 (2B; Hk 16); batch 1, 8, 32).

* ``decode``: :func:`pallas_kernels.gdn.api.gdn_decode`, state donated (in place);
* ``verify+commit``: ``gdn_verify`` then ``gdn_commit`` on the row masked as
  ``mtp_jax.models.layers.gdn.commit`` does (``g, beta`` zeroed where the commit length is 0,
  so XLA cannot merge the two), state donated.

Each timed call runs the op on R independent copies (like R layers, back to back, so launch
overhead is hidden); ``l2`` marks cases whose copies fit in the 50 MB L2 (optimistic times).
Times are per copy (per layer): median over trials of the mean of ``--iters`` calls.
Bytes per layer: decode = state read + written + q, k, v, g, beta + o; verify+commit = state
read twice and written once + inputs twice + o. ``frac`` = (bytes / time) / 4.2 TB/s;
``vs_vc`` = the verify+commit time of the same backend / this time. ``maxerr``: largest
|difference| of (o, state) from the XLA verify+commit; ``bitwise``: decode's state equals
the same backend's commit bit for bit.

    PYTHONPATH=. python3 scripts/bench_gdn_decode.py [--quick] [--iters N]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gdn import api
from pallas_kernels.gdn.pallas import default_tiling

HBM_BYTES_PER_S = 4.2e12
L2_BYTES = 50e6
D = 128
SHAPES = {48: 16, 16: 16}  # Hv -> Hk: 27B, 2B


def _inputs(key, b, h, hk):
    """One row per request: q, k at ``hk`` heads repeated to ``h``; length [B] (all 1)."""
    ks = jax.random.split(key, 6)
    l2 = lambda a: a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + 1e-6)
    rep = lambda a: jnp.repeat(a, h // hk, axis=2)
    return (rep(l2(jax.random.normal(ks[0], (b, 1, hk, D)))) * D ** -0.5,
            rep(l2(jax.random.normal(ks[1], (b, 1, hk, D)))),
            jax.random.normal(ks[2], (b, 1, h, D)),
            -jax.nn.softplus(jax.random.normal(ks[3], (b, 1, h))),
            jax.nn.sigmoid(jax.random.normal(ks[4], (b, 1, h))),
            jnp.ones((b,), jnp.int32),
            jax.random.normal(ks[5], (b, h, D, D)) * 0.3)


def _decode(backend):
    def fn(q, k, v, g, beta, length, state):
        return api.gdn_decode(q, k, v, g, beta, state, backend=backend)
    return fn


def _verify_commit(backend):
    def fn(q, k, v, g, beta, length, state):
        o = api.gdn_verify(q, k, v, g, beta, state, backend=backend)
        keep = (length > 0)[:, None, None]
        s = api.gdn_commit(q, k, v, jnp.where(keep, g, 0.0), jnp.where(keep, beta, 0.0), state,
                           backend=backend)
        return o, s
    return fn


def _time(fn, copies, n_iter, trials=5):
    """Seconds per call over all copies (states donated and fed back); returns (seconds,
    the first call's (o, state) of copy 0)."""
    step = jax.jit(lambda xs, ss: [fn(*x, s) for x, s in zip(xs, ss)], donate_argnums=1)
    inputs = [c[:6] for c in copies]
    first = jax.block_until_ready(step(inputs, [jnp.copy(c[6]) for c in copies]))[0]
    states = [[o_s[1] for o_s in step(inputs, [jnp.copy(c[6]) for c in copies])]]

    def call():
        out = step(inputs, states[0])
        states[0] = [o_s[1] for o_s in out]
        return out

    jax.block_until_ready(call())
    per = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(n_iter):
            out = call()
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / n_iter)
    return statistics.median(per), first


def _bytes(b, h, fused):
    state = b * h * D * D * 4
    inputs = 4 * b * h * (3 * D + 2)
    o = 4 * b * h * D
    return 2 * state + inputs + o if fused else 3 * state + 2 * inputs + o


def _case(b, h, hk, n_iter):
    state_bytes = b * h * D * D * 4
    r = max(1, min(8, math.ceil(128e6 / state_bytes)))
    keys = jax.random.split(jax.random.key(b * 1000 + h), r)
    copies = [_inputs(k, b, h, hk) for k in keys]
    where = "l2" if r * state_bytes < L2_BYTES else "hbm"
    bv, nw = default_tiling(b, h, D)
    ref = None
    for backend in ("xla", "pallas"):
        vc_sec, vc_out = _time(_verify_commit(backend), copies, n_iter)
        d_sec, d_out = _time(_decode(backend), copies, n_iter)
        ref = vc_out if ref is None else ref
        bitwise = bool(jnp.array_equal(d_out[1], vc_out[1]))
        for name, sec, out, fused in (("verify+commit", vc_sec, vc_out, False),
                                      ("decode", d_sec, d_out, True)):
            nbytes = _bytes(b, h, fused)
            per = sec / r
            err = max(float(jnp.max(jnp.abs(a - c))) for a, c in zip(out, ref))
            extra = f"  bitwise={bitwise}" if fused else ""
            tile = f" bv={bv} warps={nw}" if backend == "pallas" else ""
            print(f"{backend:6s} {name:13s} B={b:2d} Hv={h:2d} Hk={hk:2d} R={r} {where:3s} "
                  f"{per * 1e6:8.2f} us  {nbytes / 1e6:7.2f} MB  "
                  f"{nbytes / per / 1e9:7.1f} GB/s  frac={nbytes / per / HBM_BYTES_PER_S:5.3f}  "
                  f"vs_vc={vc_sec / sec:4.2f}x  maxerr={err:.1e}{extra}{tile}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Hv=48 (27B), B in {1, 32} only")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    start = time.perf_counter()
    heads, batches = ((48,), (1, 32)) if args.quick else ((48, 16), (1, 8, 32))
    for h, b in itertools.product(heads, batches):
        _case(b, h, SHAPES[h], args.iters)
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
