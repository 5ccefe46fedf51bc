"""``python -m mtp_jax.generate``: generate text from a checkpoint folder (or the built-in
default model) with MTP speculative decoding, and print the text and a stats line."""

from __future__ import annotations

import argparse
import json
import sys
import time

DEFAULT_PROMPT = "Explain speculative decoding in one paragraph."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.generate", description=__doc__)
    p.add_argument("--model", default=None,
                   help="checkpoint folder (HF layout); default: a small built-in random-weight "
                        "qwen3_5_moe with the real Qwen3.5 tokenizer, made once in a cache folder")
    p.add_argument("--prompt", action="append", default=None,
                   help="prompt text; repeat for several prompts (default: a demo prompt)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 or 0 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed, in [0, 2**32)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's EOS tokens")
    p.add_argument("--speculative-algorithm", "--spec-algo", dest="speculative_algorithm",
                   default="mtp", help="mtp (default; also nextn) or none")
    p.add_argument("--speculative-num-steps", type=int, default=3,
                   help="k drafted tokens per round, 1..8")
    p.add_argument("--speculative-draft-model-path", "--spec-draft-model",
                   dest="speculative_draft_model_path", default=None,
                   help="folder holding the mtp.* draft, or a Hugging Face repo id (name or "
                        "org/name) downloaded at load (default: the target checkpoint)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto = bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-running-requests", type=int, default=8,
                   help="requests in flight at once (>= 1)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="prompt + output tokens per request (capped by the model's "
                        "max_position_embeddings)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of two)")
    p.add_argument("--dummy-weight", action="store_true",
                   help="random weights of the checkpoint's shapes instead of its weights "
                        "(benchmarks; needs --speculative-algorithm none)")
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    return p


def _stats_line(out, seconds: float) -> str:
    n = len(out.token_ids)
    al = "n/a" if out.acceptance_rate is None else f"{out.accept_length:.2f}"
    ar = "n/a" if out.acceptance_rate is None else f"{out.acceptance_rate:.1%}"
    return (f"[stats] prompt_tokens={len(out.prompt_token_ids)} output_tokens={n} "
            f"seconds={seconds:.2f} tokens/s={n / max(seconds, 1e-9):.1f} "
            f"accept_length={al} acceptance_rate={ar} finish_reason={out.finish_reason}")


def main(argv=None) -> int:
    """Run the CLI; returns the exit status: 0 all prompts done, 1 some prompt refused (its
    ``error`` printed), 2 bad settings, files or a lone bad prompt (message on stderr)."""
    args = build_parser().parse_args(argv)
    from mtp_jax import LLM, SamplingParams
    from mtp_jax.config import ConfigError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, max_running_requests=args.max_running_requests,
                  speculative_algorithm=args.speculative_algorithm,
                  speculative_num_steps=args.speculative_num_steps,
                  speculative_draft_model_path=args.speculative_draft_model_path,
                  seed=args.seed, max_model_len=args.max_model_len, page_size=args.page_size,
                  dummy_weight=args.dummy_weight)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = args.prompt or [DEFAULT_PROMPT]
    if args.chat:
        if llm.tokenizer is None:
            print("error: --chat needs a tokenizer in the checkpoint folder", file=sys.stderr)
            return 2
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    for p in prompts:  # compile (warm-up) on the first valid prompt; the run reports bad ones
        try:
            llm.generate([p], SamplingParams(max_tokens=2, temperature=0))
            break
        except ValueError:
            continue
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - t0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    failed = 0
    for out in outs:
        if args.json:
            print(json.dumps({
                "prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                "prompt_tokens": len(out.prompt_token_ids), "output_tokens": len(out.token_ids),
                "finish_reason": out.finish_reason, "error": out.error,
                "seconds": round(seconds, 4),
                "tokens_per_second": len(out.token_ids) / max(seconds, 1e-9),
                "accept_length": out.accept_length, "acceptance_rate": out.acceptance_rate,
                "num_rounds": out.num_rounds}))
        elif out.finish_reason == "error":
            print(f"error: {out.error}", file=sys.stderr)
        else:
            print(out.text)
            print(_stats_line(out, seconds))
        failed += out.finish_reason == "error"
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
