"""Micro-benchmark of one MTP draft token (``mtp_jax.engine.programs._draft_token``): the full
LM head (``z @ W.T``, V rows, as the engine's ``reduce`` backend runs one row) against the
reduced draft head of N hot token ids (``--speculative-draft-vocab-size``) and the int8 head of
all V rows with its re-scoring (``--speculative-draft-head-dtype int8``), greedy-only and
sampled (temperature 0.8, top-p 0.95: the filtered softmax sorts the N or V logits, and the
hot q is scattered into [B, V]).

Shapes from ``configs/*.json`` (hidden size H, vocabulary V = 248,320), bf16 weights. ``bytes``
is the head's weight bytes per call (V*H*2, N*H*2, or V*(H+4) for int8); ``frac`` = bytes /
time / 4.2 TB/s. A round with k drafts calls this k times. Times are wall time per call
(median), so they include a dispatch.

    PYTHONPATH=. python3 scripts/bench_draft_head.py [--quick] [--n 32768] [--heads full,int8]
    PYTHONPATH=. python3 scripts/bench_draft_head.py --parts   # the int8 head's pieces
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.bench.floor import load_config
from mtp_jax.engine.programs import _draft_token
from mtp_jax.models.draft_head import DraftHead, candidates, rescore
from mtp_jax.models.layers.int8_rows import int8_matmul, quantize_rows
from mtp_jax.models.qwen3_5.model import Qwen35Model
from mtp_jax.sampling import SamplingTensors
from pallas_kernels.gemv import gemv

HBM_BYTES_PER_S = 4.2e12
CONFIGS = ("Qwen3.5-2B", "Qwen3.6-35B-A3B", "Qwen3.6-27B")


class _Head:
    """The part of the model ``_draft_token`` reads: ``cfg.vocab_size``, ``draft_logits`` and
    ``draft_greedy`` (the model's own)."""

    draft_greedy = Qwen35Model.draft_greedy

    def __init__(self, w, head, vocab):
        self.cfg = SimpleNamespace(vocab_size=vocab)
        self._w, self.draft_head = w, head

    def _head_table(self):
        return self._w

    def draft_logits(self, z):
        if self.draft_head is None:
            return gemv(z, self._w, backend="reduce").astype(jnp.float32), None
        ids = None if self.draft_head.ids is None else self.draft_head.ids[...]
        return self.draft_head(z, self._w), ids


def _fn(vocab, greedy_only):
    def f(w, head, z, sampling, step):
        return _draft_token(_Head(w, head, vocab), z, sampling, step, 0, greedy_only)
    return jax.jit(f)


def _time(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _loop_time(f, *args, reps: int = 15, inner: int = 10) -> float:
    """Wall time of ``f(*args)`` in us, run ``inner`` times in one ``fori_loop`` (its first
    argument scaled by a loop-dependent 1 so XLA cannot hoist it), median of ``reps``; the
    loop's own cost (about 15-30 us an iteration on the H200) is in it: see ``noop``."""
    def body(i, c):
        a0 = args[0] * (1 + i.astype(args[0].dtype) * 1e-30).astype(args[0].dtype)
        return c + f(a0, *args[1:])[..., :1].sum().astype(jnp.float32)

    g = jax.jit(lambda: jax.lax.fori_loop(0, inner, body, jnp.float32(0)))
    return _time(g, (), reps) / inner * 1e6


def parts(v: int, h: int) -> dict:
    """Device-side pieces of one draft token at ``[V, H]``, one row unless said (us per call,
    :func:`_loop_time`): the bf16 head, the int8 head's product, ``lax.top_k`` against the
    block-maximum candidates, and the re-scoring."""
    key = jax.random.key(0)
    w = (jax.random.normal(key, (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    q, scale = jax.jit(quantize_rows)(w)
    z = jax.random.normal(key, (1, h), jnp.bfloat16)
    logits = jax.random.normal(key, (1, v), jnp.float32)
    cand = candidates(logits)
    one_row = lambda z, q, s: jnp.sum(z.astype(jnp.float32)[:, None] * q.astype(jnp.float32),
                                      -1) * s  # noqa: E731
    return {"noop (the loop's own cost)": _loop_time(lambda x: x[..., :1] * 2, z),
            "bf16 head, one-row reduce form": _loop_time(
                lambda z, w: gemv(z, w, backend="reduce"), z, w),
            "int8 head, one-row multiply-reduce": _loop_time(one_row, z, q, scale),
            "int8 head, int8_matmul (dot, 8 rows)": _loop_time(int8_matmul, z, q, scale),
            "lax.top_k 8 of V": _loop_time(lambda x: jax.lax.top_k(x, 8)[0], logits),
            "candidates (block max + top_k)": _loop_time(lambda x: candidates(x), logits),
            "rescore (candidates, gather, dot, put)": _loop_time(
                lambda x, z, w: rescore(x, z, w, None), logits, z, w),
            "gather + dot of the candidates": _loop_time(
                lambda z, w, c: jnp.einsum("bh,brh->br", z, jnp.take(w, c, axis=0),
                                           preferred_element_type=jnp.float32), z, w, cand)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="27B shape, batch 1 only")
    p.add_argument("--n", type=int, default=32768, help="hot token ids (default 32768)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--heads", default="full,hot,int8",
                   help="comma-separated heads to time: full, hot (N rows), int8 (all V)")
    p.add_argument("--config", action="append", default=None,
                   help="config.json path(s) instead of the Qwen shapes (e.g. a CPU smoke run)")
    p.add_argument("--parts", action="store_true",
                   help="time the int8 head's pieces (parts()) instead of whole draft tokens")
    args = p.parse_args(argv)
    configs = [f"configs/{c}.json" for c in (CONFIGS[-1:] if args.quick else CONFIGS)]
    configs = args.config or configs
    if args.parts:
        for name in configs:
            cfg = load_config(name)
            for part, us in parts(cfg.vocab_size, cfg.hidden_size).items():
                print(f"{name.rsplit('/', 1)[-1]:24s} {part:42s} {us:8.1f} us")
        return 0
    batches = (1,) if args.quick else (1, 8, 32)
    kinds = args.heads.split(",")
    print(f"device {jax.devices()[0].device_kind}, N = {args.n}, bf16 weights")
    for name in configs:
        cfg = load_config(name)
        name = name.rsplit("/", 1)[-1].removesuffix(".json")
        if name == "config":
            name = "custom"
        v, h, n = cfg.vocab_size, cfg.hidden_size, min(args.n, cfg.vocab_size)
        key = jax.random.key(0)
        w = (jax.random.normal(key, (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
        heads = {"full": (None, v * h * 2)}
        if "hot" in kinds:
            hot = jnp.arange(n, dtype=jnp.int32)
            heads["hot"] = (DraftHead(jnp.take(w, hot, axis=0), hot), n * h * 2)
        if "int8" in kinds:
            q, scale = jax.jit(quantize_rows)(w)
            heads["int8"] = (DraftHead(q, None, scale), v * (h + 4))
        heads = {k: heads[k] for k in kinds if k in heads}
        for b in batches:
            z = jax.random.normal(jax.random.fold_in(key, b), (b, h), jnp.bfloat16)
            sampling = SamplingTensors.from_params([(0.8, -1, 0.95, i) for i in range(b)])
            step = jnp.zeros((b,), jnp.int32)
            for greedy_only in (True, False):
                ms = {}
                for kind, (head, by) in heads.items():
                    s = _time(_fn(v, greedy_only), (w, head, z, sampling, step), args.reps)
                    ms[kind] = s
                    label = {"full": f"full V={v}", "hot": f"hot  N={n}"}.get(kind, "int8 V")
                    print(f"{name:16s} B={b:<3d} {'greedy ' if greedy_only else 'sampled'} "
                          f"{label:13s} {s * 1e3:8.3f} ms  bytes {by / 1e9:6.3f} GB  "
                          f"frac {by / s / HBM_BYTES_PER_S:5.1%}")
                if "full" in ms:
                    print(f"{'':16s} speed-up over full: " + ", ".join(
                        f"{k} {ms['full'] / t:.2f}x" for k, t in ms.items() if k != "full"))
        del w, heads
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
