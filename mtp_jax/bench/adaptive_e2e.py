"""``python -m mtp_jax.bench.adaptive_e2e``: what a user gets end to end with speculation off, on
(adaptive, the default) and on without adaptation, on a random-weight model of a real shape.

Random weights accept no draft, so this is the case adaptive speculation exists for: MTP on
should be within a few percent of MTP off (each request stops drafting after a few rounds and
probes now and then). For each ``--batch`` and setting, an engine with
the defaults (prefix cache on, automatic rounds per call) is warmed up on the batch's buckets,
then serves ``batch`` greedy requests of ``--prompt-len`` random tokens for
``--decode-tokens`` tokens each. Reports decode tokens/s (generated tokens / the rounds' time,
``EngineStats.round_seconds``), end-to-end tokens/s (generated tokens / wall time of the run,
prefill included), the rounds run plain and the draft and accept counts, the program calls
of the timed run by round variant (``calls``: ``"k<k>[+snap]"`` -> count) and, with
``--variant-times``, each variant's device time per call (the last batch it ran, replayed
``--variant-reps`` times, each waited for: what a call costs apart from the host's gaps).
Writes JSON to ``--out`` and prints one line per row.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time

import jax

from mtp_jax.bench.floor import load_config
from mtp_jax.bench.settings import requests
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.models.loader import load_model

SETTINGS = {"off": dict(algorithm="none"), "mtp": dict(algorithm="mtp"),
            "mtp-no-adapt": dict(algorithm="mtp", adaptive=False)}


def variant_name(variant) -> str:
    """``k<k>`` and ``+snap`` for a snapshot-saving call (a :class:`RoundVariant`)."""
    return f"k{variant.k}" + ("+snap" if variant.snapshot else "")


def record_calls(device, seen: dict) -> collections.Counter:
    """Count ``device.round`` calls by :func:`variant_name` from now on, keeping the last
    ``(batch, variant)`` of each in ``seen``; returns the counter."""
    calls, dispatch = collections.Counter(), device.round

    def counted(batch, variant):
        calls[variant_name(variant)] += 1
        seen[variant_name(variant)] = (batch, variant)
        return dispatch(batch, variant)

    device.round = counted
    return calls


def variant_ms(device, seen: dict, reps: int) -> dict:
    """Median device milliseconds per call of each seen variant: its last batch replayed
    ``reps`` times, each call waited for (the pools' pages are the finished requests', so the
    writes land in freed pages)."""
    out = {}
    for name, (batch, variant) in sorted(seen.items()):
        times = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            jax.block_until_ready(device.round(batch, variant).readback)
            times.append(time.perf_counter() - t0)
        out[name] = round(1e3 * statistics.median(times[2:]) / variant.rounds, 4)
    return out


def one_row(model, batch: int, name: str, a) -> dict:
    """Serve one batch under setting ``name``; returns its row."""
    eng = Engine(model, EngineConfig(max_running_requests=batch, dtype=model.dtype,
                                     max_model_len=a.prompt_len + a.decode_tokens + 64,
                                     chunked_prefill_size=a.prompt_len),
                 SpeculativeConfig(num_steps=a.k, **SETTINGS[name],
                                   **({"adaptive_round_cost": a.round_cost}
                                      if a.round_cost and name == "mtp" else {})))
    warm = eng.warmup(sampled=False, max_batch=batch, max_prompt_len=a.prompt_len)
    eng.run(requests(batch, a.prompt_len, 8, model.cfg.vocab_size, 10_000))  # untimed
    before = eng.stats.round_seconds, eng.stats.rounds, eng.stats.plain_rounds
    reqs = requests(batch, a.prompt_len, a.decode_tokens, model.cfg.vocab_size, 0)
    seen = {}
    calls = record_calls(eng.device, seen)
    t0 = time.perf_counter()
    eng.run(reqs)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    rounds = eng.stats.rounds - before[1]
    return dict(batch=batch, setting=name, k=a.k if name != "off" else 0, warmup_s=warm,
                decode_tokens_per_s=(tokens - batch) / (eng.stats.round_seconds - before[0]),
                e2e_tokens_per_s=tokens / wall, rounds=rounds,
                plain_rounds=eng.stats.plain_rounds - before[2],
                draft_tokens=sum(r.num_draft_tokens for r in reqs),
                accepted_tokens=sum(r.num_accepted_tokens for r in reqs), calls=dict(calls),
                ms_per_round=variant_ms(eng.device, seen, a.variant_reps)
                if a.variant_times else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench.adaptive_e2e",
                                description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config", required=True, help="a released config (configs/*.json)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--variant-times", action="store_true",
                   help="also time each round variant's call on its own (device ms a round)")
    p.add_argument("--variant-reps", type=int, default=20)
    p.add_argument("--round-cost", type=float, default=None,
                   help="--speculative-adaptive-round-cost for the adaptive settings")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    model = load_model(cfg=load_config(a.config), dtype=a.dtype, dummy_weight=True,
                       with_mtp=True)
    jax.block_until_ready(model.params)
    rows = []
    for b in a.batch:
        for name in a.settings:
            rows.append(one_row(model, b, name, a))
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"config": a.config, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
