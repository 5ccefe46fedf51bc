"""Micro-benchmark of one MTP draft token (``mtp_jax.engine.programs._draft_token``): the full
LM head (``z @ W.T``, V rows) against the reduced draft head of N hot token ids
(``--speculative-draft-vocab-size``), greedy-only and sampled (temperature 0.8, top-p 0.95: the
filtered softmax sorts the N or V logits, and the hot q is scattered into [B, V]).

Shapes from ``configs/*.json`` (hidden size H, vocabulary V = 248,320), bf16 weights. ``bytes``
is the head's weight bytes per call (V*H*2 or N*H*2); ``frac`` = bytes / time / 4.2 TB/s. A
round with k drafts calls this k times.

    PYTHONPATH=. python3 scripts/bench_draft_head.py [--quick] [--n 32768]
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
from mtp_jax.models.draft_head import DraftHead
from mtp_jax.sampling import SamplingTensors

HBM_BYTES_PER_S = 4.2e12
CONFIGS = ("Qwen3.5-2B", "Qwen3.6-35B-A3B", "Qwen3.6-27B")


class _Head:
    """The part of the model ``_draft_token`` reads: ``cfg.vocab_size`` and ``draft_logits``."""

    def __init__(self, w, hot_w, hot, vocab):
        self.cfg = SimpleNamespace(vocab_size=vocab)
        self._w, self._hot = w, None if hot is None else DraftHead(hot_w, hot)

    def draft_logits(self, z):
        if self._hot is None:
            return jnp.einsum("bh,vh->bv", z.astype(self._w.dtype), self._w).astype(
                jnp.float32), None
        return self._hot(z), self._hot.ids[...]


def _fn(vocab, greedy_only, reduced):
    def f(w, hot_w, hot, z, sampling, step):
        head = _Head(w, hot_w, hot if reduced else None, vocab)
        return _draft_token(head, z, sampling, step, 0, greedy_only)
    return jax.jit(f)


def _time(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="27B shape, batch 1 only")
    p.add_argument("--n", type=int, default=32768, help="hot token ids (default 32768)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--config", action="append", default=None,
                   help="config.json path(s) instead of the Qwen shapes (e.g. a CPU smoke run)")
    args = p.parse_args(argv)
    configs = [f"configs/{c}.json" for c in (CONFIGS[-1:] if args.quick else CONFIGS)]
    configs = args.config or configs
    batches = (1,) if args.quick else (1, 8, 32)
    print(f"device {jax.devices()[0].device_kind}, N = {args.n}, bf16 weights")
    for name in configs:
        cfg = load_config(name)
        name = name.rsplit("/", 1)[-1].removesuffix(".json")
        if name == "config":
            name = "custom"
        v, h, n = cfg.vocab_size, cfg.hidden_size, min(args.n, cfg.vocab_size)
        key = jax.random.key(0)
        w = (jax.random.normal(key, (v, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
        hot = jnp.arange(n, dtype=jnp.int32)
        hot_w = jnp.take(w, hot, axis=0)
        for b in batches:
            z = jax.random.normal(jax.random.fold_in(key, b), (b, h), jnp.bfloat16)
            sampling = SamplingTensors.from_params([(0.8, -1, 0.95, i) for i in range(b)])
            step = jnp.zeros((b,), jnp.int32)
            args_ = (w, hot_w, hot, z, sampling, step)
            for greedy_only in (True, False):
                ms = {}
                for reduced in (False, True):
                    s = _time(_fn(v, greedy_only, reduced), args_, args.reps)
                    by = (n if reduced else v) * h * 2
                    ms[reduced] = s
                    print(f"{name:16s} B={b:<3d} {'greedy ' if greedy_only else 'sampled'} "
                          f"{'hot  N=' + str(n) if reduced else 'full V=' + str(v):13s} "
                          f"{s * 1e3:8.3f} ms  bytes {by / 1e9:6.3f} GB  "
                          f"frac {by / s / HBM_BYTES_PER_S:5.1%}")
                print(f"{'':16s} speed-up {ms[False] / ms[True]:.2f}x")
        del w, hot_w
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
