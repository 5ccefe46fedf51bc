"""``python -m mtp_jax.bench.quant_gemv``: one projection of kept-quantized weights
(``quantization="keep"``) against bf16, at the 27B's shapes, 1 and 4 rows.

Variants, each over ``COPIES`` distinct weights per program (beyond the 50 MB L2); by default
all but ``xla_dequant_*`` (``--variants all`` adds them):

* bf16: ``reduce`` (the engine's one-row multiply-reduce form) and ``xla_dot``;
* fp8 (128 x 128 block scales) and nvfp4 (packed e2m1, F8_E4M3 group scales, float32
  ``scale_2``): ``xla_dequant_reduce`` / ``xla_dequant_dot`` (the weights dequantized by XLA
  inside the program, then the same two forms: keep's XLA path) and the dequantizing GEMV
  (:func:`pallas_kernels.quant.quant_gemv`; interpret mode off a GPU) in the tiles of
  :func:`triton_tiles`: ``triton`` (the default: the engine's), ``triton_s1`` (K not split:
  session 32's kernel), ``triton_wide`` (8 KiB of codes per step), and where K > N the split
  swept (``triton_s4``, ``triton_s8``).

Time: on a GPU the kernels' device time from a profiler trace
(:func:`mtp_jax.bench.timing.device_seconds`; a split's XLA reduce of the partials included),
elsewhere the wall time of tiny shapes (a smoke run). ``us``: per projection; ``tbps``: the
held bytes over that time; ``first_s``: the first call's wall seconds (compile + run).
Triton rows add ``tiles`` (``bn``, ``bk``, warps, ``S`` = the slices of K as resolved) and
``rel_err``: max |y - ref| / max |ref| against float32 sums of the dequantized weights; a
variant that resolves to an earlier one's tiles is not run again (``same_as``). Prints one dict
per row and writes ``$OUT/quant_gemv.json`` (or ``--out``); ``--variants`` / ``--shapes`` keep
only the named ones.
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
from pallas_kernels.gemv import reduce_matmul
from pallas_kernels.quant.formats import QuantFormat, dequantize, stored_bytes
from pallas_kernels.quant.gemv import quant_gemv
from pallas_kernels.quant.gemv_tiles import QuantGemvTiles, default_tiles, split_plan

SHAPES = [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408), ("27B gdn_in", 16480, 5120)]
COPIES = 8
TRITON = ("triton", "triton_s1", "triton_wide", "triton_s4", "triton_s8")
DEFAULT_VARIANTS = ("reduce", "xla_dot", *TRITON)  # keep's XLA forms: session 32, 0.1-1.6 TB/s
FP8_MAX = 448.0


def random_parts(key, kind: str, n: int, k: int):
    """One ``[n, k]`` weight's device parts in ``kind`` (finite fp8 codes and scales)."""
    if kind == "bf16":
        return jax.random.normal(key, (n, k), jnp.bfloat16) * 0.02, None, None
    if kind == "fp8":
        codes = jnp.clip(jax.random.normal(key, (n, k)) * 100, -FP8_MAX, FP8_MAX)
        return (codes.astype(jnp.float8_e4m3fn),
                jax.random.uniform(key, (-(-n // 128), -(-k // 128))) * 1e-3, None)
    return (jax.random.randint(key, (n, k // 2), 0, 256).astype(jnp.uint8),
            (jax.random.uniform(key, (n, k // 16)) * 4).astype(jnp.float8_e4m3fn),
            jax.random.uniform(key, (n,)) * 1e-2)


def triton_tiles(fmt: QuantFormat, n: int, k: int, rows: int) -> dict[str, QuantGemvTiles]:
    """The Triton variants' tiles for ``rows`` rows of ``W [n, k]``: ``triton`` (the defaults,
    the automatic split), ``triton_s1`` (no split), ``triton_wide`` (fp8 64 x 128, nvfp4
    32 x 512 codes: 8 KiB a step; 8 warps, ``[bn]`` accumulators; automatic split); where
    ``k > n`` also ``triton_s4`` and ``triton_s8``."""
    base = default_tiles(fmt, n, k, rows)
    wide = base._replace(bn=64 if fmt.kind == "fp8" else 32, num_warps=8, reduce_each=True)
    out = {"triton": base, "triton_s1": base._replace(split_k=1), "triton_wide": wide}
    if k > n:
        out.update(triton_s4=base._replace(split_k=4), triton_s8=base._replace(split_k=8))
    return out


def variants(kind: str, fmt, n: int, k: int, rows: int, gpu: bool) -> dict:
    """``{name: (fn(x, parts) -> [y per copy], tiles or None)}`` of one kind and shape."""
    if kind == "bf16":
        return {"reduce": (lambda x, ps: [reduce_matmul(x, w) for w, _, _ in ps], None),
                "xla_dot": (lambda x, ps: [x @ w.T for w, _, _ in ps], None)}
    out = {"xla_dequant_reduce": (lambda x, ps: [
               reduce_matmul(x, dequantize(fmt, c, s, s2, jnp.bfloat16)) for c, s, s2 in ps],
               None),
           "xla_dequant_dot": (lambda x, ps: [
               x @ dequantize(fmt, c, s, s2, jnp.bfloat16).T for c, s, s2 in ps], None)}
    for name, tiles in triton_tiles(fmt, n, k, rows).items():
        out[name] = (lambda x, ps, t=tiles: [
            quant_gemv(x, fmt, c, s, s2, out_dtype=jnp.bfloat16, tiles=t, interpret=not gpu)
            for c, s, s2 in ps], tiles)
    return out


def reference(x, fmt, part) -> np.ndarray:
    """``[rows, n]`` float32 product of ``x`` and one copy's dequantized (bf16) weights."""
    w = dequantize(fmt, *part, jnp.bfloat16).astype(jnp.float32)
    return np.asarray(x.astype(jnp.float32) @ w.T)


def rel_err(got, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|."""
    return float(np.abs(np.asarray(got, np.float32) - ref).max() / np.abs(ref).max())


def measure(fn, x, parts, timer, nbytes: int) -> tuple[dict, list]:
    """``({us, tbps, first_s}, outputs)`` of one jitted variant over ``len(parts)`` copies."""
    f = jax.jit(fn)
    t0 = time.perf_counter()
    ys = jax.block_until_ready(f(x, parts))
    first = time.perf_counter() - t0
    t = timer(lambda: f(x, parts), calls=5)
    return dict(us=round(t * 1e6 / len(parts), 1), tbps=round(nbytes / t / 1e12, 2),
                first_s=round(first, 2)), ys


def run(shapes, copies: int, rows_list, gpu: bool, keep=DEFAULT_VARIANTS) -> list[dict]:
    """One row per shape, kind, rows and variant named in ``keep`` (``None``: all). A Triton
    variant whose tiles and resolved split equal an earlier one's is not run again: its row
    says ``same_as`` that one."""
    timer = device_seconds if gpu else (  # the smoke run: two calls, already compiled
        lambda call, calls: wall_seconds(call, reps=2, warmup=0))
    key, out = jax.random.PRNGKey(0), []
    for name, n, k in shapes:
        for kind in ("bf16", "fp8", "nvfp4"):
            fmt = None if kind == "bf16" else QuantFormat(
                kind, (128, 128) if kind == "fp8" else (1, 16), k)
            parts = [random_parts(jax.random.fold_in(key, c), kind, n, k) for c in range(copies)]
            nbytes = copies * (n * k * 2 if kind == "bf16" else stored_bytes(fmt, n))
            for rows in rows_list:
                x = jax.random.normal(key, (rows, k), jnp.bfloat16)
                ref, seen = None, {}
                for vname, (fn, tiles) in variants(kind, fmt, n, k, rows, gpu).items():
                    if keep is not None and vname not in keep:
                        continue
                    row = dict(shape=name, kind=kind, rows=rows, variant=vname)
                    if tiles is not None:
                        s = split_plan(fmt, n, k, tiles)[0]
                        row["tiles"] = f"bn{tiles.bn} bk{tiles.bk} w{tiles.num_warps} S{s}"
                        resolved = tiles._replace(split_k=s)
                        if resolved in seen:
                            row["same_as"] = seen[resolved]
                            print(row, flush=True)
                            out.append(row)
                            continue
                        seen[resolved] = vname
                    timing, ys = measure(fn, x, parts, timer, nbytes)
                    row.update(timing)
                    if tiles is not None:
                        ref = reference(x, fmt, parts[0]) if ref is None else ref
                        row["rel_err"] = rel_err(ys[0], ref)
                    print(row, flush=True)
                    out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench.quant_gemv",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quant_gemv.json"))
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma-separated variant names to run, or 'all' (default: %(default)s)")
    p.add_argument("--shapes", default="",
                   help="comma-separated shape names to run (gate_up, down, gdn_in; default: "
                        "all three on a GPU)")
    a = p.parse_args(argv)
    keep = None if a.variants == "all" else {v for v in a.variants.split(",") if v}
    gpu = jax.default_backend() == "gpu"
    shapes, copies, rows = (SHAPES, COPIES, (1, 4)) if gpu else ([("tiny", 256, 512)], 1, (1,))
    if a.shapes:
        shapes = [s for s in shapes if s[0].split()[-1] in a.shapes.split(",")]
    t0 = time.perf_counter()
    rows_out = run(shapes, copies, rows, gpu, keep)
    print(f"quant_gemv bench: {len(rows_out)} rows in {time.perf_counter() - t0:.1f} s",
          flush=True)
    with open(a.out, "w") as f:
        json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
