"""``python -m mtp_jax.bench.hyper_mix``: qwen4_exp's hyper-connection mix, XLA against the
Pallas kernels (:mod:`pallas_kernels.hyper`), at Flash-Next's shape (4 streams of 2560, rank
320) or a given one; microseconds per mix (device time on a GPU, wall time elsewhere).

A program chains ``--layers`` mixes over distinct weights (beyond the 50 MB L2 at the default
shape), each mix's pending inject being the previous mix's outputs, as a decoder layer folds
it in. Time: on a GPU the kernels' device time per mix from a profiler trace
(:func:`mtp_jax.bench.timing.device_seconds`), elsewhere the wall time (interpret mode: a
smoke run only). ``max_diff``: the largest |kernels - XLA| of the chain's outputs (bf16: a
few units in the last place of values up to about 10); ``first_s``: the kernels' first call
(compile and run), in wall seconds. Each row records the shape, the JAX backend and the timing
(``device`` or ``wall``). Prints one dict per row and writes ``hyper_mix.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench.timing import device_seconds, wall_seconds
from pallas_kernels.hyper import (HyperTiles, default_tiles, hyper_mix, hyper_mix_reference,
                                  unsupported)


def _weights(rng, layers: int, hc: int, hidden: int, r: int, dtype):
    f = lambda *s, sc: jnp.asarray(sc * rng.standard_normal(s).astype(np.float32), dtype)
    w = hc * hidden
    return [(f(w, sc=0.3), f(r, w, sc=0.02), f(hc, w, sc=0.02), f(w, r, sc=0.1))
            for _ in range(layers)]


def chain(mix):
    """A jitted chain of ``mix(h, pending, nw, w_down, w_inj, w_up) -> (h, x, inj)`` calls."""
    @jax.jit
    def run(h, y, inj, weights):
        pending = (inj, y)
        for nw, wd, wi, wu in weights:
            h, x, inj = mix(h, pending, nw, wd, wi, wu)
            pending = (inj, x)
        return h, pending[1]
    return run


def run_rows(rows: int, tiles: list[HyperTiles], *, hc: int, hidden: int, r: int,
             layers: int, seed: int = 0) -> list[dict]:
    """One row for XLA and one per tile choice at ``rows`` rows."""
    rng = np.random.default_rng(seed)
    dt = jnp.bfloat16
    weights = _weights(rng, layers, hc, hidden, r, dt)
    f = lambda *s, sc=1.0: jnp.asarray(sc * rng.standard_normal(s).astype(np.float32), dt)
    args = (f(rows, hc * hidden, sc=2.0), f(rows, hidden), f(rows, hc, sc=0.5), weights)
    on_gpu = jax.default_backend() == "gpu"
    timer = device_seconds if on_gpu else (lambda call: wall_seconds(call, reps=1))
    ref_fn = chain(lambda h, p, *w: hyper_mix_reference(h, p, *w, hc=hc, eps=1e-6))
    ref = ref_fn(*args)
    common = dict(rows=rows, hc=hc, hidden=hidden, rank=r, layers=layers,
                  backend=jax.default_backend(), timing="device" if on_gpu else "wall")
    out = [dict(common, variant="xla",
                us=round(1e6 * timer(lambda: ref_fn(*args)) / layers, 2))]
    for t in tiles:
        fn = chain(lambda h, p, *w, t=t: hyper_mix(h, p, *w, hc=hc, eps=1e-6, tiles=t))
        t0 = time.perf_counter()
        got = fn(*args)
        first = time.perf_counter() - t0
        diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                   for a, b in zip(got, ref))
        out.append(dict(common, variant="pallas", tiles=t._asdict(), max_diff=diff,
                        first_s=round(first, 1),
                        us=round(1e6 * timer(lambda fn=fn: fn(*args)) / layers, 2)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench.hyper_mix",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8],
                   help="rows per call, each a row of the table (1 to 8; default 1 4 8)")
    p.add_argument("--hc", type=int, default=4, help="streams (default %(default)s)")
    p.add_argument("--hidden", type=int, default=2560,
                   help="width of a stream (default %(default)s)")
    p.add_argument("--rank", type=int, default=320,
                   help="the mix's low rank, hc_lowrank (default %(default)s)")
    p.add_argument("--layers", type=int, default=16, help="mixes chained (default 16)")
    p.add_argument("--tiles", nargs="*", default=[], metavar="K=V,...",
                   help="tile choices beside the default, e.g. bn=2 bj=16,warps_b=2 "
                        "(pallas_kernels.hyper.HyperTiles)")
    p.add_argument("--out", default=os.environ.get("OUT", "."),
                   help="folder for hyper_mix.json (default $OUT or the current folder)")
    a = p.parse_args(argv)
    for n in a.rows:
        why = unsupported(n, a.hc, a.hidden, a.rank)
        if why:
            p.error(f"the kernels cannot take this shape: {why}")
    base = default_tiles(a.hidden, a.rank)
    tiles = [base] + [base._replace(**{k: int(v) for k, v in
                                       (kv.split("=") for kv in spec.split(","))})
                      for spec in a.tiles]
    rows = []
    for n in a.rows:
        for row in run_rows(n, tiles, hc=a.hc, hidden=a.hidden, r=a.rank, layers=a.layers):
            print(row, flush=True)
            rows.append(row)
    os.makedirs(a.out, exist_ok=True)
    json.dump(rows, open(os.path.join(a.out, "hyper_mix.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
