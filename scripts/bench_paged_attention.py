"""Micro-benchmark: paged attention for decode / verify rows, XLA reference vs Pallas kernel.

Cases: head layouts of Qwen3.5-2B (8, 2), Qwen3.6-27B (24, 4) and Qwen3.6-35B-A3B (16, 2), head
dim 256, bf16, page size 16, x batch {1, 8, 32} x T {1, 4} x context {1024, 8192} (every
request holds ``context`` tokens; its T query rows are the last T positions). Page tables are
random permutations of the pool, as wide as the context, or as ``--table-len`` tokens with the
trash page 0 past the context (as in the engine, whose tables hold ``max_model_len``: the
reference reads the whole table, the kernel only up to the query positions).

Each timed call runs ``--unroll`` independent attention calls (different q) inside one jit;
ten such calls are dispatched back to back and blocked on at the end (``jax.block_until_ready``,
after a warm-up call), so host dispatch overlaps device work; the median over five repeats is
divided by ``--unroll``. "KV" is the K and V bytes the call must read (batch x context x Hkv
x D x 2 x 2 bytes); "frac" is that over the time, as a fraction of the H200's 4.2 TB/s. ``err``
is the kernel's largest difference from the reference.

  python scripts/bench_paged_attention.py [--quick] [--sweep] [--table-len 32768]

``--quick``: context 8192 and batch {1, 32} only. ``--sweep``: also time a few launch
parameter variants (block_keys, num_warps, num_stages, num_splits) on three cases.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.paged_attention.pallas import (  # noqa: E402
    choose_num_splits, paged_attention_pallas)
from pallas_kernels.paged_attention.reference import paged_attention_reference  # noqa: E402
from bench_gemv import device_us  # noqa: E402  (scripts/, this script's folder)

HBM_BYTES_PER_S = 4.2e12
HEAD_DIM = 256
CONFIGS = {"2B": (8, 2), "27B": (24, 4), "35B": (16, 2)}


def make_case(hq, hkv, batch, t, context, page_size, unroll, table_len, seed=0):
    """bf16 inputs: ``unroll`` query sets, pool, random-order page tables, last-T positions."""
    pages_per_req = -(-context // page_size)
    num_pages = batch * pages_per_req + 1  # page 0: the trash page
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    shape = (num_pages, page_size, hkv, HEAD_DIM)
    k_pages = jax.random.normal(kk, shape, jnp.bfloat16)
    v_pages = jax.random.normal(kv, shape, jnp.bfloat16)
    qs = jax.random.normal(kq, (unroll, batch, t, hq, HEAD_DIM), jnp.bfloat16)
    table = (jax.random.permutation(kp, num_pages - 1) + 1)[:batch * pages_per_req]
    table = table.reshape(batch, pages_per_req).astype(jnp.int32)
    width = max(pages_per_req, -(-table_len // page_size))
    table = jnp.pad(table, ((0, 0), (0, width - pages_per_req)))
    pos = jnp.broadcast_to(jnp.arange(context - t, context, dtype=jnp.int32), (batch, t))
    return qs, k_pages, v_pages, table, pos


def unrolled(fn):
    """``fn`` over each of the stacked query sets, in one jit."""
    @jax.jit
    def run(qs, k_pages, v_pages, table, pos):
        return [fn(qs[i], k_pages, v_pages, table, pos) for i in range(qs.shape[0])]
    return run


def time_call(run, args, calls=10, repeats=5):
    """Median seconds per ``run(*args)``: ``calls`` back-to-back dispatches (so host dispatch
    overlaps the device work), blocked at the end, over ``repeats``. Returns (seconds, output)."""
    out = jax.block_until_ready(run(*args))  # compile + warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = run(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times), out


def bench_case(name, batch, t, context, page_size, unroll, variants, table_len=0):
    hq, hkv = CONFIGS[name]
    args = make_case(hq, hkv, batch, t, context, page_size, unroll, table_len)
    kv_bytes = batch * context * hkv * HEAD_DIM * 2 * 2
    scale = HEAD_DIM ** -0.5
    ref = functools.partial(paged_attention_reference, scale=scale)
    t_ref, want = time_call(unrolled(ref), args)
    t_ref /= unroll
    max_blocks = -(-args[3].shape[1] // (max(64, page_size) // page_size))
    auto = choose_num_splits(batch, hkv, max_blocks)
    head = (f"{name:>3} Hq={hq:<2} Hkv={hkv} B={batch:<2} T={t} ctx={context:<5} "
            f"KV {kv_bytes / 1e6:7.1f} MB | ref {t_ref * 1e6:8.1f} us "
            f"(frac {kv_bytes / t_ref / HBM_BYTES_PER_S:.2f})")
    for label, kw in variants(auto):
        fn = functools.partial(paged_attention_pallas, scale=scale, **kw)
        try:
            t_ker, got = time_call(unrolled(fn), args)
            t_ker /= unroll
            err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
                      for g, w in zip(got, want))
        except Exception as e:  # a variant may not compile (shared memory, registers)
            print(f"{head} | pallas [{label}] failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"{head} | pallas {t_ker * 1e6:8.1f} us (frac "
              f"{kv_bytes / t_ker / HBM_BYTES_PER_S:.2f}) x{t_ref / t_ker:5.1f} "
              f"| {label} | err {err:.1e}", flush=True)


def default_variant(auto):
    return [(f"splits {auto}", {})]


def sweep_variants(auto):
    out = [(f"default splits {auto}", {})]
    out += [(f"block_keys {bk}", {"block_keys": bk}) for bk in (32, 128)]
    out += [(f"num_warps {w}", {"num_warps": w}) for w in (4, 8)]
    out += [(f"num_stages {s}", {"num_stages": s}) for s in (1, 3, 4)]
    out += [(f"splits {s}", {"num_splits": s})
            for s in sorted({max(1, auto // 4), max(1, auto // 2), 2 * auto})]
    return out


def grid_case_device(name, batch, t, context, page_size, unroll, table_len, calls=8):
    hq, hkv = CONFIGS[name]
    args = make_case(hq, hkv, batch, t, context, page_size, unroll, table_len)
    scale = HEAD_DIM ** -0.5
    ref = functools.partial(paged_attention_reference, scale=scale)
    t_ref = sum(device_us(unrolled(ref), args, calls).values()) / unroll
    max_blocks = -(-args[3].shape[1] // (max(64, page_size) // page_size))
    head = f"{name:>3} B={batch:<2} T={t} ctx={context:<5} | ref {t_ref:6.1f} us"
    for label, kw in grid_variants(choose_num_splits(batch, hkv, max_blocks)):
        fn = functools.partial(paged_attention_pallas, scale=scale, **kw)
        try:
            us = sum(device_us(unrolled(fn), args, calls).values()) / unroll
        except Exception as e:  # a variant may not compile (shared memory, registers)
            print(f"{head} | [{label}] failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        print(f"{head} | pallas {us:6.1f} us (kernel + merge) | {label}", flush=True)


def grid_variants(auto):
    out = [(f"default splits {auto}", {})]
    for bk in (16, 32, 64):
        for s in (8, 16, 32, 48, 64):
            for w in (2, 4):
                out.append((f"bk {bk} splits {s} warps {w}",
                            {"block_keys": bk, "num_splits": s, "num_warps": w}))
    return out


def grid_case(text):
    name, batch, t, context = text.split(",")
    return name, int(batch), int(t), int(context)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="context 8192, batch 1 and 32 only")
    p.add_argument("--sweep", action="store_true", help="also sweep launch parameters")
    p.add_argument("--grid", action="store_true",
                   help="time block_keys x splits x warps on --grid-cases only")
    p.add_argument("--grid-cases", type=grid_case, nargs="+",
                   default=[grid_case("2B,1,1,1100"), grid_case("2B,1,4,1100")],
                   help="NAME,BATCH,T,CONTEXT cases for --grid")
    p.add_argument("--unroll", type=int, default=4, help="attention calls per timed jit call")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--table-len", type=int, default=0,
                   help="page-table width in tokens (default: each case's context)")
    a = p.parse_args(argv)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; page size {a.page_size}, "
          f"head dim {HEAD_DIM}, bf16, table {a.table_len or 'context'} tokens; "
          f"times per attention call")
    if a.grid:
        print("grid (block_keys x splits x warps), device time per call from the profiler:")
        for name, batch, t, context in a.grid_cases:
            grid_case_device(name, batch, t, context, a.page_size, a.unroll, a.table_len)
        return
    batches, contexts = ((1, 32), (8192,)) if a.quick else ((1, 8, 32), (1024, 8192))
    for name in CONFIGS:
        for batch in batches:
            for t in (1, 4):
                for context in contexts:
                    bench_case(name, batch, t, context, a.page_size, a.unroll, default_variant,
                               a.table_len)
    if a.sweep:
        print("sweep (one parameter changed from the default at a time):")
        for name, batch, t in (("2B", 1, 1), ("27B", 8, 4), ("35B", 32, 4)):
            bench_case(name, batch, t, 8192, a.page_size, a.unroll, sweep_variants, a.table_len)


if __name__ == "__main__":
    main()
