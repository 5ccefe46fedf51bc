"""``python -m mtp_jax.bench moe``: the routed MoE experts, ``out[n] = sum_j w_nj expert_j(x_n)``,
as the sparse MoE block runs them: the XLA forms against the Pallas kernels.

Shapes (``--shapes``): ``a3b`` (Qwen3.6-35B-A3B: 256 experts, top-8, H 2048, I 512), ``flash``
(Qwen3.8-Flash-Next: 512, top-10, 2560, 640) or ``E:TOPK:H:I``; bf16 weights; token counts
``--ns`` (1 to 32: decode and verify rows; 128 to 8192: prefill chunks). Variants
(``--variants``; default ``ref,xla,pallas``):

* ``ref``: the XLA reference (gathered weights per pair; N <= 8 only), ``xla``: the ``xla``
  backend (gather-reduce form below E pairs, expert blocks above); ``xla_few``,
  ``xla_blocks``, ``xla_ragged``: each XLA form forced (``xla_few`` up to 4 E pairs,
  ``xla_ragged`` while its dense rewrite [E, P, H] stays under 16 GB);
* GPU: ``pallas`` (the backend: the few-pairs kernels with the weighted sum fused, or grouped
  matmuls), ``grouped`` (the grouped-matmul kernels, sum in XLA), ``pallas_pairs`` (the
  backend's per-pair rows, sum in XLA), ``few_gate_up`` / ``few_down`` (each few-pairs kernel
  alone; no error). ``--sweep``: also ``pallas`` with alternative tiles around the default.
* GPU, from the router logits (routing included in the time): ``xla_route`` (what a decode
  step runs without ``mlp.ROUTED_DECODE``: the Pallas router kernel, then the ``xla``
  backend) and ``routed`` (:mod:`pallas_kernels.moe.routed`: two kernels that route inside
  themselves); N up to E / top_k.

Each timed program runs the op on ``--routings`` distinct routings back to back (chained by
``optimization_barrier`` so that XLA neither reorders nor merges them, as successive layers
would), so no expert stays in L2 from one call to the next; time: the median over ``--reps``
waited-for programs (warm-up excluded), over the routings. Bytes: the distinct experts hit
(3 H I each; per kernel its share) + x read + the output written. Notes: TFLOP/s (6 H I per
pair) and the fraction of ``--peak-tflops``. Error: max |out - ref| / max |ref|, ref the XLA
reference in float32, weighted. Without a GPU only the XLA variants run; asking for a Pallas
one there is refused.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench.report import op_row
from mtp_jax.bench.subcommand import (Results, int_list, name_list, parser, pick_variants,
                                      positive, require_gpu, run)
from mtp_jax.bench.timing import wall_seconds
from pallas_kernels.moe import api
from pallas_kernels.moe.few import (check_few_tiles, default_few_tiles, few_down, few_gate_up,
                                    few_supported)
from pallas_kernels.moe.pallas import MoeTiles, default_tiles, moe_experts_pallas
from pallas_kernels.moe.reference import moe_experts_reference
from pallas_kernels.moe.routed import moe_routed, routed_supported
from pallas_kernels.moe.router import route_topk

SUMMARY = "the routed MoE experts (decode to prefill token counts): XLA forms against the kernels"
SHAPES = {"a3b": (256, 8, 2048, 512), "flash": (512, 10, 2560, 640)}  # E, top_k, H, I
VARIANTS = ("ref", "xla", "xla_few", "xla_blocks", "xla_ragged", "pallas", "grouped",
            "pallas_pairs", "few_gate_up", "few_down", "xla_route", "routed")
GPU_ONLY = ("pallas", "grouped", "pallas_pairs", "few_gate_up", "few_down", "xla_route",
            "routed")
DENSE_REWRITE_LIMIT = 16e9  # xla_ragged skipped when its dense rewrite [E, P, H] is bigger


def shape(text: str) -> tuple[str, tuple[int, int, int, int]]:
    """argparse type of one ``--shapes`` item: a name of :data:`SHAPES` or ``E:TOPK:H:I``."""
    if text in SHAPES:
        return text, SHAPES[text]
    try:
        e, k, h, i = (int(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither {' nor '.join(SHAPES)} nor "
                                         "E:TOPK:H:I (e.g. 8:2:64:32)") from None
    if min(e, k, h, i) < 1 or k > e:
        raise argparse.ArgumentTypeError(f"{text!r}: every value >= 1 and TOPK <= E")
    return "custom", (e, k, h, i)


def build_parser() -> argparse.ArgumentParser:
    """The ``moe`` flags."""
    p = parser("moe", __doc__)
    p.add_argument("--shapes", type=shape, nargs="+", default=[shape(s) for s in SHAPES],
                   help="a3b, flash or E:TOPK:H:I (default a3b flash)")
    p.add_argument("--ns", type=int_list, default=[1, 4, 8, 32, 128, 1024, 8192],
                   help="tokens N (default 1,4,8,32,128,1024,8192)")
    p.add_argument("--quick", action="store_true", help="a3b, N 1, 8, 128, 8192 only")
    p.add_argument("--variants", type=name_list(VARIANTS), default=None,
                   help=f"{', '.join(VARIANTS)} (default ref,xla,pallas; xla ones without a GPU)")
    p.add_argument("--sweep", action="store_true",
                   help="GPU: also pallas with alternative tiles around the default")
    p.add_argument("--routings", type=positive(int), default=8,
                   help="distinct routings chained per timed program (default 8)")
    p.add_argument("--reps", type=positive(int), default=15, help="timed programs (default 15)")
    p.add_argument("--peak-tflops", type=positive(float), default=783.0,
                   help="bf16 dense peak for the FLOP fraction (default 783: the H200)")
    return p


def weighted_sum(y, w):
    """``[N, top_k, H]``, ``[N, top_k]`` -> ``[N, H]`` in ``y.dtype`` (as ``Experts`` sums)."""
    return jnp.sum(y.astype(jnp.float32) * w.astype(jnp.float32)[..., None], axis=1).astype(
        y.dtype)


def chained(fn):
    """A jit of ``fn(x, ids, w, gate_up, down)`` over each routing in turn, each call after the
    previous one (``optimization_barrier``)."""
    def call(xs, idss, ws, gu, dn):
        outs, prev = [], None
        for x, ids, w in zip(xs, idss, ws):
            if prev is not None:
                x, prev = jax.lax.optimization_barrier((x, prev))
            prev = fn(x, ids, w, gu, dn)
            outs.append(prev)
        return outs
    return jax.jit(call)


def route_then_experts(x, logits, gate_up, down, top_k: int):
    """A decode step's routed experts without ``mlp.ROUTED_DECODE``: ``route_topk`` (the
    Pallas router where the expert count is a power of two), then the ``xla`` backend."""
    e = gate_up.shape[0]
    backend = "pallas" if e & (e - 1) == 0 else "xla"
    weights, ids = route_topk(logits, top_k, normalize=True, backend=backend)
    return api.moe_experts_weighted(x, ids, weights, gate_up, down)


def sweep_tiles(n_pairs: int, n: int, e: int, h: int, i: int) -> list[tuple[str, dict]]:
    """``(label, moe_experts_weighted kwargs)`` of alternative tiles around the default: the
    few-pairs kernels' where they run, else the grouped kernels'."""
    if n_pairs <= e * api.FEW_KERNEL_MAX_PAIRS_PER_EXPERT and few_supported(h, i):
        d = default_few_tiles(n_pairs, n, h, i)
        alts = [d._replace(num_stages=3), d._replace(num_stages=5), d._replace(num_warps=2),
                d._replace(num_warps=8), d._replace(gu_bk=d.gu_bk * 2),
                d._replace(dn_bk=d.dn_bk // 2)]
        out = []
        for t in alts:
            try:
                check_few_tiles(t, h, i)
            except ValueError:
                continue
            out += [(f"pallas few{tuple(t)}", {"few_tiles": t})] if t != d else []
        return out
    d = default_tiles(n_pairs, e, h, i)
    alts = [MoeTiles(64, 64, 64, 128, 64, 4, 3), MoeTiles(128, 64, 64, 128, 64, 8, 3),
            MoeTiles(128, 64, 32, 128, 32, 4, 4), MoeTiles(128, 128, 64, 128, 64, 8, 3)]
    ok = lambda t: i % t.gu_bn == 0 and h % t.gu_bk == 0 and h % t.dn_bn == 0 and i % t.dn_bk == 0
    return [(f"pallas grouped{tuple(t)}", {"tiles": t}) for t in alts if t != d and ok(t)]


def cases(variants, n: int, e: int, k: int, h: int, i: int, sweep: bool):
    """``(variant, fn(x, ids, w, gu, dn), bytes share of the experts, kind)`` to time at N
    tokens; kind ``"h"``: fed the gate/up kernel's output, ``"skip"``: no error,
    ``"logits"``: fed the router logits in place of the ids."""
    p = n * k
    out = []
    for v in variants:
        if v == "ref" and n <= 8:
            out.append((v, lambda x, ids, w, g, d: weighted_sum(
                moe_experts_reference(x, ids, g, d), w), 1.0, None))
        elif v == "xla":
            out.append((v, lambda x, ids, w, g, d: api.moe_experts_weighted(x, ids, w, g, d),
                        1.0, None))
        elif v == "xla_few" and p <= 4 * e:
            out.append((v, lambda x, ids, w, g, d: weighted_sum(
                api.moe_experts_xla_few(x, ids, g, d), w), 1.0, None))
        elif v == "xla_blocks":
            out.append((v, lambda x, ids, w, g, d: weighted_sum(
                api.moe_experts_xla_blocks(x, ids, g, d), w), 1.0, None))
        elif v == "xla_ragged" and e * p * h * 2 <= DENSE_REWRITE_LIMIT:
            out.append((v, lambda x, ids, w, g, d: weighted_sum(
                api.moe_experts_xla_ragged(x, ids, g, d), w), 1.0, None))
        elif v == "pallas":
            out.append((v, lambda x, ids, w, g, d: api.moe_experts_weighted(
                x, ids, w, g, d, backend="pallas"), 1.0, None))
            for label, kw in (sweep_tiles(p, n, e, h, i) if sweep else []):
                out.append((label, lambda x, ids, w, g, d, kw=kw: api.moe_experts_weighted(
                    x, ids, w, g, d, backend="pallas", **kw), 1.0, None))
        elif v == "grouped":
            out.append((v, lambda x, ids, w, g, d: weighted_sum(
                moe_experts_pallas(x, ids, g, d), w), 1.0, None))
        elif v == "pallas_pairs":
            out.append((v, lambda x, ids, w, g, d: weighted_sum(
                api.moe_experts(x, ids, g, d, backend="pallas"), w), 1.0, None))
        elif v == "few_gate_up" and few_supported(h, i):
            t = default_few_tiles(p, n, h, i)
            out.append((v, lambda x, ids, w, g, d, t=t: few_gate_up(x, ids, g, t), 2 / 3,
                        "skip"))
        elif v == "few_down" and few_supported(h, i):
            t = default_few_tiles(p, n, h, i)
            out.append((v, lambda hh, ids, w, g, d, t=t: few_down(hh, ids, d, w, hh.dtype, t),
                        1 / 3, "h"))
        elif v == "xla_route" and p < e:
            out.append((v, lambda x, lg, w, g, d: route_then_experts(x, lg, g, d, k), 1.0,
                        "logits"))
        elif v == "routed" and p < e and routed_supported(e, h, i):
            out.append((v, lambda x, lg, w, g, d: moe_routed(
                x, lg, g, d, top_k=k, normalize=True, shared=False), 1.0, "logits"))
    return out


def routings(key, n: int, e: int, k: int, h: int, count: int):
    """``count`` routings: x ``[N, H]`` bf16, top-k expert ids ``[N, K]`` of random router
    logits ``[N, E]`` (bf16) and their weights ``[N, K]`` (softmax, top-k, normalised: what
    ``route_topk`` makes of the logits)."""
    xs, idss, ws, lgs = [], [], [], []
    for _ in range(count):
        kx, kr, key = jax.random.split(key, 3)
        logits = jax.random.normal(kr, (n, e)).astype(jnp.bfloat16)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        w, ids = jax.lax.top_k(probs, k)
        xs.append(jax.random.normal(kx, (n, h), jnp.float32).astype(jnp.bfloat16))
        idss.append(ids.astype(jnp.int32))
        ws.append(w / jnp.sum(w, axis=-1, keepdims=True))
        lgs.append(logits)
    return xs, idss, ws, lgs


def reference(x, ids, w, gu, dn) -> np.ndarray:
    """The float32 weighted output ``[N, H]`` of the XLA reference, one token at a time (no
    ``[N, K, 2I, H]`` gathered weights)."""
    y = jax.lax.map(lambda a: moe_experts_reference(a[0][None], a[1][None], gu, dn)[0],
                    (x, ids))
    return np.einsum("nkh,nk->nh", np.asarray(y, np.float32), np.asarray(w, np.float32))


def bench_shape(results: Results, a, name: str, dims, ns, variants) -> None:
    """Every N and variant at one expert shape."""
    e, k, h, i = dims
    kg, kd, key = jax.random.split(jax.random.key(0), 3)
    gu = (jax.random.normal(kg, (e, 2 * i, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    dn = (jax.random.normal(kd, (e, h, i), jnp.float32) * i ** -0.5).astype(jnp.bfloat16)
    expert_bytes = 3 * h * i * 2
    for n in ns:
        xs, idss, ws, lgs = routings(jax.random.fold_in(key, n), n, e, k, h, a.routings)
        hit = float(np.mean([np.unique(np.asarray(ids)).size for ids in idss]))
        ref = reference(xs[0], idss[0], ws[0], gu, dn)
        flops = 6.0 * h * i * n * k
        for label, fn, share, kind in cases(variants, n, e, k, h, i, a.sweep):
            inputs, routes = xs, (lgs if kind == "logits" else idss)
            if kind == "h":  # the down kernel alone reads the gate/up kernel's output
                t = default_few_tiles(n * k, n, h, i)
                inputs = [few_gate_up(x, ids, gu, t) for x, ids in zip(xs, idss)]
            f = chained(fn)
            try:
                out = np.asarray(f(inputs, routes, ws, gu, dn)[0], np.float32)
                sec = wall_seconds(lambda: f(inputs, routes, ws, gu, dn), reps=a.reps)
            except Exception as ex:  # noqa: BLE001 - a tiling may not compile; go on
                if label in ("ref", "xla"):
                    raise
                print(f"moe {name} N={n} {label}: failed: {type(ex).__name__}: "
                      f"{str(ex)[:200]}", file=sys.stderr, flush=True)
                continue
            sec /= a.routings
            checked = kind in (None, "logits")
            err = float(np.abs(out - ref).max() / np.abs(ref).max()) if checked else None
            io = n * h * 2 * 2 if checked else n * h * 2 + n * k * i * 2
            results.add(op_row("moe", f"{name} E={e} top{k} H={h} I={i} N={n}", label, sec,
                               hit * expert_bytes * share + io, hbm_tbps=a.hbm_tbps,
                               error=err, reference="xla reference f32" if checked else None,
                               experts_hit=hit, tflops=flops * share / sec / 1e12,
                               of_peak_flops=flops * share / sec / (a.peak_tflops * 1e12)))


def bench(a, results: Results) -> None:
    """Every shape, N and variant of the flags (see the module docstring)."""
    if a.sweep:
        require_gpu("moe --sweep", "leave --sweep out to time the XLA variants only")
    variants = pick_variants("moe", a.variants, ["ref", "xla", "pallas"], GPU_ONLY)
    shapes = [shape("a3b")] if a.quick else a.shapes
    ns = [1, 8, 128, 8192] if a.quick else a.ns
    for name, dims in shapes:
        bench_shape(results, a, name, dims, ns, variants)


def main(argv=None) -> int:
    """``python -m mtp_jax.bench moe``; 0, or 2 for refused flags."""
    return run("moe", build_parser(), bench, argv)
