"""``python -m mtp_jax.bench.quant_gemv``: one projection of kept-quantized weights
(``quantization="keep"``) against bf16, at the 27B's shapes, 1 and 4 rows.

Variants, each over ``COPIES`` distinct weights per program (beyond the 50 MB L2):

* bf16: ``reduce`` (the engine's one-row multiply-reduce form) and ``xla_dot``;
* fp8 (128 x 128 block scales) and nvfp4 (packed e2m1, F8_E4M3 group scales, float32
  ``scale_2``): ``xla_dequant_reduce`` / ``xla_dequant_dot`` (the weights dequantized by XLA
  inside the program, then the same two forms: keep's XLA path) and ``triton`` (the
  dequantizing GEMV, :func:`pallas_kernels.quant.quant_gemv`; GPU only).

Time: on a GPU the kernels' device time from a profiler trace
(:func:`mtp_jax.bench.timing.device_seconds`), elsewhere the wall time of tiny shapes (a smoke
run). ``tbps``: the held bytes over that time. ``rel_err`` (triton): max |y - ref| / max |ref|
against float32 sums of the dequantized weights. Prints one dict per row and writes
``$OUT/quant_gemv.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench.timing import device_seconds, wall_seconds
from pallas_kernels.gemv import reduce_matmul
from pallas_kernels.quant.formats import QuantFormat, dequantize, stored_bytes
from pallas_kernels.quant.gemv import quant_gemv

SHAPES = [("27B gate_up", 34816, 5120), ("27B down", 5120, 17408), ("27B gdn_in", 16480, 5120)]
COPIES = 8
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


def variants(kind: str, fmt, gpu: bool) -> dict:
    if kind == "bf16":
        return {"reduce": lambda x, ps: [reduce_matmul(x, w) for w, _, _ in ps],
                "xla_dot": lambda x, ps: [x @ w.T for w, _, _ in ps]}
    out = {"xla_dequant_reduce": lambda x, ps: [
               reduce_matmul(x, dequantize(fmt, c, s, s2, jnp.bfloat16)) for c, s, s2 in ps],
           "xla_dequant_dot": lambda x, ps: [
               x @ dequantize(fmt, c, s, s2, jnp.bfloat16).T for c, s, s2 in ps]}
    out["triton"] = lambda x, ps: [quant_gemv(x, fmt, c, s, s2, out_dtype=jnp.bfloat16,
                                              interpret=not gpu) for c, s, s2 in ps]
    return out


def run(shapes, copies: int, rows_list, gpu: bool) -> list[dict]:
    timer = device_seconds if gpu else (lambda call, calls: wall_seconds(call, reps=calls))
    key, out = jax.random.PRNGKey(0), []
    for name, n, k in shapes:
        for kind in ("bf16", "fp8", "nvfp4"):
            fmt = None if kind == "bf16" else QuantFormat(
                kind, (128, 128) if kind == "fp8" else (1, 16), k)
            parts = [random_parts(jax.random.fold_in(key, c), kind, n, k) for c in range(copies)]
            nbytes = copies * (n * k * 2 if kind == "bf16" else stored_bytes(fmt, n))
            for rows in rows_list:
                x = jax.random.normal(key, (rows, k), jnp.bfloat16)
                for vname, fn in variants(kind, fmt, gpu).items():
                    f = jax.jit(fn)
                    t = timer(lambda: f(x, parts), calls=5)
                    row = dict(shape=name, kind=kind, rows=rows, variant=vname,
                               us=round(t * 1e6 / copies, 1), tbps=round(nbytes / t / 1e12, 2))
                    if vname == "triton":
                        w = dequantize(fmt, *parts[0], jnp.bfloat16).astype(jnp.float32)
                        ref = np.asarray(x.astype(jnp.float32) @ w.T)
                        got = np.asarray(jax.jit(fn)(x, parts[:1])[0], np.float32)
                        row["rel_err"] = float(np.abs(got - ref).max() / np.abs(ref).max())
                    print(row, flush=True)
                    out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench.quant_gemv",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "quant_gemv.json"))
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    shapes, copies, rows = (SHAPES, COPIES, (1, 4)) if gpu else ([("tiny", 256, 512)], 2, (1,))
    rows_out = run(shapes, copies, rows, gpu)
    with open(a.out, "w") as f:
        json.dump(rows_out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
