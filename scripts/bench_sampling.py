"""Micro-benchmark of the sampling filter (GPU helper; not part of the test suite).

Times ``mtp_jax.sampling.filtered_probs`` (temperature 0.7 with top-p / top-k; the parameters
are arrays, as in the engine's programs) on bf16 logits of the real vocabulary (248,320 ids)
for a range of row counts: 7 rows are what a batch-1 k = 3 round filters (4 verify rows and 3
draft steps), 224 a batch-32 one. Two paths: the candidates (the default, ``keep_set``) and the
whole-row sort (``keep_set.MIN_VOCAB`` raised above the vocabulary). Logits: ``peaked`` (N(0, 2)
with 40 ids raised by 8-16, the shape of a real model's output) or ``flat`` (N(0, 1): top-p 0.9
keeps ~100k ids, so the candidates cannot decide and the sort runs as well). Wall time of a
jitted call after ``block_until_ready``, median of ``--reps``; ``valid``: the rows the
candidates decided; ``same``: both paths keep the same ids.

Usage: PYTHONPATH=. python scripts/bench_sampling.py [--rows 1,7,28,56,224] [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mtp_jax.sampling import keep_set, sampling  # noqa: E402
from bench_draft_head import _time  # noqa: E402  (scripts/, this script's folder)

VOCAB = 248320
SETTINGS = (("top_p 0.9", 0, 0.9), ("top_k 50", 50, 1.0), ("k 50, p 0.95", 50, 0.95),
            ("T only", 0, 1.0))


def median_ms(fn, *args, reps: int) -> float:
    return _time(fn, args, reps) * 1e3


def logits(kind: str, rows: int) -> jax.Array:
    key = jax.random.key(rows)
    x = jax.random.normal(key, (rows, VOCAB), jnp.float32) * (2.0 if kind == "peaked" else 1.0)
    if kind == "peaked":
        hot = jax.random.randint(jax.random.fold_in(key, 1), (rows, 40), 0, VOCAB)
        boost = jax.random.uniform(jax.random.fold_in(key, 2), (rows, 40), minval=8, maxval=16)
        x = x.at[jnp.arange(rows)[:, None], hot].add(boost)
    return x.astype(jnp.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,7,28,56,224")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; ms per filtered_probs call")
    default_min = keep_set.MIN_VOCAB

    for kind in ("peaked", "flat"):
        for rows in (int(r) for r in args.rows.split(",")):
            x = logits(kind, rows)
            for label, top_k, top_p in SETTINGS:
                k = jnp.full((rows,), top_k, jnp.int32)
                p = jnp.full((rows,), top_p, jnp.float32)
                # one function per jit (jax caches traces per function); MIN_VOCAB is read
                # at trace time, so the first traces the whole-row sort
                keep_set.MIN_VOCAB = VOCAB + 1
                by_sort = jax.jit(lambda x, k, p: sampling.filtered_probs(x, 0.7, k, p))
                ms_sort = median_ms(by_sort, x, k, p, reps=args.reps)
                keep_set.MIN_VOCAB = default_min
                by_cand = jax.jit(lambda x, k, p: sampling.filtered_probs(x, 0.7, k, p))
                ms_cand = median_ms(by_cand, x, k, p, reps=args.reps)
                a, b = by_sort(x, k, p), by_cand(x, k, p)
                xf = x.astype(jnp.float32)
                k_eff = jnp.where(k > 0, k, VOCAB)
                *_, valid = jax.jit(keep_set.prefix_end_candidates)(
                    xf, jnp.max(xf, -1, keepdims=True), jnp.full((rows,), 0.7), k_eff, p,
                    p >= 1)
                print(f"{kind:6s} rows {rows:4d} {label:13s} sort {ms_sort:8.3f}  candidates "
                      f"{ms_cand:8.3f}  valid {int(valid.sum())}/{rows}  kept (row 0) "
                      f"{int((b[0] > 0).sum())}  same {bool(jnp.all((a > 0) == (b > 0)))}",
                      flush=True)


if __name__ == "__main__":
    main()
