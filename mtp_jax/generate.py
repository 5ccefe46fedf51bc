"""python -m mtp_jax.generate: generate text from a checkpoint folder (or the built-in default
model) with MTP speculative decoding, and print the text and a stats line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings

DEFAULT_PROMPT = "Explain speculative decoding in one paragraph."
DEFAULT_MODEL_LINE = ("built-in default (tiny: layers and MTP head trained on the docs, "
                      "random embedding and LM head; real Qwen3.5 tokenizer)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mtp_jax.generate", description=__doc__)
    prompts = p.add_mutually_exclusive_group()  # one source of prompts, never one ignored
    prompts.add_argument("--prompt", action="append", default=None,
                         help="prompt text; repeat for several prompts (default: a demo "
                              "prompt; not with --prompts-file)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="output tokens per prompt (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling mass, in (0, 1]; 1 = off")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 or 0 = off")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's EOS tokens")
    prompts.add_argument("--prompts-file", default=None,
                         help="JSONL file, one request per line: {\"prompt\": text or token "
                              "ids, and optional temperature, top_p, top_k, max_tokens, seed, "
                              "stop, stop_token_ids, ignore_eos (default: the flags)}; results "
                              "in order; not with --prompt")
    add_engine_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per request")
    return p


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """Add the flags that make the :class:`~mtp_jax.LLM` (model, seed, speculation, sizes,
    scheduling, kernels, compilation cache) to ``p``; shared by ``python -m mtp_jax.generate``
    and ``python -m mtp_jax.serve``. :func:`llm_kwargs` turns them into ``LLM`` arguments."""
    from mtp_jax.kernels import add_backend_flags

    p.add_argument("--model", default=None,
                   help="checkpoint folder (HF layout); default: a small built-in "
                        "qwen3_5_moe with the real Qwen3.5 tokenizer, made once in a cache folder")
    p.add_argument("--seed", type=int, default=0,
                   help="base sampling seed, in [0, 2**32) (default %(default)s): the i-th "
                        "request without a seed of its own samples with a seed made from it "
                        "and i, so a repeated prompt gives another sample; a request's own "
                        "seed (a prompts-file line's, an API request's) is used as it is")
    p.add_argument("--speculative-algorithm", "--spec-algo", dest="speculative_algorithm",
                   default="mtp", help="mtp (default; nextn and eagle, SGLang's names for "
                   "drafting with the checkpoint's own MTP layer, are synonyms) or none "
                   "(external drafters are Python API only)")
    p.add_argument("--speculative-num-steps", type=int, default=3,
                   help="k drafted tokens per round, 1..8 (default 3; unused, and 0 taken, with "
                        "speculation off)")
    p.add_argument("--speculative-draft-model-path", "--spec-draft-model",
                   dest="speculative_draft_model_path", default=None,
                   help="folder holding the mtp.* draft, or a Hugging Face repo id (name or "
                        "org/name) downloaded at load (default: the target checkpoint)")
    p.add_argument("--speculative-draft-vocab-size", type=int, default=None,
                   help="MTP draft scores only N hot token ids (FR-Spec): the first N of "
                        "--speculative-token-map, else the N lowest ids (BPE merge order, a "
                        "heuristic); output stays exact, the draft's LM head reads ~V/N times "
                        "fewer bytes (default: full vocabulary)")
    p.add_argument("--speculative-token-map", default=None,
                   help="file of hot token ids for the MTP draft (.npy int array, .json list, "
                        "or text with one id per line), in order (SGLang's "
                        "speculative_token_map)")
    p.add_argument("--speculative-draft-head-dtype", default="model", choices=["model", "int8"],
                   type=str.lower,
                   help="int8: the MTP draft scores with an int8 copy of the LM head (a scale "
                        "per row; the rows around the best 8 logits re-scored in the model "
                        "dtype): 1 byte per weight read per draft step instead of 2 (bf16), "
                        "V x (H + 4) bytes more memory; output stays exact (default: model, "
                        "the model dtype)")
    p.add_argument("--speculative-draft-layer-dtype", default="model", choices=["model", "int8"],
                   type=str.lower,
                   help="int8: the MTP draft's projections (fc, attention, dense MLP; not a MoE "
                        "layer's routed experts) run from an int8 copy with a scale per row: "
                        "about half the draft layer's bytes per draft step; output stays exact, "
                        "the drafts may change a little (default: model, the model dtype)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto = bfloat16 on GPU, float32 on CPU")
    p.add_argument("--max-running-requests", type=int, default=8,
                   help="requests in flight at once (>= 1; default %(default)s)")
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="prompt + output tokens per request (capped by the model's "
                        "max_position_embeddings; default %(default)s)")
    p.add_argument("--page-size", type=int, default=16,
                   help="tokens per KV page (a power of two; default %(default)s)")
    p.add_argument("--dummy-weight", action="store_true",
                   help="random weights of the checkpoint's shapes instead of its weights "
                        "(benchmarks; needs --speculative-algorithm none)")
    p.add_argument("--chunked-prefill-size", type=int, default=2048,
                   help="prompt tokens prefilled per scheduler step (default %(default)s)")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not reuse KV / GDN state of shared prompt prefixes")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each round's result before dispatching the next (by default "
                        "the next round is dispatched first, overlapping host and device work)")
    p.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="rounds (decode steps, or speculative rounds) per program call, 1..16 "
                        "(multi-step scheduling; default %(default)s). Above 1 the host's "
                        "per-call work is paid once for that many rounds: faster when the host "
                        "bounds a round (small models at batch 1); outputs are identical")
    p.add_argument("--mem-fraction", type=float, default=0.9,
                   help="fraction of device memory for weights and pools, in (0, 1] "
                        "(default %(default)s)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV positions for all requests together (overrides --mem-fraction)")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA compilation cache folder, or 'none' (default: "
                        "$MTP_JAX_COMPILATION_CACHE or ~/.cache/mtp_jax/xla)")
    p.add_argument("--quantization", default="auto", choices=["auto", "dequantize"],
                   help="how a quantized checkpoint's weights (block FP8, ModelOpt FP8 / "
                        "NVFP4, compressed-tensors NVFP4) are held: both dequantize them to "
                        "--dtype at load for now (docs/quantization.md; default %(default)s)")
    p.add_argument("--ple-backend", default=None, choices=["disk", "memory"],
                   help="Qwen3.8-Flash-Next checkpoints (model_type qwen4_exp) only: their "
                        "PLE n-gram tables memory-mapped from disk (the default) or held in "
                        "host RAM")
    add_backend_flags(p)


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM(**kwargs)`` arguments of the flags :func:`add_engine_flags` added."""
    return dict(model=args.model, dtype=args.dtype,
                max_running_requests=args.max_running_requests,
                speculative_algorithm=args.speculative_algorithm,
                speculative_num_steps=args.speculative_num_steps,
                speculative_draft_model_path=args.speculative_draft_model_path,
                speculative_draft_vocab_size=args.speculative_draft_vocab_size,
                speculative_token_map=args.speculative_token_map,
                speculative_draft_head_dtype=args.speculative_draft_head_dtype,
                speculative_draft_layer_dtype=args.speculative_draft_layer_dtype,
                seed=args.seed, max_model_len=args.max_model_len, page_size=args.page_size,
                dummy_weight=args.dummy_weight, chunked_prefill_size=args.chunked_prefill_size,
                enable_prefix_cache=not args.disable_prefix_cache,
                overlap_schedule=not args.disable_overlap_schedule,
                num_scheduler_steps=args.num_scheduler_steps,
                mem_fraction=args.mem_fraction, max_total_tokens=args.max_total_tokens,
                compilation_cache_dir=args.compilation_cache_dir,
                ple_backend=args.ple_backend, quantization=args.quantization,
                attention_backend=args.attention_backend,
                gdn_backend=args.gdn_backend, moe_backend=args.moe_backend,
                norm_backend=args.norm_backend, gemv_backend=args.gemv_backend)


_FILE_KEYS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids",
              "ignore_eos")


def read_prompts_file(path: str, defaults: dict) -> tuple[list, list[dict]]:
    """Prompts and per-request sampling fields from a JSONL file; ``ValueError`` naming the
    line for a malformed one (bad sampling values are reported per request by ``main``)."""
    prompts, fields = [], []
    try:
        f = open(path)
    except OSError as e:
        raise OSError(f"--prompts-file {path}: {e.strerror or e}; pass an existing JSONL "
                      "file (one {\"prompt\": ...} object per line).") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e}).") from None
            if not isinstance(rec, dict) or "prompt" not in rec:
                raise ValueError(f"{path}:{n}: each line must be an object with a \"prompt\".")
            unknown = sorted(set(rec) - {"prompt", *_FILE_KEYS})
            if unknown:
                raise ValueError(f"{path}:{n}: unknown keys {unknown}; allowed: prompt, "
                                 f"{', '.join(_FILE_KEYS)}.")
            prompts.append(rec["prompt"])
            fields.append({**defaults, **{k: rec[k] for k in _FILE_KEYS if k in rec}})
    if not prompts:
        raise ValueError(f"{path} holds no requests.")
    return prompts, fields


def _stats_line(out, seconds: float) -> str:
    n = len(out.token_ids)
    al = "n/a" if out.accept_length is None else f"{out.accept_length:.2f}"
    ar = "n/a" if out.acceptance_rate is None else f"{out.acceptance_rate:.1%}"
    return (f"[stats] prompt_tokens={len(out.prompt_token_ids)} output_tokens={n} "
            f"seconds={seconds:.2f} tokens/s={n / max(seconds, 1e-9):.1f} "
            f"accept_length={al} acceptance_rate={ar} finish_reason={out.finish_reason}")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one ``warning: ...`` line on stderr (the CLI's users need the message,
    not the source line that raised it)."""
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def main(argv=None) -> int:
    """Run the CLI; returns the exit status: 0 all prompts done, 1 some prompt refused (its
    ``error`` printed), 2 bad settings, files or a lone bad prompt (message on stderr), 130
    interrupted (Ctrl-C: one ``interrupted`` line, no traceback, nothing of the run printed).
    Warnings print as ``warning: ...`` lines on stderr."""
    with warnings.catch_warnings():  # restores the process's warning display afterwards
        warnings.showwarning = _show_warning
        try:
            return _main(argv)
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C): the run stopped; nothing of it was printed.",
                  file=sys.stderr)
            return 130


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    from mtp_jax import LLM, RequestOutput, SamplingParams
    from mtp_jax.config import ConfigError

    try:
        if not 0 <= args.seed < 2**32:
            raise ValueError(f"seed (--seed) {args.seed} must be an int in [0, 2**32); pass a "
                             f"non-negative one such as {args.seed % 2**32} (the same 32 "
                             "bits).")
        # Requests without their own seed take one from LLM(seed=--seed) and their index.
        defaults = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
        try:
            params = SamplingParams(**defaults)
        except ValueError as e:  # name the flag that set the bad field
            field = str(e).split(" ", 1)[0]
            flag = f" (--{field.replace('_', '-')})" if field in defaults else ""
            raise ValueError(f"{field}{flag} {str(e).split(' ', 1)[1]}") from None
        line_errors: dict[int, str] = {}
        if args.prompts_file:
            file_prompts, file_fields = read_prompts_file(args.prompts_file, defaults)
            params = []
            for i, f in enumerate(file_fields):
                try:
                    params.append(SamplingParams(**f))
                except (TypeError, ValueError) as e:  # this request fails alone
                    line_errors[i] = f"{args.prompts_file}: request {i + 1}: {e}"
                    params.append(None)
        llm = LLM(**llm_kwargs(args))
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = file_prompts if args.prompts_file else (args.prompt or [DEFAULT_PROMPT])
    if llm.tokenizer is None and not (args.prompt or args.prompts_file):
        print(f"error: no --prompt was given, and the demo prompt {DEFAULT_PROMPT!r} is text, "
              f"which {args.model!r} cannot encode: it has no tokenizer files. Pass token ids "
              "with --prompts-file FILE (lines like {\"prompt\": [1, 2, 3]}).",
              file=sys.stderr)
        return 2
    if args.chat:
        if llm.tokenizer is None:
            print("error: --chat needs a tokenizer (its chat template) in the checkpoint "
                  "folder, which has none; drop --chat and pass token ids with --prompts-file.",
                  file=sys.stderr)
            return 2
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   if isinstance(p, str) else p for p in prompts]
    run = [i for i in range(len(prompts)) if i not in line_errors]
    if sys.stderr.isatty():  # a progress note for a person waiting; logs get the line below
        print("[warm-up] compiling the programs this run calls (the compilation cache makes "
              "the next start faster) ...", file=sys.stderr, flush=True)
    # Compile every program the run can call first, so that its seconds and tokens/s do not
    # include compilation (which the persistent cache makes fast on the next start).
    warm_s = llm.warmup([prompts[i] for i in run],
                        [params[i] for i in run] if isinstance(params, list) else params)
    before = llm.prefix_cache_stats()
    try:
        t0 = time.perf_counter()
        done = llm.generate([prompts[i] for i in run],
                            [params[i] for i in run] if isinstance(params, list) else params,
                            # a bar for a person watching; a log would fill with redraws
                            use_tqdm=bool(args.prompts_file) and sys.stderr.isatty()
                            ) if run else []
        seconds = time.perf_counter() - t0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # Printed once the run is accepted, so that a refusal is the only thing on stderr.
    print(f"[model] {args.model or DEFAULT_MODEL_LINE}"
          f"; speculative_algorithm={llm.speculative.algorithm}"
          + (f" (k={llm.speculative.num_steps})" if llm.speculative.enabled else "")
          + (f"; draft vocabulary {llm.engine.draft_vocab_size} hot ids"
             if llm.engine.draft_vocab_size else "")
          + (f"; draft LM head {llm.speculative.draft_head_dtype}" if llm.speculative.draft_head_dtype
             else "")
          + (f"; draft layer {llm.speculative.draft_layer_dtype}" if llm.speculative.draft_layer_dtype
             else "")
          + (f"; {args.num_scheduler_steps} rounds per call" if args.num_scheduler_steps > 1
             else "")
          + ("" if args.prompt or args.prompts_file else f"; prompt {DEFAULT_PROMPT!r}"),
          file=sys.stderr)
    print(f"[warm-up] programs compiled or loaded from the compilation cache in {warm_s:.1f}s",
          file=sys.stderr)
    outs = [None] * len(prompts)
    for i, out in zip(run, done):
        outs[i] = out
    for i, msg in line_errors.items():
        outs[i] = RequestOutput(request_id=f"line{i + 1}", prompt=prompts[i] if isinstance(
            prompts[i], str) else None, prompt_token_ids=[], token_ids=[], text="",
            finish_reason="error", error=msg)
    failed = 0
    for i, out in enumerate(outs):
        if out.finish_reason == "error" and args.prompts_file and i not in line_errors:
            out = dataclasses.replace(out, error=f"{args.prompts_file}: request {i + 1}: "
                                                 f"{out.error}")
        if args.json:
            print(json.dumps({
                "prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
                "prompt_tokens": (None if out.finish_reason == "error"  # ids not known
                                  and not out.prompt_token_ids else len(out.prompt_token_ids)),
                "output_tokens": len(out.token_ids),
                "finish_reason": out.finish_reason, "error": out.error,
                "seconds": round(seconds, 4),
                "tokens_per_second": round(len(out.token_ids) / max(seconds, 1e-9), 2),
                "accept_length": out.accept_length, "acceptance_rate": out.acceptance_rate,
                "num_rounds": out.num_rounds, "cached_tokens": out.cached_tokens}))
        elif out.finish_reason == "error":
            print(f"error: {out.error}", file=sys.stderr)
        else:
            if len(outs) > 1:
                print(f"--- request {i + 1} of {len(outs)} ---")
            print(out.text if out.text or not out.token_ids
                  else f"(no tokenizer) token ids: {out.token_ids}")
            print(_stats_line(out, seconds))
        failed += out.finish_reason == "error"
    served = [o for o in done if o.finish_reason != "error"]
    if len(served) > 1 and not args.json:
        total = sum(len(o.token_ids) for o in served)
        print(f"[total] requests={len(served)} output_tokens={total} seconds={seconds:.2f} "
              f"tokens/s={total / max(seconds, 1e-9):.1f} (all requests together; each "
              "[stats] line's seconds is this batch's wall time)")
    stats = {k: v - before.get(k, 0) for k, v in llm.prefix_cache_stats().items()}
    if stats and not args.json:
        print(f"[prefix-cache] lookups={stats['lookups']} hits={stats['hits']} "
              f"reused_tokens={stats['reused_tokens']} of prompt_tokens={stats['prompt_tokens']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
