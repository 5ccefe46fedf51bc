"""``python -m mtp_jax.bench prefill-burst``: time to first token and throughput of a burst of
requests of mixed prompt lengths submitted at once, with batched prefill on and off
(``--prefill-batch``: ``EngineConfig.max_prefill_batch`` values, 1 = one request per prefill
call) and speculation off and on (``--settings``).

For each setting and prefill batch: a fresh engine on one model (random weights of a
``--config`` shape, or a ``--model`` checkpoint), every request admitted at once by default
(``--max-running-requests`` = ``--requests``), greedy, ``--max-tokens`` each (EOS ignored).
First an untimed burst of the same prompt lengths with other token ids (it compiles every
program the timed burst calls: a program's shape depends on the lengths only; with MTP two,
since the first starts every greedy request drafting and later ones start from the engine's
acceptance estimate: :mod:`mtp_jax.speculative.adaptive`), then the prefix cache is flushed and
the timed burst runs, ``Engine.step`` by step. A request's time to first
token (TTFT) is from the burst's start to the end of the step that gave its first token. Per
row: TTFT p50 / p99 / mean / max (seconds), the wall time, output tokens/s (generated tokens /
wall) and total tokens/s (prompt + generated), the prefill calls and the prompt chunks they
held, the host's seconds in prefill calls (dispatch to the first tokens read) and between
round results (they add up to about the wall time), the round program calls, the rounds that
adaptive speculation ran plain (k = 0; "-" with speculation off, where every round is plain)
and all rounds, the accept counts, and the compiles in the timed burst (0 expected; a compile
there means the warm-up burst missed a program). One timed burst per row: on a small burst
(wall time under a second) the seconds vary from run to run more than the settings differ.
Prompt lengths are drawn uniformly from
``--prompt-len LO HI`` (``--seed``); token ids are random, not text. Writes JSON to ``--out``
and prints a markdown table.

``--call-times``: after the timed burst, one more burst of the same lengths (other ids, the
prefix cache flushed) with each prefill call synced before and after (its device work alone,
no overlap with rounds), and a second table: per (B, T) call shape, the calls, their time
each, the prompt tokens they held and their padded ``B * T`` tokens. Where batched calls of
mixed lengths lose or win against one request per call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import numpy as np

from mtp_jax.bench import report
from mtp_jax.bench.compiles import CompileWatch
from mtp_jax.bench.subcommand import (Refused, config_of, int_list, name_list, plain_text,
                                      positive)
from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams

SUMMARY = ("time to first token (p50, p99) and tokens/s of a burst of mixed-length requests, "
           "batched prefill on and off, speculation off and on")

__all__ = ["SUMMARY", "build_parser", "main", "prompt_lengths", "burst", "serve_burst",
           "percentiles", "burst_table", "check_gguf_draft", "time_prefill_calls",
           "call_shapes", "call_table"]

SETTINGS = ("off", "mtp")


def prompt_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """``n`` prompt lengths drawn uniformly from ``lo..hi`` (tokens, both included)."""
    return np.random.default_rng(seed).integers(lo, hi + 1, n).tolist()


def burst(lengths: list[int], max_tokens: int, vocab: int, seed: int,
          tag: str = "b") -> list[Request]:
    """Greedy requests (EOS ignored, ``max_tokens`` each) of random prompts of ``lengths``
    tokens (ids ``10..vocab-11``, from ``seed``)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(request_id=f"{tag}{i}", index=i, prompt=None, params=params, seed=i,
                    prompt_ids=rng.integers(10, vocab - 10, n).tolist())
            for i, n in enumerate(lengths)]


def percentiles(values: list[float]) -> dict:
    """``p50``, ``p99`` (linear interpolation), ``mean`` and ``max`` of ``values``."""
    a = np.asarray(values, np.float64)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "max": float(a.max())}


def serve_burst(eng: Engine, reqs: list[Request]) -> dict:
    """Add every request of ``reqs`` at once and step ``eng`` until they finish. Returns
    ``{"ttft_s": [per request], "wall_s": ...}``: seconds from the start to the end of the
    step that gave each request its first token, and to the end of the last step."""
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    first: dict[str, float] = {}
    while eng.has_work():
        eng.step()
        now = time.perf_counter() - t0
        for r in reqs:
            if r.output_ids and r.request_id not in first:
                first[r.request_id] = now
    return {"ttft_s": [first[r.request_id] for r in reqs], "wall_s": time.perf_counter() - t0}


def time_prefill_calls(eng: Engine, reqs: list[Request]) -> list[dict]:
    """Serve ``reqs`` with each prefill call synced before and after (the scheduler's
    ``prefill_call`` wrapped on the instance for this burst only); returns one ``{"shape": [B,
    T], "lengths": [chunk tokens of each row], "s": seconds}`` per call, in order."""
    sched, log = eng.scheduler, []
    real = sched.prefill_call

    def synced(rows, shape):
        jax.block_until_ready(sched.device.pools)
        t0 = time.perf_counter()
        real(rows, shape)
        jax.block_until_ready(sched.device.pools)
        log.append({"shape": list(shape), "lengths": [r.length for r in rows],
                    "s": time.perf_counter() - t0})

    sched.prefill_call = synced
    try:
        serve_burst(eng, reqs)
    finally:
        del sched.prefill_call  # the class's method again
    return log


def call_shapes(calls: list[dict]) -> list[dict]:
    """Synced prefill calls (:func:`time_prefill_calls`) summed by shape, smallest first:
    ``B``, ``T``, calls, seconds, prompt tokens, padded tokens (``B * T`` per call)."""
    by = {}
    for c in calls:
        b, t = c["shape"]
        v = by.setdefault((b, t), {"B": b, "T": t, "calls": 0, "s": 0.0, "tokens": 0,
                                   "padded": 0})
        v["calls"] += 1
        v["s"] += c["s"]
        v["tokens"] += sum(c["lengths"])
        v["padded"] += b * t
    return [by[k] for k in sorted(by)]


def call_table(rows: list[dict]) -> str:
    """The ``--call-times`` rows' call shapes as a markdown table."""
    out = ["| setting | prefill batch | B x T | calls | ms each | prompt tokens | padded "
           "tokens | prompt tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"MTP k={r['k']}" if r["k"] else "off"
        shapes = r.get("call_shapes") or []
        total = {"B": "all", "calls": sum(x["calls"] for x in shapes),
                 "s": sum(x["s"] for x in shapes), "tokens": sum(x["tokens"] for x in shapes),
                 "padded": sum(x["padded"] for x in shapes)}
        for x in shapes + [total]:
            where = "all" if x["B"] == "all" else f"{x['B']} x {x['T']}"
            each = x["s"] / x["calls"] * 1e3 if x["calls"] else 0.0
            rate = x["tokens"] / x["s"] if x["s"] else 0.0
            out.append(f"| {name} | {r['prefill_batch']} | {where} | {x['calls']} | "
                       f"{each:.2f} | {x['tokens']} | {x['padded']} | {rate:.0f} |")
    return "\n".join(out)


def one_row(model, setting: str, batch: int, lengths: list[int], a) -> dict:
    """Warm up, then time one burst under ``setting`` (``off`` | ``mtp``) with
    ``max_prefill_batch = batch``; returns the row."""
    running = a.max_running_requests or len(lengths)
    eng = Engine(model, EngineConfig(max_running_requests=running, dtype=model.dtype,
                                     max_model_len=max(lengths) + a.max_tokens + 64,
                                     chunked_prefill_size=a.chunked_prefill_size,
                                     max_prefill_batch=batch),
                 SpeculativeConfig(algorithm="mtp" if setting == "mtp" else "none",
                                   num_steps=a.k))
    vocab = model.cfg.vocab_size
    with CompileWatch() as warm:
        # With MTP twice: the first starts every greedy request optimistic, the second (as the
        # timed burst) from the estimate the engine keeps, so each calls its own round variants.
        for rep in range(2 if setting == "mtp" else 1):
            eng.run(burst(lengths, a.max_tokens, vocab, a.seed + 1000 + rep, tag=f"w{rep}"))
            eng.flush_cache()
    before = dataclasses.replace(eng.stats)
    reqs = burst(lengths, a.max_tokens, vocab, a.seed)
    with CompileWatch() as timed:
        got = serve_burst(eng, reqs)
    out = sum(len(r.output_ids) for r in reqs)
    prompt = sum(lengths)
    ttft = percentiles(got["ttft_s"])
    delta = stats_delta(eng.stats, before)  # the timed burst's alone
    draft = sum(r.num_draft_tokens for r in reqs), sum(r.num_accepted_tokens for r in reqs)
    extra = {}
    if a.call_times:
        eng.flush_cache()
        calls = time_prefill_calls(eng, burst(lengths, a.max_tokens, vocab, a.seed + 2000,
                                              tag="c"))
        extra = {"call_shapes": call_shapes(calls), "prefill_call_times": calls}
    return {"setting": setting, "k": a.k if setting == "mtp" else 0, "prefill_batch": batch,
            "requests": len(reqs), "max_running_requests": running,
            "ttft_p50_s": ttft["p50"], "ttft_p99_s": ttft["p99"], "ttft_mean_s": ttft["mean"],
            "ttft_max_s": ttft["max"], "wall_s": got["wall_s"], "prompt_tokens": prompt,
            "output_tokens": out, "output_tokens_per_s": out / got["wall_s"],
            "total_tokens_per_s": (prompt + out) / got["wall_s"],
            **delta, "draft_tokens": draft[0], "accepted_tokens": draft[1],
            "warmup_s": warm.seconds, "warmup_compiles": warm.compiles,
            "compiles_timed": timed.compiles, "ttft_s": got["ttft_s"], **extra}


def stats_delta(now, before) -> dict:
    """What the timed burst added to the engine's counters (``EngineStats``): prefill calls
    and chunks, the seconds the host spent in prefill calls (dispatch to the first tokens
    read) and between round results, round program calls, rounds and the plain ones (adaptive
    speculation's k = 0 calls). Where a setting's extra wall time goes."""
    d = lambda f: getattr(now, f) - getattr(before, f)
    return {"prefill_calls": d("prefill_calls"), "prefill_chunks": d("prefill_chunks"),
            "prefill_s": d("prefill_seconds"), "round_s": d("round_seconds"),
            "round_calls": d("round_calls"), "rounds": d("rounds"),
            "plain_rounds": d("plain_rounds")}


def burst_table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    out = ["| setting | prefill batch | TTFT p50 s | TTFT p99 s | wall s | output tok/s | "
           "total tok/s | prefill calls (chunks) | prefill s / rounds s | round calls (plain "
           "rounds / rounds) | accepted / drafted | compiles timed |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"MTP k={r['k']}" if r["k"] else "off"
        out.append(f"| {name} | {r['prefill_batch']} | {r['ttft_p50_s']:.3f} | "
                   f"{r['ttft_p99_s']:.3f} | {r['wall_s']:.2f} | "
                   f"{r['output_tokens_per_s']:.1f} | {r['total_tokens_per_s']:.1f} | "
                   f"{r['prefill_calls']} ({r['prefill_chunks']}) | "
                   f"{r['prefill_s']:.3f} / {r['round_s']:.3f} | "
                   f"{r['round_calls']} ({r['plain_rounds'] if r['k'] else '-'} / "
                   f"{r['rounds']}) | "
                   f"{r['accepted_tokens']} / {r['draft_tokens']} | {r['compiles_timed']} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    """The ``prefill-burst`` flags."""
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench prefill-burst",
                                description=plain_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default=None,
                     help="a model config (configs/*.json): random weights of that shape")
    src.add_argument("--model", default=None,
                     help="a checkpoint folder (default, without --config: the built-in "
                          "default model), or a Flash-Next .gguf (with mtp rows: the folder "
                          "holding it and its Strata MTP pack)")
    p.add_argument("--requests", type=positive(int), default=32, help="requests in the burst (32)")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 1024], metavar=("LO", "HI"),
                   help="prompt tokens per request, drawn uniformly in [LO, HI] (32 1024)")
    p.add_argument("--max-tokens", type=positive(int), default=128,
                   help="tokens generated each (128)")
    p.add_argument("--prefill-batch", type=int_list, default=[1, 8],
                   help="max_prefill_batch values, comma-separated (1,8: one request per "
                        "call, then up to 8)")
    p.add_argument("--settings", type=name_list(SETTINGS), default=list(SETTINGS),
                   help="speculation off and/or MTP, comma-separated (off,mtp)")
    p.add_argument("--k", type=positive(int), default=3, help="MTP drafts per round (3)")
    p.add_argument("--max-running-requests", type=positive(int), default=None,
                   help="requests in flight at once (default: --requests, all admitted)")
    p.add_argument("--chunked-prefill-size", type=positive(int), default=2048,
                   help="prompt tokens prefilled per step (2048, the engine's default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="auto: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--seed", type=int, default=0, help="prompt lengths and ids (0)")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent compilation cache (default as the CLI's; 'none': off)")
    p.add_argument("--call-times", action="store_true",
                   help="also time each prefill call synced, in one more burst per row, and "
                        "print their times by call shape")
    p.add_argument("--out", default="bench-prefill-burst.json",
                   help="JSON results, rewritten after each row (default %(default)s)")
    return p


def check_gguf_draft(model: str | None, settings: list[str]) -> None:
    """This bench takes no draft path: its ``mtp`` rows on a Flash-Next GGUF target read the
    Strata MTP pack of the target's folder (``--model DIR``, as
    :func:`~mtp_jax.weights.gguf_header.folder_pack` finds it). Any other model passes here
    (``load_model``'s checks speak for it).

    Raises:
      ConfigError: ``mtp`` rows asked of a GGUF target path that brings no pack, naming the
        bench's own ways out (``--model`` the folder, ``--settings off``).
    """
    import os

    from mtp_jax.models.gguf_checks import GGUF_TARGET_ARCHS
    from mtp_jax.weights.gguf_header import folder_pack, gguf_architecture, gguf_file

    if model is None or "mtp" not in settings or not os.path.exists(model):
        return
    g = gguf_file(model)
    if g is None or gguf_architecture(g) not in GGUF_TARGET_ARCHS or folder_pack(model):
        return
    folder = os.path.dirname(os.path.abspath(g))
    what = ("a Flash-Next GGUF file" if os.path.isfile(model)
            else "a GGUF folder with no Strata MTP pack")
    where = ("--model DIR, a folder holding the target .gguf and its one Strata MTP pack (what "
             "python -m mtp_jax.tools.random_checkpoint --format gguf writes)")
    try:
        if os.path.isfile(model) and gguf_file(folder) == g and (pack := folder_pack(folder)):
            where = f"--model {folder} (its folder, whose pack is {os.path.basename(pack)})"
    except ConfigError:  # several targets or packs there: the generic advice
        pass
    raise ConfigError(f"--model {model} is {what}, and the mtp rows (--settings "
                      f"{','.join(settings)}) need a pack to draft with; this bench takes no "
                      "draft path, it reads the pack of a GGUF folder given as --model. Pass "
                      f"{where}, or --settings off to time speculation off only.")


def _model(a, with_mtp: bool):
    """The model the rows share: random weights of ``--config``, or ``--model`` (default:
    the built-in default model)."""
    from mtp_jax.default_model import default_model_path
    from mtp_jax.models.loader import load_model

    if a.config is not None:
        return load_model(cfg=config_of(a.config), dtype=a.dtype, dummy_weight=True,
                          with_mtp=with_mtp)
    return load_model(a.model or default_model_path(), a.dtype, with_mtp=with_mtp)


def main(argv=None) -> int:
    """Run every (setting, prefill batch) row; prints the table. Returns 0, or 2 for a
    config or checkpoint that cannot be read (one ``error:`` line); argparse exits with 2 on
    a bad flag."""
    from mtp_jax.compile_cache import enable_compilation_cache

    p = build_parser()
    a = p.parse_args(argv)
    lo, hi = a.prompt_len
    if not 1 <= lo <= hi:
        p.error(f"--prompt-len {lo} {hi}: need 1 <= LO <= HI (tokens).")
    try:
        enable_compilation_cache(a.compilation_cache_dir)
        check_gguf_draft(a.model, a.settings)
        model = _model(a, with_mtp="mtp" in a.settings)
        lengths = prompt_lengths(a.requests, *a.prompt_len, a.seed)
        meta = report.run_metadata(dict(vars(a)), None, None)
        meta["prompt_lengths"] = lengths
        rows = []
        for setting in a.settings:
            for batch in a.prefill_batch:
                rows.append(one_row(model, setting, batch, lengths, a))
                r = rows[-1]
                print(f"{setting} prefill_batch={batch}: TTFT p50 {r['ttft_p50_s']:.3f} s, "
                      f"p99 {r['ttft_p99_s']:.3f} s, {r['output_tokens_per_s']:.1f} output "
                      f"tokens/s, {r['prefill_calls']} prefill calls", file=sys.stderr,
                      flush=True)
                with open(a.out, "w") as f:
                    json.dump({"meta": meta, "results": rows}, f, indent=1)
    except (Refused, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(burst_table(rows))
    if a.call_times:
        print()
        print(call_table(rows))
    if any(r["compiles_timed"] for r in rows):
        print("note: some timed burst compiled a program (see compiles_timed); its times "
              "include the compile.", file=sys.stderr)
    return 0
