"""``python -m mtp_jax.bench gemv``: the one- and few-row projections of a decode step, XLA's
forms against the Pallas kernels, and the fused add + RMSNorm + projection (+ SwiGLU).

Parts (``--parts``):

* ``proj``: ``x [M, K] @ w.T`` for each projection ``w [N, K]`` of ``--shapes`` (groups ``2b``,
  ``27b``, ``27b_more``, ``35b``, ``head``, ``rows``, or ``N:K``) and ``--rows`` M. Variants:
  ``xla`` (XLA's dot), ``reduce`` (the multiply-reduce form, ``pallas_kernels.gemv.reduce_form``;
  for several rows the same reduced in ``[N, M, K]`` order), ``sibling`` (M > 1: one one-row
  reduce per row, stacked), ``reduce_split`` (M = 1: the reduce over chunks of K, 8192 for
  K > 8192, else 2 and 4 chunks), ``pallas`` (``few_rows_matmul`` with the tiles ``gemv``
  picks; ``--sweep``: a sweep of tiles). Bytes: the weights, N K 2. Error: max |y - ref| /
  max |ref|, ref XLA's dot with float32 sums rounded once;
* ``norm``: a decode step's fused-norm shapes (``--norm-shapes``: ``2b``, ``2b_qkv``, ``27b`` or
  ``N:K`` / ``N:K:silu``), one row, 16 chained layers (each layer's input the previous layer's
  first K outputs). Variants: ``chain_xla`` (add + RMSNorm, multiply-reduce projection, SwiGLU,
  all XLA), ``chain`` (the same with the Pallas add + RMSNorm: the engine's path before the
  fused kernel) and ``fused`` (``norm_gemv``; ``--sweep``: a sweep of tiles). Error against
  ``norm_gemv_reference``.

Each program runs the op on ``--copies`` distinct weights back to back (chained by
``optimization_barrier``; 16 copies are beyond the 50 MB L2), so a call's time is the
program's over the copies. Time: on a GPU the device time from a ``jax.profiler`` trace of
``--calls`` calls (the kernels only, no dispatch; the wall time is a note), elsewhere the
median wall time of ``--reps`` waited-for calls (warm-up excluded). Without a GPU only the
XLA variants run; asking for a Pallas one there is refused. ``--quick``: the 2B shapes, one row.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp

from mtp_jax.bench.report import op_row
from mtp_jax.bench.subcommand import (Results, int_list, name_list, on_gpu, parser,
                                      pick_variants, positive, require_gpu, run)
from mtp_jax.bench.timing import device_seconds, wall_seconds
from pallas_kernels.gemv import (GemvTiles, check_tiles, default_tiles, few_rows_matmul,
                                 few_rows_reference, reduce_matmul)
from pallas_kernels.gemv.norm_gemv import NormGemvTiles, norm_gemv, norm_gemv_reference
from pallas_kernels.norm import add_rms_norm

SUMMARY = ("one- and few-row projections (XLA forms against the Pallas kernel) and the fused "
           "add + RMSNorm + projection")
SHAPES = {"2b": [("2B gate_up", 12288, 2048), ("2B down", 2048, 6144),
                 ("2B gdn_in", 8224, 2048), ("2B attn_qkv", 5120, 2048),
                 ("2B o_proj", 2048, 2048)],
          "27b": [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408)],
          "27b_more": [("27B gdn_in", 16480, 5120), ("27B gdn_out", 5120, 6144),
                       ("27B attn_qkv", 14336, 5120), ("27B o_proj", 5120, 6144)],
          "35b": [("35B gdn_in", 12352, 2048), ("35B gdn_out", 2048, 4096),
                  ("35B shared_in", 1281, 2048), ("35B shared_down", 2048, 512)],
          "head": [("2B lm_head", 248320, 2048)],
          "rows": [("2B gate_up", 12288, 2048), ("2B down", 2048, 6144),
                   ("27B gate_up", 34816, 5120), ("27B gdn_in", 16480, 5120),
                   ("27B o_proj", 5120, 6144), ("35B gdn_in", 12352, 2048)]}
NORM_SHAPES = {"2b": [("2B gate_up+silu", 12288, 2048, "silu_mul"),
                      ("2B gdn_in", 8224, 2048, None)],
               "2b_qkv": [("2B attn_qkv", 5120, 2048, None)],
               "27b": [("27B gate_up+silu", 34816, 5120, "silu_mul"),
                       ("27B gdn_in", 16480, 5120, None)]}
PARTS = ("proj", "norm")
VARIANTS = ("xla", "reduce", "sibling", "reduce_split", "pallas", "chain_xla", "chain", "fused")
GPU_ONLY = ("pallas", "chain", "fused")
EPS = 1e-6


def proj_shapes(text: str) -> list[tuple[str, int, int]]:
    """argparse type of ``--shapes``: comma-separated groups of :data:`SHAPES` or ``N:K``."""
    out = []
    for item in text.split(","):
        if item in SHAPES:
            out += SHAPES[item]
            continue
        try:
            n, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is neither one of {', '.join(SHAPES)} "
                                             "nor N:K (e.g. 256:512)") from None
        out.append(("custom", n, k))
    return out


def norm_shapes(text: str) -> list[tuple[str, int, int, str | None]]:
    """argparse type of ``--norm-shapes``: groups of :data:`NORM_SHAPES`, ``N:K`` or
    ``N:K:silu`` (gate/up with SwiGLU: N even); the output width must be at least K."""
    out = []
    for item in text.split(","):
        if item in NORM_SHAPES:
            out += NORM_SHAPES[item]
            continue
        parts = item.split(":")
        ok = (len(parts) in (2, 3) and all(v.isdigit() for v in parts[:2])
              and parts[2:] in ([], ["silu"]))
        n, k = (int(parts[0]), int(parts[1])) if ok else (0, 0)
        act = "silu_mul" if len(parts) == 3 else None
        if not ok or min(n, k) < 1 or (act and n % 2) or (n // 2 if act else n) < k:
            raise argparse.ArgumentTypeError(
                f"{item!r} is neither one of {', '.join(NORM_SHAPES)} nor N:K or N:K:silu with "
                "an output width (N, or N/2 with silu) of at least K: the next layer's input "
                "is the first K outputs")
        out.append(("custom+silu" if act else "custom", n, k, act))
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``gemv`` flags."""
    p = parser("gemv", __doc__)
    p.add_argument("--parts", type=name_list(PARTS), default=list(PARTS),
                   help="proj, norm (default both)")
    p.add_argument("--shapes", type=proj_shapes,
                   default=proj_shapes("2b,27b,27b_more,35b,head"),
                   help=f"proj: groups {', '.join(SHAPES)} or N:K (default all but rows)")
    p.add_argument("--rows", type=int_list, default=[1, 4], help="proj: rows M (default 1,4)")
    p.add_argument("--norm-shapes", type=norm_shapes, default=norm_shapes("2b"),
                   help=f"norm: groups {', '.join(NORM_SHAPES)}, N:K or N:K:silu (default 2b)")
    p.add_argument("--variants", type=name_list(VARIANTS), default=None,
                   help=f"{', '.join(VARIANTS)} (default all; the XLA ones without a GPU)")
    p.add_argument("--quick", action="store_true",
                   help="proj: the 2B shapes at one row; norm: the 2B shapes (overrides "
                        "--shapes, --rows and --norm-shapes)")
    p.add_argument("--sweep", action="store_true", help="GPU: pallas / fused over many tiles")
    p.add_argument("--copies", type=positive(int), default=16,
                   help="distinct weights chained per program (default 16)")
    p.add_argument("--calls", type=positive(int), default=3,
                   help="GPU: traced calls per device time (default 3)")
    p.add_argument("--reps", type=positive(int), default=5,
                   help="timed wall-clock calls (default 5)")
    return p


def chained(fn):
    """A jit of ``fn(x, w)`` over each weight in turn, each after the previous one."""
    def call(x, ws):
        outs, prev = [], None
        for w in ws:
            if prev is not None:
                x, prev = jax.lax.optimization_barrier((x, prev))
            prev = fn(x, w)
            outs.append(prev)
        return outs
    return jax.jit(call)


def reduce_rows_form(x, w):
    """The multiply-reduce form for several rows, reduced in ``[N, M, K]`` order."""
    y = jnp.sum(x.astype(jnp.float32)[None] * w.astype(jnp.float32)[:, None], axis=-1)
    return y.T.astype(w.dtype)


def reduce_sibling_form(x, w):
    """One one-row multiply-reduce per row, stacked (sibling reductions sharing ``w``)."""
    wf, xf = w.astype(jnp.float32), x.astype(jnp.float32)
    return jnp.stack([jnp.sum(xf[m][None, :] * wf, axis=-1) for m in range(x.shape[0])]
                     ).astype(w.dtype)


def reduce_chunked_form(x, w, chunk: int = 8192):
    """The one-row reduce with K split into chunks of at most ``chunk`` (a reduce over each
    chunk, then over the chunks)."""
    n, k = w.shape
    c = -(-k // chunk)
    while k % c:
        c += 1
    prod = x.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32)[None]
    return jnp.sum(jnp.sum(prod.reshape(x.shape[0], n, c, k // c), -1), -1).astype(w.dtype)


def tile_candidates(n: int, k: int, m: int) -> list[GemvTiles]:
    """The Pallas tiles of ``--sweep`` that fit ``w [N, K]`` at M rows (the default first)."""
    fmas = [GemvTiles(bn, bk, "fma") for bn in (4, 8, 16, 32) for bk in (256, 512)]
    fmas += [GemvTiles(bn, 512, "fma", 8) for bn in (16, 32)]
    fmars = [GemvTiles(bn, bk, "fmar") for bn in (8, 16, 32) for bk in (256, 512)]
    dots = [GemvTiles(bn, bk, "dot") for bn in (16, 32, 64) for bk in (128, 256)]
    default = default_tiles(n, k)
    ok = []
    for t in ([default] if default and m == 1 else []) + (fmas if m == 1 else []) + fmars + dots:
        try:
            check_tiles(t, n, k)
        except ValueError:
            continue
        ok += [t] if t not in ok else []
    return ok


def proj_variants(variants, n: int, k: int, m: int, sweep: bool) -> list[tuple[str, object]]:
    """``(label, fn(x, w))`` to time for ``w [N, K]`` at M rows."""
    out = []
    for v in variants:
        if v == "xla":
            out.append((v, few_rows_reference))
        elif v == "reduce":
            out.append((v, reduce_matmul if m == 1 else reduce_rows_form))
        elif v == "sibling" and m > 1:
            out.append((v, reduce_sibling_form))
        elif v == "reduce_split" and m == 1:
            out += ([("reduce_chunked", reduce_chunked_form)] if k > 8192 else
                    [(f"reduce_split{c}", functools.partial(reduce_chunked_form, chunk=k // c))
                     for c in (2, 4)])
        elif v == "pallas":
            tiles = tile_candidates(n, k, m) if sweep else (
                [default_tiles(n, k)] if m == 1 and default_tiles(n, k) else [])
            out += [(f"pallas {t.form} bn={t.bn} bk={t.bk} w={t.num_warps} s={t.num_stages}",
                     functools.partial(few_rows_matmul, tiles=t)) for t in tiles]
    return out


def timed(call, a) -> tuple[float, str, dict]:
    """``(seconds, timing, notes)`` of one ``call()``: device time on a GPU (wall time in the
    notes), else wall time."""
    wall = wall_seconds(call, reps=a.reps)
    if on_gpu():
        return device_seconds(call, calls=a.calls), "device", {"wall_us": wall * 1e6}
    return wall, "wall", {}


def rel_err(y, ref) -> float:
    """max |y - ref| / max |ref| in float32."""
    y, ref = y.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))


def bench_proj(results: Results, a, variants) -> None:
    """The ``proj`` part: every shape, row count and variant."""
    for name, n, k in a.shapes:
        key = jax.random.key(n * 7 + k)
        ws = [(jax.random.normal(jax.random.fold_in(key, r), (n, k), jnp.float32)
               * k ** -0.5).astype(jnp.bfloat16) for r in range(a.copies)]
        for m in a.rows:
            x = jax.random.normal(jax.random.fold_in(key, 99 + m), (m, k), jnp.float32
                                  ).astype(jnp.bfloat16)
            ref = few_rows_reference(x, ws[0])
            for label, fn in proj_variants(variants, n, k, m, a.sweep):
                f = chained(fn)
                try:
                    err = rel_err(jax.jit(fn)(x, ws[0]), ref)
                    sec, timing, notes = timed(lambda: f(x, ws), a)
                except Exception as e:  # noqa: BLE001 - a tiling may not compile; go on
                    if not label.startswith("pallas"):
                        raise
                    print(f"gemv {name} M={m} {label}: failed: {type(e).__name__}: "
                          f"{str(e)[:200]}", file=sys.stderr, flush=True)
                    continue
                results.add(op_row("gemv", f"{name} N={n} K={k} M={m}", label, sec / a.copies,
                                   n * k * 2, hbm_tbps=a.hbm_tbps, timing=timing, error=err,
                                   reference="xla f32", **notes))
        ws = None  # freed before the next shape's weights


def _chain_layer(backend: str):
    """The unfused layer: add + RMSNorm (``backend``), multiply-reduce projection, SwiGLU."""
    def layer(x, d, nw, w, act):
        h, hn = add_rms_norm(x, d, nw, EPS, backend=backend)
        p = reduce_matmul(hn, w)
        if act == "silu_mul":
            i = w.shape[0] // 2
            p = jax.nn.silu(p[..., :i]) * p[..., i:]
        return h, p
    return layer


def _norm_program(layer, act):
    """A jit of ``layer`` over the chained layers (each layer's delta: the previous output's
    first K columns)."""
    def call(x, d, nws, ws):
        ys = []
        for nw, w in zip(nws, ws):
            x, y = layer(x, d, nw, w, act)
            d = y[..., :x.shape[-1]]
            ys.append(y)
        return x, ys
    return jax.jit(call)


def norm_variants(variants, out: int, k: int, act, sweep: bool) -> list[tuple[str, object]]:
    """``(label, layer(x, delta, nw, w, act))`` to time."""
    layers = []
    for v in variants:
        if v in ("chain_xla", "chain"):
            layers.append((v, _chain_layer("xla" if v == "chain_xla" else "pallas")))
        elif v == "fused":
            tiles = [None] if not sweep else [
                t for t in (NormGemvTiles(bn, bk, nwarps, pre, red) for bn in (8, 16)
                            for bk in (512, 1024) for nwarps in (4, 8) for pre in (0, 1)
                            for red in (False, True))
                if out % t.bn == 0 and k % t.bk == 0 and t.bn * t.bk <= 16384]
            layers += [("fused" if t is None else f"fused {tuple(t)}",
                        lambda x, d, nw, w, act, t=t: norm_gemv(x, d, nw, w, EPS, act=act,
                                                                tiles=t)) for t in tiles]
    return layers


def bench_norm(results: Results, a, variants) -> None:
    """The ``norm`` part: every shape and variant."""
    for name, n, k, act in a.norm_shapes:
        key = jax.random.key(n + k)
        rnd = lambda i, shape, s=1.0: (jax.random.normal(jax.random.fold_in(key, i), shape)
                                       * s).astype(jnp.bfloat16)
        ws = [rnd(i, (n, k), k ** -0.5) for i in range(a.copies)]
        nws = [rnd(100 + i, (k,), 0.1) for i in range(a.copies)]
        x, d = rnd(200, (1, k)), rnd(201, (1, k))
        ref = _norm_program(lambda *z: norm_gemv_reference(*z[:4], EPS, z[4]), act)(x, d, nws,
                                                                                   ws)
        out = n // 2 if act else n
        for label, layer in norm_variants(variants, out, k, act, a.sweep):
            f = _norm_program(layer, act)
            try:
                err = max(rel_err(y, r) for y, r in zip(f(x, d, nws, ws)[1], ref[1]))
                sec, timing, notes = timed(lambda: f(x, d, nws, ws), a)
            except Exception as e:  # noqa: BLE001 - a tiling may not compile; go on
                if label == "chain_xla":
                    raise
                print(f"gemv {name} {label}: failed: {type(e).__name__}: {str(e)[:200]}",
                      file=sys.stderr, flush=True)
                continue
            results.add(op_row("gemv", f"norm {name} N={n} K={k}", label, sec / a.copies,
                               n * k * 2 + 3 * k * 2, hbm_tbps=a.hbm_tbps, timing=timing,
                               error=err, reference="norm_gemv_reference", **notes))
        ws = None  # freed before the next shape's weights


def bench(a, results: Results) -> None:
    """The parts of the flags (see the module docstring)."""
    if a.sweep:
        require_gpu("gemv --sweep", "leave --sweep out to time the XLA variants only")
    variants = pick_variants("gemv", a.variants, list(VARIANTS), GPU_ONLY)
    if a.quick:
        a.shapes, a.rows, a.norm_shapes = SHAPES["2b"], [1], NORM_SHAPES["2b"]
    if "proj" in a.parts:
        bench_proj(results, a, variants)
    if "norm" in a.parts:
        bench_norm(results, a, variants)


def main(argv=None) -> int:
    """``python -m mtp_jax.bench gemv``; 0, or 2 for refused flags."""
    return run("gemv", build_parser(), bench, argv)
