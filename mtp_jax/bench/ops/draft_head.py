"""``python -m mtp_jax.bench draft-head``: one MTP draft token
(``mtp_jax.speculative.mtp.draft_token``) with each draft LM head.

Heads (``--heads``): ``full`` (the target's LM head, ``z @ W.T`` over V rows as the ``reduce``
backend runs one row), ``hot`` (the reduced draft head of the ``--n`` lowest token ids,
``--speculative-draft-vocab-size``) and ``int8`` (all V rows in int8 with the re-scoring,
``--speculative-draft-head-dtype int8``); each greedy-only and sampled (temperature 0.8,
top-p 0.95: the filtered softmax over the N or V logits, and the hot q scattered into
``[B, V]``). Shapes from ``--config`` (default the Qwen3.5-2B, Qwen3.6-35B-A3B and Qwen3.6-27B
configs under ``configs/``: hidden size H, vocabulary V), bf16 weights, batch ``--batch``.
``--quick``: the 27B shape at batch 1.

Time: the median wall time of one waited-for jitted call over ``--reps`` (warm-up excluded),
so a dispatch is in it; a round with k drafts calls this k times. Bytes: the head's weights
(V H 2, N H 2, or V (H + 4) for int8). Notes: ``speedup`` over the full head.

``--parts``: instead, the device-side pieces of one draft token at ``[V, H]`` (one row): the
bf16 head, the int8 head's product, ``lax.top_k`` against the block-maximum candidates, the
re-scoring; each run 10 times in one ``fori_loop`` (its first argument scaled by a
loop-dependent 1 so that XLA cannot hoist it), time per iteration, the loop's own cost in it
(see the ``noop`` row). All XLA: runs on a CPU too (with a small ``--config``).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp

from mtp_jax.bench.report import SOURCE_ROOT, op_row
from mtp_jax.bench.subcommand import (Results, config_of, int_list, name_list, parser,
                                      positive, run)
from mtp_jax.bench.timing import wall_seconds
from mtp_jax.models.draft_head import DraftHead, candidates, rescore
from mtp_jax.models.layers.int8_rows import int8_matmul, quantize_rows
from mtp_jax.sampling import SamplingTensors
from mtp_jax.speculative.mtp import draft_token
from pallas_kernels.gemv import gemv

SUMMARY = "one MTP draft token with the full, hot-ids and int8 draft LM heads"
CONFIGS = ("Qwen3.5-2B", "Qwen3.6-35B-A3B", "Qwen3.6-27B")
HEADS = ("full", "hot", "int8")


def build_parser() -> argparse.ArgumentParser:
    """The ``draft-head`` flags."""
    p = parser("draft-head", __doc__)
    p.add_argument("--config", action="append", default=None,
                   help="config.json path(s) for the shapes (repeat; default the Qwen "
                        "configs under configs/)")
    p.add_argument("--quick", action="store_true", help="the 27B shape, batch 1 only")
    p.add_argument("--n", type=positive(int), default=32768,
                   help="hot token ids of the hot head (default 32768)")
    p.add_argument("--heads", type=name_list(HEADS), default=list(HEADS),
                   help="full, hot, int8 (default all)")
    p.add_argument("--batch", type=int_list, default=[1, 8, 32], help="default 1,8,32")
    p.add_argument("--reps", type=positive(int), default=20, help="timed calls (default 20)")
    p.add_argument("--parts", action="store_true",
                   help="time the int8 head's pieces instead of whole draft tokens")
    return p


class HeadOnly:
    """What ``draft_token`` reads of a model: ``cfg.vocab_size``, ``draft_logits`` and
    ``draft_greedy``, over the LM head table ``w [V, H]`` and a draft head (``None``: the
    full head)."""

    def __init__(self, w: jax.Array, head: DraftHead | None, vocab: int):
        self.cfg = argparse.Namespace(vocab_size=vocab)
        self.w, self.draft_head = w, head

    def draft_logits(self, z):
        """``(logits [B, N] float32, hot ids [N] or None)``."""
        if self.draft_head is None:
            return gemv(z, self.w, backend="reduce").astype(jnp.float32), None
        ids = None if self.draft_head.ids is None else self.draft_head.ids[...]
        return self.draft_head(z, self.w), ids

    def draft_greedy(self, z):
        """Greedy token ids ``[B]``: the int8 head's re-scored candidates' best, else the
        argmax of :meth:`draft_logits` mapped to token ids."""
        head = self.draft_head
        if head is not None and head.scale is not None:
            return head.greedy(z, self.w)
        logits, hot = self.draft_logits(z)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return tok if hot is None else jnp.take(hot, tok)


def token_fn(vocab: int, greedy_only: bool):
    """A jit of one draft token (draft step 0) from ``(w, head, z, sampling, step)``."""
    def f(w, head, z, sampling, step):
        return draft_token(HeadOnly(w, head, vocab), z, sampling, step, 0, greedy_only)
    return jax.jit(f)


def loop_seconds(f, *args, reps: int, inner: int = 10) -> float:
    """Wall seconds of ``f(*args)`` run ``inner`` times in one ``fori_loop`` (median of
    ``reps``), per iteration."""
    def body(i, c):
        a0 = args[0] * (1 + i.astype(args[0].dtype) * 1e-30).astype(args[0].dtype)
        return c + f(a0, *args[1:])[..., :1].sum().astype(jnp.float32)

    g = jax.jit(lambda: jax.lax.fori_loop(0, inner, body, jnp.float32(0)))
    return wall_seconds(g, reps=reps) / inner


def parts(v: int, h: int, reps: int) -> dict[str, float]:
    """Seconds of each device-side piece of one draft token at ``[V, H]`` (one row)."""
    key = jax.random.key(0)
    w = (jax.random.normal(key, (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    q, scale = jax.jit(quantize_rows)(w)
    z = jax.random.normal(key, (1, h), jnp.bfloat16)
    logits = jax.random.normal(key, (1, v), jnp.float32)
    cand = candidates(logits)
    one_row = lambda z, q, s: jnp.sum(z.astype(jnp.float32)[:, None] * q.astype(jnp.float32),
                                      -1) * s
    t = lambda f, *a: loop_seconds(f, *a, reps=reps)
    return {"noop (the loop's own cost)": t(lambda x: x[..., :1] * 2, z),
            "bf16 head, one-row reduce form": t(lambda z, w: gemv(z, w, backend="reduce"), z, w),
            "int8 head, one-row multiply-reduce": t(one_row, z, q, scale),
            "int8 head, int8_matmul": t(int8_matmul, z, q, scale),
            "lax.top_k 8 of V": t(lambda x: jax.lax.top_k(x, 8)[0], logits),
            "candidates (block max + top_k)": t(lambda x: candidates(x), logits),
            "rescore (candidates, gather, dot, put)": t(
                lambda x, z, w: rescore(x, z, w, None), logits, z, w),
            "gather + dot of the candidates": t(
                lambda z, w, c: jnp.einsum("bh,brh->br", z, jnp.take(w, c, axis=0),
                                           preferred_element_type=jnp.float32), z, w, cand)}


def heads_of(w, kinds, n: int) -> dict[str, tuple[DraftHead | None, int, str]]:
    """``kind -> (draft head, bytes per call, label)`` for the heads asked for."""
    v, h = w.shape
    out = {"full": (None, v * h * 2, f"full V={v}")}
    if "hot" in kinds:
        hot = jnp.arange(n, dtype=jnp.int32)
        out["hot"] = (DraftHead(jnp.take(w, hot, axis=0), hot), n * h * 2, f"hot N={n}")
    if "int8" in kinds:
        q, scale = jax.jit(quantize_rows)(w)
        out["int8"] = (DraftHead(q, None, scale), v * (h + 4), f"int8 V={v}")
    return {k: out[k] for k in kinds}


def bench_config(results: Results, a, path: str, batches) -> None:
    """Every batch, mode and head at one config's shape."""
    cfg = config_of(path)
    name = os.path.splitext(os.path.basename(path))[0]
    v, h, n = cfg.vocab_size, cfg.hidden_size, min(a.n, cfg.vocab_size)
    if a.parts:
        for part, sec in parts(v, h, a.reps).items():
            results.add(op_row("draft-head part", f"{name} V={v} H={h}", part, sec, None))
        return
    key = jax.random.key(0)
    w = (jax.random.normal(key, (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    heads = heads_of(w, a.heads, n)
    for b in batches:
        z = jax.random.normal(jax.random.fold_in(key, b), (b, h), jnp.bfloat16)
        sampling = SamplingTensors.from_params([(0.8, -1, 0.95, i) for i in range(b)])
        step = jnp.zeros((b,), jnp.int32)
        for greedy_only in (True, False):
            fn, full = token_fn(v, greedy_only), None
            for kind, (head, nbytes, label) in heads.items():
                sec = wall_seconds(lambda: fn(w, head, z, sampling, step), reps=a.reps)
                full = sec if kind == "full" else full
                notes = {} if full is None or kind == "full" else {"speedup": full / sec}
                results.add(op_row("draft-head",
                                   f"{name} B={b} {'greedy' if greedy_only else 'sampled'}",
                                   label, sec, nbytes, hbm_tbps=a.hbm_tbps, **notes))


def bench(a, results: Results) -> None:
    """Every config of the flags (see the module docstring)."""
    default = [os.path.join(SOURCE_ROOT, "configs", f"{c}.json")
               for c in (CONFIGS[-1:] if a.quick else CONFIGS)]
    for path in a.config or default:
        bench_config(results, a, path, [1] if a.quick else a.batch)


def main(argv=None) -> int:
    """``python -m mtp_jax.bench draft-head``; 0, or 2 for a config it cannot read."""
    return run("draft-head", build_parser(), bench, argv)
