"""``python -m mtp_jax.bench prefix-hits``: prefix-cache hit rates of two chat workloads, with
speculation off and on, at the engine's default page size and snapshot interval.

* multi-turn chat: one conversation of ``--turns`` turns; each turn's prompt is the previous
  prompt, its answer and new user text (``--user-len`` tokens, drawn from a range);
* shared system prompt: ``--requests`` requests, each a ``--system-len``-token system prompt
  followed by its own user text.

Requests run one after another on one engine (greedy, ``--answer-len`` tokens each), so each
can reuse what the earlier ones left. Per workload and speculation setting: the prompt tokens,
the tokens reused (``Request.cached_tokens``), the tokens a prompt shares with what came
before (the most any cache could reuse, less the one token a prefill must run), and the two
ratios. Hit rates depend on token counts, page size and snapshot interval, not on the weights:
any checkpoint (the built-in default model when ``--model`` is not given) gives the same on
the CPU as on a GPU. Token ids are random (``--seed``), not text.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mtp_jax.bench.subcommand import plain_text
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams

SUMMARY = ("prefix-cache hit rates of a multi-turn chat and a shared-system-prompt workload, "
           "speculation off and on (token counts; any device)")

__all__ = ["SUMMARY", "main", "multi_turn", "shared_system", "hit_table"]


def _text(rng: np.random.Generator, lo: int, hi: int, vocab: int) -> list[int]:
    return rng.integers(10, vocab, int(rng.integers(lo, hi + 1))).tolist()


def _serve(eng: Engine, prompt: list[int], answer_len: int, tag: str) -> Request:
    req = Request(request_id=tag, index=0, prompt=None, prompt_ids=list(prompt),
                  params=SamplingParams(temperature=0, max_tokens=answer_len, ignore_eos=True),
                  seed=0)
    eng.run([req])
    return req


def _shared(prompt: list[int], seen: list[list[int]]) -> int:
    """Tokens ``prompt`` shares with the longest common prefix of any earlier sequence, less
    the one token a prefill must still run."""
    best = 0
    for s in seen:
        n = 0
        for a, b in zip(prompt, s):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return min(best, len(prompt) - 1)


def multi_turn(eng: Engine, turns: int, user: tuple[int, int], answer_len: int, vocab: int,
               seed: int) -> dict:
    """One conversation of ``turns`` turns; returns the tallies (:func:`_tally`)."""
    rng = np.random.default_rng(seed)
    prompt, seen, rows = _text(rng, *user, vocab), [], []
    for t in range(turns):
        req = _serve(eng, prompt, answer_len, f"turn{t}")
        rows.append((len(prompt), req.cached_tokens, _shared(prompt, seen)))
        seen.append(prompt + req.output_ids)
        prompt = prompt + req.output_ids + _text(rng, *user, vocab)
    return _tally(rows)


def shared_system(eng: Engine, requests: int, system_len: int, user: tuple[int, int],
                  answer_len: int, vocab: int, seed: int) -> dict:
    """``requests`` prompts of one system prompt and their own user text."""
    rng = np.random.default_rng(seed)
    system, seen, rows = _text(rng, system_len, system_len, vocab), [], []
    for i in range(requests):
        prompt = system + _text(rng, *user, vocab)
        req = _serve(eng, prompt, answer_len, f"req{i}")
        rows.append((len(prompt), req.cached_tokens, _shared(prompt, seen)))
        seen.append(prompt + req.output_ids)
    return _tally(rows)


def _tally(rows: list[tuple[int, int, int]]) -> dict:
    prompt, cached, shared = (sum(r[i] for r in rows) for i in range(3))
    return {"requests": len(rows), "prompt_tokens": prompt, "cached_tokens": cached,
            "shared_tokens": shared, "hit_rate": cached / prompt,
            "of_shared": cached / shared if shared else None,
            "per_request": [{"prompt": p, "cached": c, "shared": s} for p, c, s in rows]}


def hit_table(results: list[dict]) -> str:
    """A markdown table of :func:`main`'s rows."""
    out = ["| workload | speculation | prompt tokens | shared with earlier | reused | hit rate "
           "| of shared |", "|---|---|---|---|---|---|---|"]
    for r in results:
        of = f"{r['of_shared']:.1%}" if r["of_shared"] is not None else "-"
        out.append(f"| {r['workload']} | {r['speculation']} | {r['prompt_tokens']} | "
                   f"{r['shared_tokens']} | {r['cached_tokens']} | {r['hit_rate']:.1%} | {of} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.bench prefix-hits",
                                description=plain_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the built-in "
                                                 "default model)")
    p.add_argument("--turns", type=int, default=8, help="turns of the conversation (default 8)")
    p.add_argument("--requests", type=int, default=8,
                   help="requests sharing the system prompt (default 8)")
    p.add_argument("--system-len", type=int, default=500, help="system prompt tokens (500)")
    p.add_argument("--user-len", type=int, nargs=2, default=[30, 200], metavar=("LO", "HI"),
                   help="user text tokens per turn or request, drawn in [LO, HI] (30 200)")
    p.add_argument("--answer-len", type=int, default=64, help="answer tokens (64)")
    p.add_argument("--k", type=int, default=3, help="drafts per round with speculation on (3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    return p


def main(argv=None) -> int:
    """Run both workloads with speculation off and on; prints the table. Returns 0 (2: bad
    flags)."""
    from mtp_jax.default_model import default_model_path
    from mtp_jax.models.loader import load_model

    args = build_parser().parse_args(argv)
    if min(args.turns, args.requests, args.system_len, args.answer_len, *args.user_len) < 1:
        print("error: --turns, --requests, --system-len, --user-len and --answer-len must be "
              ">= 1.", file=sys.stderr)
        return 2
    model = load_model(args.model or default_model_path(), args.dtype, with_mtp=args.k > 0)
    vocab = model.cfg.vocab_size
    longest = (args.user_len[1] + args.answer_len) * args.turns + args.system_len + 64
    results = []
    for k in (0, args.k):
        spec = SpeculativeConfig(algorithm="mtp" if k else "none", num_steps=k or 3)
        for name in ("multi-turn chat", "shared system prompt"):
            eng = Engine(model, EngineConfig(max_running_requests=1, dtype=args.dtype,
                                             max_model_len=longest), spec)
            row = (multi_turn(eng, args.turns, tuple(args.user_len), args.answer_len, vocab,
                              args.seed) if name == "multi-turn chat" else
                   shared_system(eng, args.requests, args.system_len, tuple(args.user_len),
                                 args.answer_len, vocab, args.seed))
            results.append({"workload": name, "speculation": f"MTP k={k}" if k else "off",
                            **row})
            print(f"{name}, {results[-1]['speculation']}: {row['hit_rate']:.1%} of prompt "
                  "tokens reused", file=sys.stderr, flush=True)
    print(hit_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0
