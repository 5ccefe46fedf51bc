"""Micro-benchmark of the small per-layer kernels of a batch-1 decode step (GPU machine helper;
not part of the test suite): device time per call from ``jax.profiler``, so that launch and
dispatch costs do not count.

* the fused GDN conv (``gdn_conv_rows`` with the window write) and decode step (``gdn_step``,
  ``mode="decode"``) at the Qwen3.5-2B (Hv 16, Hk 16), Qwen3.6-35B-A3B (32, 16) and 27B (48,
  16) shapes, over ``block_v`` x ``num_warps`` of the step;
* the fused residual add + RMSNorm (``add_rms_norm_pallas``) at hidden 2048;
* the one-kernel GDN decode on a ring conv state (``gdn_decode_ring``) over ``block_v`` x
  ``num_warps``, to set against the two kernels above;
* the attention layer's prep kernel (``qk_norm_rope_write``: q/k norms, RoPE, K/V writes) at
  the three head layouts, T = 1 (decode) and 4 (a k = 3 verify), one program per kv head
  and one per head row (``split_heads``, the default).

Each timed program runs ``--copies`` independent calls (like that many layers back to back);
the time is the traced kernel time summed over one program call, over the copies.

    PYTHONPATH=. python3 scripts/bench_small_kernels.py [--copies 8] [--parts ring prep]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gemv import device_us  # noqa: E402  (scripts/, this script's folder)

from pallas_kernels.gdn.fused import gdn_conv_rows, gdn_step  # noqa: E402
from pallas_kernels.gdn.fused_decode import gdn_decode_ring  # noqa: E402
from pallas_kernels.norm.add_rms import add_rms_norm_pallas  # noqa: E402
from pallas_kernels.paged_attention.pallas import padded_query_rows  # noqa: E402
from pallas_kernels.paged_attention.prep import qk_norm_rope_write  # noqa: E402

D = 128
KERNEL = 4
PARTS = ("norm", "prep", "ring", "gdn")
SHAPES = {"2B": (16, 16), "35B": (32, 16), "27B": (48, 16)}  # name -> (Hv, Hk)


def _gdn_inputs(name: str, copies: int, batch: int, window_cols: int) -> dict:
    """Random inputs of ``copies`` GDN layers at a shape: the merged in-projection's output
    ``proj [copies, B, 1, N]`` (``[qkv | z | b | a]``), the conv weight, the window and state
    pools (``B + 1`` slots, ``window_cols`` columns), the gates' parameters, and the column
    offsets of ``b`` and ``a``."""
    hv, hk = SHAPES[name]
    c = 2 * hk * D + hv * D
    n = c + hv * D + 2 * hv
    ks = jax.random.split(jax.random.key(0), 6)
    return dict(
        hv=hv, hk=hk, cols={"a_col": c + hv * D + hv, "b_col": c + hv * D},
        proj=jax.random.normal(ks[0], (copies, batch, 1, n), jnp.bfloat16),
        weight=jax.random.normal(ks[1], (c, KERNEL), jnp.bfloat16) * 0.5,
        window=jax.random.normal(ks[2], (copies, batch + 1, c, window_cols), jnp.bfloat16),
        state=jax.random.normal(ks[3], (copies, batch + 1, hv, D, D), jnp.float32) * 0.3,
        a_log=jax.random.normal(ks[4], (hv,), jnp.float32),
        dt_bias=jax.random.normal(ks[5], (hv,), jnp.float32),
        slot=jnp.arange(batch, dtype=jnp.int32) + 1, valid=jnp.ones((batch, 1), bool))


def _time_layers(label: str, x: dict, copies: int, layer, tilings):
    """Device time per layer of ``layer(proj, window, state, block_v, num_warps) -> (o,
    window, state)`` over ``tilings``; yields ``(block_v, num_warps, times)``, skipping (with a
    line) tilings that do not compile."""
    for block_v, num_warps in tilings:
        @functools.partial(jax.jit, donate_argnums=(1, 2))
        def run(p, win, st, block_v=block_v, num_warps=num_warps):
            outs = [layer(p[i], win[i], st[i], block_v, num_warps) for i in range(copies)]
            return ([o for o, _, _ in outs], jnp.stack([w for _, w, _ in outs]),
                    jnp.stack([s for _, _, s in outs]))

        def call(p, win, st, run=run):
            return run(p, jnp.copy(win), jnp.copy(st))
        try:
            times = device_us(call, (x["proj"], x["window"], x["state"]))
        except Exception as e:  # noqa: BLE001 - a tiling may not compile
            print(f"{label} block_v {block_v} warps {num_warps}: failed "
                  f"{type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        yield block_v, num_warps, times


def gdn_case(name: str, copies: int, batch: int = 1):
    """The conv kernel with the window write, then the fused decode step, per layer."""
    x = _gdn_inputs(name, copies, batch, KERNEL - 1)
    length = jnp.ones((batch,), jnp.int32)

    def layer(p, win, st, block_v, num_warps):
        conv, win = gdn_conv_rows(p, x["weight"], win, x["slot"], length)
        o, st = gdn_step(conv, p, p, x["a_log"], x["dt_bias"], x["valid"], st, x["slot"],
                         num_k_heads=x["hk"], mode="decode", block_v=block_v,
                         num_warps=num_warps, **x["cols"])
        return o, win, st

    tilings = [(bv, nw) for bv in (16, 32, 64, 128) for nw in (4, 8)]
    for block_v, num_warps, times in _time_layers(f"{name} B={batch}", x, copies, layer,
                                                   tilings):
        step = sum(us for k, us in times.items() if k.startswith("gdn_fused")) / copies
        conv = sum(us for k, us in times.items() if k.startswith("gdn_conv")) / copies
        print(f"{name} B={batch} Hv={x['hv']} block_v {block_v:3d} warps {num_warps}: step "
              f"{step:5.2f} us, conv {conv:5.2f} us per layer", flush=True)


def ring_case(name: str, copies: int, batch: int = 1):
    """``gdn_decode_ring`` (conv on a ring window, gates, recurrence: one kernel) per layer."""
    x = _gdn_inputs(name, copies, batch, KERNEL)
    start = jnp.full((batch,), 1029, jnp.int32)

    def layer(p, win, st, block_v, num_warps):
        o, st, win = gdn_decode_ring(p, x["weight"], win, p, p, x["a_log"], x["dt_bias"],
                                     x["valid"], st, x["slot"], start, num_k_heads=x["hk"],
                                     block_v=block_v, num_warps=num_warps, **x["cols"])
        return o, win, st

    tilings = [(bv, nw) for bv in (16, 32, 64) for nw in (2, 4)]
    for block_v, num_warps, times in _time_layers(f"{name} ring B={batch}", x, copies, layer,
                                                   tilings):
        us = sum(v for k, v in times.items() if k.startswith("gdn_fused_decode_ring"))
        print(f"{name} ring B={batch} Hv={x['hv']} block_v {block_v:3d} warps {num_warps}: "
              f"{us / copies:5.2f} us per layer (conv + step in one kernel)", flush=True)


def norm_case(copies: int, hidden: int = 2048):
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (copies, 1, hidden), jnp.bfloat16)
    d = jax.random.normal(ks[1], (copies, 1, hidden), jnp.bfloat16)
    w = jax.random.normal(ks[2], (hidden,), jnp.bfloat16) * 0.1

    @jax.jit
    def run(x, d):
        h = x[0]
        outs = []
        for i in range(copies):  # chained, as in a model: each norm's sum feeds the next
            h, y = add_rms_norm_pallas(h, d[i], w, 1e-6)
            outs.append(y)
        return h, outs
    times = device_us(run, (x, d))
    us = sum(t for k, t in times.items() if k.startswith("add_rms")) / copies
    print(f"add_rms_norm hidden {hidden}: {us:5.2f} us per call", flush=True)


ATTENTION = {"2B": (8, 2), "35B": (16, 2), "27B": (24, 4)}  # name -> (Hq, Hkv), head dim 256


def prep_case(name: str, copies: int, t: int, batch: int = 1, page_size: int = 16,
              split_heads: bool = False):
    hq, hkv = ATTENTION[name]
    d, pages = 256, 96
    ks = jax.random.split(jax.random.key(2), 4)
    qkv = jax.random.normal(ks[0], (copies, batch, t, 2 * hq * d + 2 * hkv * d), jnp.bfloat16)
    w = jax.random.normal(ks[1], (2, d), jnp.bfloat16) * 0.1
    pool = jax.random.normal(ks[2], (copies, 1 + batch * pages, page_size, hkv, d),
                             jnp.bfloat16)
    table = (1 + jnp.arange(batch * pages, dtype=jnp.int32)).reshape(batch, pages)
    pos = 1000 + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (batch, t))
    valid = jnp.ones((batch, t), bool)
    rows = padded_query_rows(t, hq // hkv)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def run(qkv, kp, vp):
        outs = [qk_norm_rope_write(qkv[i], w[0], w[1], pos, valid, table, kp[i], vp[i],
                                   num_heads=hq, rotary_dim=64, rope_theta=1e7, eps=1e-6,
                                   rows=rows, split_heads=split_heads)
                for i in range(copies)]
        return ([o[0] for o in outs], jnp.stack([o[1] for o in outs]),
                jnp.stack([o[2] for o in outs]))

    times = device_us(lambda q, k, v: run(q, jnp.copy(k), jnp.copy(v)), (qkv, pool, pool))
    us = sum(x for k, x in times.items() if k.startswith("attention_qk")) / copies
    print(f"prep {name} B={batch} T={t} split_heads={split_heads}: {us:5.2f} us per layer",
          flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    a = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    if "norm" in a.parts:
        norm_case(a.copies)
    if "prep" in a.parts:
        for name in ATTENTION:
            for t in (1, 4):
                for split in (False, True):
                    prep_case(name, a.copies, t, split_heads=split)
    for name in a.shapes:
        if "ring" in a.parts:
            ring_case(name, a.copies)
        if "gdn" in a.parts:
            gdn_case(name, a.copies)


if __name__ == "__main__":
    main()
