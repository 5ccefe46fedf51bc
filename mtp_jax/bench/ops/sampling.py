"""``python -m mtp_jax.bench sampling``: the sampling filter (``mtp_jax.sampling.filtered_probs``)
at the real vocabulary, whole-row sort against candidates.

Times ``filtered_probs`` (temperature ``--temperature`` with top-p / top-k, both given as
arrays as in the engine's programs) on bf16 logits of ``--vocab`` ids (default 248,320, the
Qwen3.5 vocabulary) for each ``--rows`` count: 7 rows are what a batch-1 k = 3 round filters
(4 verify rows and 3 draft steps), 224 a batch-32 one.

Variants: ``sort`` (every filtered row sorted whole: ``keep_set.MIN_VOCAB`` raised above the
vocabulary while the program is traced) and ``candidates`` (each chunk's largest logits, the
sort only for rows they cannot decide: ``MIN_VOCAB`` at most the vocabulary; the engine's path
at 248,320 ids). Logits (``--kinds``): ``peaked`` (N(0, 2) with 40 ids raised by 8-16, the
shape of a trained model's output) or ``flat`` (N(0, 1): top-p 0.9 keeps ~100k ids, so the
candidates cannot decide and the sort runs as well). Filters (``--filters``): ``top_p`` (0.9),
``top_k`` (50), ``both`` (top-k 50, top-p 0.95), ``none`` (temperature only).

Time: the median wall time of one jitted call, each waited for, over ``--reps`` (warm-up
excluded). Bytes: the logits read (bf16) and the probabilities written (float32). Error: the
largest |p - p_sort| (reference ``sort``). Notes: ``valid``, the rows the candidates decided;
``kept_row0``, the ids row 0 keeps; ``same``, whether both variants keep the same ids.
``--quick``: rows 1, 7 and 224 of peaked logits (without a GPU at most 8,192 ids and 5 timed
calls). All XLA: runs on a CPU too (``--vocab 4096 --rows 2`` for a quick check).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from mtp_jax.bench.report import op_row
from mtp_jax.bench.subcommand import (Results, int_list, name_list, on_gpu, parser,
                                      pick_variants, positive, run)
from mtp_jax.bench.timing import wall_seconds
from mtp_jax.sampling import filtered_probs, keep_set

SUMMARY = ("the sampling filter (top-p / top-k over the vocabulary): whole-row sort against "
           "candidates")
VOCAB = 248320
FILTERS = {"top_p": (0, 0.9), "top_k": (50, 1.0), "both": (50, 0.95), "none": (0, 1.0)}
KINDS = ("peaked", "flat")
VARIANTS = ("sort", "candidates")
MIN_IDS = keep_set.NUM_CHUNKS * keep_set.PER_CHUNK  # the candidates need this many ids
QUICK_CPU_VOCAB = 8192  # --quick without a GPU


def vocab_size(text: str) -> int:
    """argparse type of ``--vocab``: an int of at least :data:`MIN_IDS`."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if v < MIN_IDS:
        raise argparse.ArgumentTypeError(
            f"{v} is below {MIN_IDS} ({keep_set.NUM_CHUNKS} chunks of {keep_set.PER_CHUNK} "
            f"candidates); pass --vocab {MIN_IDS} or more")
    return v


def build_parser() -> argparse.ArgumentParser:
    """The ``sampling`` flags."""
    p = parser("sampling", __doc__)
    p.add_argument("--rows", type=int_list, default=[1, 7, 28, 56, 224],
                   help="row counts, comma-separated (default 1,7,28,56,224)")
    p.add_argument("--vocab", type=vocab_size, default=VOCAB,
                   help=f"ids per row (default {VOCAB}; at least {MIN_IDS})")
    p.add_argument("--quick", action="store_true",
                   help="rows 1, 7 and 224 of peaked logits only (overrides --rows, --kinds; "
                        f"without a GPU also at most {QUICK_CPU_VOCAB} ids and 5 timed calls)")
    p.add_argument("--kinds", type=name_list(KINDS), default=list(KINDS),
                   help="logits: peaked, flat (default both)")
    p.add_argument("--filters", type=name_list(FILTERS), default=list(FILTERS),
                   help="top_p, top_k, both, none (default all)")
    p.add_argument("--temperature", type=positive(float), default=0.7,
                   help="temperature of every row (default %(default)s)")
    p.add_argument("--variants", type=name_list(VARIANTS), default=None,
                   help="sort, candidates (default both)")
    p.add_argument("--reps", type=int, default=30, help="timed calls (default %(default)s)")
    return p


def logits(kind: str, rows: int, vocab: int) -> jax.Array:
    """``[rows, vocab]`` bf16 logits of ``kind`` (``peaked`` or ``flat``), seeded by ``rows``."""
    key = jax.random.key(rows)
    x = jax.random.normal(key, (rows, vocab), jnp.float32) * (2.0 if kind == "peaked" else 1.0)
    if kind == "peaked":
        hot = jax.random.randint(jax.random.fold_in(key, 1), (rows, 40), 0, vocab)
        boost = jax.random.uniform(jax.random.fold_in(key, 2), (rows, 40), minval=8, maxval=16)
        x = x.at[jnp.arange(rows)[:, None], hot].add(boost)
    return x.astype(jnp.bfloat16)


def compiled(variant: str, temperature: float, *args):
    """``filtered_probs`` compiled for ``args`` (logits, top_k, top_p) with ``MIN_VOCAB`` set
    for ``variant`` while it is traced (restored after)."""
    vocab = args[0].shape[-1]
    old = keep_set.MIN_VOCAB
    keep_set.MIN_VOCAB = vocab + 1 if variant == "sort" else min(old, vocab)
    try:
        fn = jax.jit(lambda x, k, p: filtered_probs(x, temperature, k, p))
        return fn.lower(*args).compile()
    finally:
        keep_set.MIN_VOCAB = old


def decided_rows(x, temperature: float, k, p) -> int:
    """Rows whose kept set the candidates decide (``prefix_end_candidates``'s ``valid``)."""
    xf = x.astype(jnp.float32)
    k_eff = jnp.where(k > 0, k, x.shape[-1])
    t = jnp.full(k.shape, temperature, jnp.float32)
    *_, valid = jax.jit(keep_set.prefix_end_candidates)(
        xf, jnp.max(xf, -1, keepdims=True), t, k_eff, p, p >= 1)
    return int(valid.sum())


def bench(args, results: Results) -> None:
    """Every kind, row count, filter and variant of the flags (see the module docstring)."""
    variants = pick_variants("sampling", args.variants, list(VARIANTS), ())
    if args.quick:
        args.rows, args.kinds = [1, 7, 224], ["peaked"]
        if not on_gpu():  # the whole vocabulary's sort of 224 rows takes minutes on a CPU
            args.vocab, args.reps = min(args.vocab, QUICK_CPU_VOCAB), min(args.reps, 5)
            print(f"note: sampling --quick without a GPU: {args.vocab} ids per row, "
                  f"{args.reps} timed calls", file=sys.stderr)
    for kind in args.kinds:
        for rows in args.rows:
            x = logits(kind, rows, args.vocab)
            nbytes = rows * args.vocab * (2 + 4)
            for name in args.filters:
                top_k, top_p = FILTERS[name]
                k = jnp.full((rows,), top_k, jnp.int32)
                p = jnp.full((rows,), top_p, jnp.float32)
                outs, secs = {}, {}
                for v in variants:
                    fn = compiled(v, args.temperature, x, k, p)
                    outs[v] = jax.block_until_ready(fn(x, k, p))
                    secs[v] = wall_seconds(lambda: fn(x, k, p), reps=args.reps)
                ref = outs.get("sort")
                valid = decided_rows(x, args.temperature, k, p)
                for v in variants:
                    same = None if ref is None else bool(jnp.all((outs[v] > 0) == (ref > 0)))
                    err = None if ref is None else float(jnp.max(jnp.abs(outs[v] - ref)))
                    results.add(op_row(
                        "sampling", f"{kind} rows={rows} V={args.vocab} {name}", v, secs[v],
                        nbytes, hbm_tbps=args.hbm_tbps, error=err,
                        reference=None if ref is None else "sort", valid=f"{valid}/{rows}",
                        kept_row0=int((outs[v][0] > 0).sum()), same=same))


def main(argv=None) -> int:
    """``python -m mtp_jax.bench sampling``; 0, or 2 for a bad value."""
    return run("sampling", build_parser(), bench, argv)
