"""``python -m mtp_jax.bench attention``: paged attention for decode / verify rows, the XLA
reference against the Pallas kernel.

Cases: the head layouts (``--layouts``) of Qwen3.5-2B (8 query, 2 KV heads), Qwen3.6-27B (24, 4)
and Qwen3.6-35B-A3B (16, 2), head dim ``--head-dim`` (256), bf16, page size ``--page-size``
(16), for each batch (``--batch``), query rows per request (``--rows``, T: 1 decode, 4 a k = 3
verify) and context (``--context``: every request holds that many tokens; its T query rows are
the last T positions). Page tables are random permutations of the pool, as wide as the context,
or as ``--table-len`` tokens with the trash page 0 past the context (as in the engine, whose
tables hold ``max_model_len``: the reference reads the whole table, the kernel only up to the
query positions). ``--quick``: context 8192 and batch 1 and 32 only.

Each timed call runs ``--unroll`` independent attention calls (different q) inside one jit;
time: ``--calls`` such calls dispatched back to back and waited for at the end (host dispatch
overlaps device work), the median over ``--reps`` repeats, over ``--unroll`` (warm-up
excluded). Bytes: the K and V the call must read (batch x context x Hkv x D x 2 x 2 bytes).
Error: the kernel's largest |difference| from the XLA reference.

``--sweep`` (GPU): also a few launch-parameter variants (block_keys, num_warps, num_stages,
num_splits) on ``--sweep-cases`` (default three cases at context 8192). ``--grid`` (GPU):
instead, block_keys x splits x warps x stages on ``--grid-cases`` only, with device time per
call from a profiler trace. Without a GPU only the
XLA reference is timed (``--variants xla``); asking for the kernel there is refused.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys

import jax
import jax.numpy as jnp

from mtp_jax.bench.report import op_row
from mtp_jax.bench.subcommand import (Refused, Results, int_list, name_list, parser,
                                      pick_variants, positive, require_gpu, run)
from mtp_jax.bench.timing import device_seconds, wall_seconds
from pallas_kernels.paged_attention.pallas import choose_num_splits, paged_attention_pallas
from pallas_kernels.paged_attention.reference import paged_attention_reference

SUMMARY = "paged attention (decode / verify rows): XLA reference against the Pallas kernel"
LAYOUTS = {"2B": (8, 2), "27B": (24, 4), "35B": (16, 2)}  # query heads, KV heads
VARIANTS = ("xla", "pallas")
SWEEP_CASES = ("2B,1,1,8192", "27B,8,4,8192", "35B,32,4,8192")  # LAYOUT,BATCH,T,CONTEXT


def grid_case(text: str) -> tuple[str, int, int, int]:
    """argparse type of ``--grid-cases`` and ``--sweep-cases``: ``LAYOUT,BATCH,T,CONTEXT``."""
    parts = text.split(",")
    try:
        name, batch, t, context = parts[0], *(int(v) for v in parts[1:])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LAYOUT,BATCH,T,CONTEXT (e.g. "
                                         "2B,1,1,1100)") from None
    if name not in LAYOUTS or min(batch, t, context) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: LAYOUT one of {', '.join(LAYOUTS)}, "
                                         "numbers >= 1")
    return name, batch, t, context


def splits_list(text: str) -> list[int]:
    """argparse type of ``--grid-splits``: ``"auto,63"`` -> ``[0, 63]`` (0: automatic)."""
    return [0 if v == "auto" else int_list(v)[0] for v in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    """The ``attention`` flags."""
    p = parser("attention", __doc__)
    p.add_argument("--layouts", type=name_list(LAYOUTS), default=list(LAYOUTS),
                   help="head layouts: 2B, 27B, 35B (default all)")
    p.add_argument("--batch", type=int_list, default=[1, 8, 32], help="default 1,8,32")
    p.add_argument("--rows", type=int_list, default=[1, 4],
                   help="query rows per request, T (default 1,4)")
    p.add_argument("--context", type=int_list, default=[1024, 8192],
                   help="tokens each request holds (default 1024,8192)")
    p.add_argument("--quick", action="store_true",
                   help="context 8192 and batch 1, 32 only (overrides --batch and --context)")
    p.add_argument("--head-dim", type=positive(int), default=256, help="D (default 256)")
    p.add_argument("--page-size", type=positive(int), default=16, help="default 16")
    p.add_argument("--table-len", type=int, default=0,
                   help="page-table width in tokens (default: each case's context)")
    p.add_argument("--unroll", type=positive(int), default=4,
                   help="attention calls per timed jit call (default 4)")
    p.add_argument("--calls", type=positive(int), default=10,
                   help="back-to-back calls per timed repeat (default 10)")
    p.add_argument("--reps", type=positive(int), default=5, help="timed repeats (default 5)")
    p.add_argument("--variants", type=name_list(VARIANTS), default=None,
                   help="xla, pallas (default both; xla only without a GPU)")
    p.add_argument("--sweep", action="store_true",
                   help="GPU: also time launch-parameter variants on --sweep-cases")
    p.add_argument("--sweep-cases", type=grid_case, nargs="+",
                   default=[grid_case(c) for c in SWEEP_CASES],
                   help="LAYOUT,BATCH,T,CONTEXT cases of --sweep (default "
                        f"{' '.join(SWEEP_CASES)}; e.g. 35B,1,1,131072 for long context)")
    p.add_argument("--grid", action="store_true",
                   help="GPU: time block_keys x splits x warps x stages (--grid-block-keys, "
                        "--grid-splits, --grid-warps, --grid-stages) on --grid-cases only "
                        "(device time from a profiler trace)")
    p.add_argument("--grid-cases", type=grid_case, nargs="+",
                   default=[grid_case("2B,1,1,1100"), grid_case("2B,1,4,1100")],
                   help="LAYOUT,BATCH,T,CONTEXT cases of --grid (default 2B,1,1,1100 "
                        "2B,1,4,1100)")
    p.add_argument("--grid-block-keys", type=int_list, default=[16, 32, 64],
                   help="keys per loop step of --grid (default 16,32,64)")
    p.add_argument("--grid-splits", type=splits_list, default=[8, 16, 32, 48, 64],
                   help="key splits of --grid; auto = each case's automatic count, e.g. "
                        "auto,63 (default 8,16,32,48,64)")
    p.add_argument("--grid-warps", type=int_list, default=[2, 4],
                   help="warps per program of --grid (default 2,4)")
    p.add_argument("--grid-stages", type=int_list, default=[2],
                   help="pipeline stages of --grid (default 2)")
    p.add_argument("--grid-heads", type=int_list, default=[1],
                   help="kv heads per program of --grid, each dividing every case's kv heads "
                        "(default 1)")
    p.add_argument("--grid-prefetch", type=name_list(("off", "on")), default=["off"],
                   help="page-id prefetch of --grid: off, on, or off,on (default off)")
    return p


def make_case(hq: int, hkv: int, d: int, batch: int, t: int, context: int, page_size: int,
              unroll: int, table_len: int, seed: int = 0):
    """bf16 inputs: ``unroll`` query sets ``[unroll, B, T, Hq, D]``, the K and V pools, a
    random-order page table ``[B, pages]`` (trash page 0 past the context) and the last-T
    positions ``[B, T]``."""
    pages_per_req = -(-context // page_size)
    num_pages = batch * pages_per_req + 1  # page 0: the trash page
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    shape = (num_pages, page_size, hkv, d)
    k_pages = jax.random.normal(kk, shape, jnp.bfloat16)
    v_pages = jax.random.normal(kv, shape, jnp.bfloat16)
    qs = jax.random.normal(kq, (unroll, batch, t, hq, d), jnp.bfloat16)
    table = (jax.random.permutation(kp, num_pages - 1) + 1)[:batch * pages_per_req]
    table = table.reshape(batch, pages_per_req).astype(jnp.int32)
    width = max(pages_per_req, -(-table_len // page_size))
    table = jnp.pad(table, ((0, 0), (0, width - pages_per_req)))
    pos = jnp.broadcast_to(jnp.arange(context - t, context, dtype=jnp.int32), (batch, t))
    return qs, k_pages, v_pages, table, pos


def unrolled(fn):
    """``fn`` over each of the stacked query sets, in one jit."""
    @jax.jit
    def call(qs, k_pages, v_pages, table, pos):
        return [fn(qs[i], k_pages, v_pages, table, pos) for i in range(qs.shape[0])]
    return call


def default_variant(auto: int) -> list[tuple[str, dict]]:
    """The kernel with its default launch (``auto`` splits)."""
    return [("pallas", {})]


def sweep_variants(auto: int) -> list[tuple[str, dict]]:
    """The default launch, then one parameter changed at a time."""
    out = [("pallas", {})]
    out += [(f"pallas block_keys={bk}", {"block_keys": bk}) for bk in (32, 128)]
    out += [(f"pallas num_warps={w}", {"num_warps": w}) for w in (4, 8)]
    out += [(f"pallas num_stages={s}", {"num_stages": s}) for s in (1, 3, 4)]
    # combinations for long contexts: smaller blocks let several programs share an SM (a
    # 64-key block at D = 256 takes ~64 KiB of shared memory a stage), deeper pipelines
    out += [("pallas block_keys=128 num_warps=8", {"block_keys": 128, "num_warps": 8})]
    out += [(f"pallas block_keys=32 num_stages={s}", {"block_keys": 32, "num_stages": s})
            for s in (3, 4)]
    out += [(f"pallas block_keys=32 num_splits={s}", {"block_keys": 32, "num_splits": s})
            for s in sorted({max(1, auto // 2), 2 * auto})]
    out += [("pallas heads_per_program=2", {"heads_per_program": 2}),
            ("pallas prefetch_pages", {"prefetch_pages": True}),
            ("pallas heads_per_program=2 num_stages=1", {"heads_per_program": 2,
                                                         "num_stages": 1}),
            ("pallas heads_per_program=2 prefetch_pages num_stages=1",
             {"heads_per_program": 2, "prefetch_pages": True, "num_stages": 1})]
    out += [(f"pallas num_splits={s}", {"num_splits": s})
            for s in sorted({max(1, auto // 4), max(1, auto // 2), 2 * auto})]
    return out


def grid_variants(a):
    """``kernels(auto)`` for ``--grid``: the default launch, then every combination of
    ``--grid-block-keys`` x ``--grid-splits`` x ``--grid-warps`` x ``--grid-stages`` x
    ``--grid-heads`` x ``--grid-prefetch`` (a split count of 0, ``auto`` on the command line,
    stands for the case's automatic one)."""
    def variants(auto: int) -> list[tuple[str, dict]]:
        out = [("pallas", {})]
        for bk, s, w, st, g, pf in itertools.product(
                a.grid_block_keys, a.grid_splits, a.grid_warps, a.grid_stages, a.grid_heads,
                a.grid_prefetch):
            out.append((f"pallas bk={bk} splits={s or auto} warps={w} stages={st} heads={g}"
                        f"{' prefetch' if pf == 'on' else ''}",
                        {"block_keys": bk, "num_splits": s or auto, "num_warps": w,
                         "num_stages": st, "heads_per_program": g, "prefetch_pages": pf == "on"}))
        return out
    return variants


def bench_case(results: Results, a, layout: str, batch: int, t: int, context: int,
               xla: bool, kernels, device: bool = False) -> None:
    """Time one case: the XLA reference (``xla``) and each ``(label, launch kwargs)`` of
    ``kernels(auto splits)``; ``device``: profiler device time instead of wall time. A kernel
    launch that fails to compile is reported on stderr and skipped."""
    hq, hkv = LAYOUTS[layout]
    d, ps, unroll = a.head_dim, a.page_size, a.unroll
    args = make_case(hq, hkv, d, batch, t, context, ps, unroll, a.table_len)
    nbytes = batch * context * hkv * d * 2 * 2
    scale = d ** -0.5
    ref_fn = functools.partial(paged_attention_reference, scale=scale)
    want = jax.block_until_ready(unrolled(ref_fn)(*args))
    max_blocks = -(-args[3].shape[1] // (max(64, ps) // ps))
    auto = choose_num_splits(batch, hkv, max_blocks)
    case = f"{layout} Hq={hq} Hkv={hkv} D={d} B={batch} T={t} ctx={context}"
    todo = ([("xla", None)] if xla else []) + (kernels(auto) if kernels else [])
    for label, kw in todo:
        fn = (ref_fn if kw is None
              else functools.partial(paged_attention_pallas, scale=scale, **kw))
        call = unrolled(fn)
        try:
            got = jax.block_until_ready(call(*args))
            if device:
                sec = device_seconds(lambda: call(*args), calls=a.calls) / unroll
            else:
                sec = wall_seconds(lambda: call(*args), reps=a.reps, calls=a.calls) / unroll
        except Exception as e:  # noqa: BLE001 - a launch may not compile (shared memory)
            if kw is None:
                raise
            print(f"{case} {label}: failed: {type(e).__name__}: {str(e)[:200]}",
                  file=sys.stderr, flush=True)
            continue
        err = None if kw is None else max(
            float(jnp.max(jnp.abs(g.astype(jnp.float32) - w.astype(jnp.float32))))
            for g, w in zip(got, want))
        notes = {} if kw is None else {"auto_splits": auto}
        results.add(op_row("attention", case, label, sec, nbytes, hbm_tbps=a.hbm_tbps,
                           timing="device" if device else "wall", error=err,
                           reference=None if kw is None else "xla", **notes))


GRID_FLAGS = ("grid_cases", "grid_block_keys", "grid_splits", "grid_warps", "grid_stages",
              "grid_heads", "grid_prefetch")


def check_mode_flags(a) -> None:
    """Raise :class:`Refused` for ``--grid-*`` flags given without ``--grid``,
    ``--sweep-cases`` without ``--sweep``, or ``--grid`` with ``--sweep`` (``--grid`` runs its
    cases only: the others would be ignored)."""
    if a.grid and a.sweep:
        raise Refused("--grid and --sweep do not run together (--grid times its --grid-cases "
                      "only); run them one at a time.")
    defaults = build_parser().parse_args([])
    for mode, flags in (("grid", GRID_FLAGS), ("sweep", ("sweep_cases",))):
        given = [f for f in flags if getattr(a, f) != getattr(defaults, f)]
        if given and not getattr(a, mode):
            names = ", ".join("--" + f.replace("_", "-") for f in given)
            raise Refused(f"{names} only apply with --{mode}; add --{mode} or leave them out.")


def bench(a, results: Results) -> None:
    """Every case of the flags (see the module docstring)."""
    check_mode_flags(a)
    if a.sweep:
        require_gpu("attention --sweep", "leave --sweep out to time the XLA reference only")
    if a.grid:
        require_gpu("attention --grid", "leave --grid out to time the XLA reference only")
        for layout, batch, t, context in a.grid_cases:
            bench_case(results, a, layout, batch, t, context, True, grid_variants(a),
                       device=True)
        return
    variants = pick_variants("attention", a.variants, list(VARIANTS), ("pallas",))
    kernels = default_variant if "pallas" in variants else None
    batches, contexts = ([1, 32], [8192]) if a.quick else (a.batch, a.context)
    for layout in a.layouts:
        for batch in batches:
            for t in a.rows:
                for context in contexts:
                    bench_case(results, a, layout, batch, t, context, "xla" in variants,
                               kernels)
    if a.sweep:
        for layout, batch, t, context in a.sweep_cases:
            bench_case(results, a, layout, batch, t, context, False, sweep_variants)


def main(argv=None) -> int:
    """``python -m mtp_jax.bench attention``; 0, or 2 for refused flags."""
    return run("attention", build_parser(), bench, argv)
