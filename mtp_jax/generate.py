"""python -m mtp_jax.generate: generate text from a checkpoint folder (or the built-in default
model) with MTP speculative decoding, and print the text and a stats line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import warnings

from mtp_jax.cli_parser import CliParser, add_sampling_flags, json_object
from mtp_jax.cli_prompts import DEFAULT_PROMPT, read_prompts_file
from mtp_jax.cli_report import finish_programs, print_model_line, print_program_wait

__all__ = ["main", "build_parser", "add_engine_flags", "llm_kwargs", "read_prompts_file",
           "DEFAULT_PROMPT"]



def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="python -m mtp_jax.generate", description=__doc__,
                  allow_abbrev=False)  # --max-token is an error, not --max-tokens
    prompts = p.add_mutually_exclusive_group()  # one source of prompts, never one ignored
    prompts.add_argument("--prompt", action="append", default=None,
                         help="prompt text; repeat for several prompts (default: a demo "
                              "prompt; not with --prompts-file)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--chat-template-kwargs", type=json_object, default=None, metavar="JSON",
                   help="with --chat: variables the chat template reads, as a JSON object, "
                        "e.g. '{\"enable_thinking\": false}' (vLLM's chat_template_kwargs)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="output tokens per prompt (default %(default)s)")
    add_sampling_flags(p)
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the checkpoint's EOS tokens")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string (repeat for several): the output ends before the first "
                        "one it produces, which the text leaves out (SamplingParams.stop; a "
                        "--prompts-file line's own \"stop\" replaces these)")
    p.add_argument("--stream", action="store_true",
                   help="print the text as it is generated (one prompt; not with --json), "
                        "then the stats line")
    prompts.add_argument("--prompts-file", default=None,
                         help="JSONL file, one request per line: {\"prompt\": text or token "
                              "ids, and optional temperature, top_p, top_k, min_p, "
                              "presence_penalty, frequency_penalty, max_tokens, seed, "
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
                   help="checkpoint folder (HF layout) or Flash-Next .gguf (draft: a Strata "
                        "pack); default: a small built-in qwen3_5_moe, made once in a cache")
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
    p.add_argument("--speculative-draft-head-dtype", default="auto",
                   choices=["auto", "model", "int8"],
                   type=str.lower,
                   help="int8: the MTP draft scores with an int8 copy of the LM head (a scale "
                        "per row; the rows around the best 8 logits re-scored in the model "
                        "dtype): 1 byte per weight read per draft step instead of 2 (bf16), "
                        "V x (H + 4) bytes more memory; output stays exact; model: the model "
                        "dtype (default: auto = int8 on a GPU in bfloat16 / float16, else "
                        "model)")
    p.add_argument("--speculative-draft-layer-dtype", default="auto",
                   choices=["auto", "model", "int8"],
                   type=str.lower,
                   help="int8: the MTP draft's projections (fc, attention, dense MLP; not a MoE "
                        "layer's routed experts) run from an int8 copy with a scale per row: "
                        "about half the draft layer's bytes per draft step; output stays exact, "
                        "the drafts may change a little; model: the model dtype (default: auto "
                        "= int8 on a GPU in bfloat16 / float16, else model)")
    p.add_argument("--disable-adaptive-speculation", action="store_true",
                   help="draft in every round; by default a request drafts only while its "
                        "accepted drafts pay for a round, else it decodes plainly and probes "
                        "again now and then (greedy requests decide together, so their draft "
                        "counts depend on the batch; output exact either way)")
    p.add_argument("--speculative-adaptive-round-cost", type=float, default=None,
                   help="a round's time in decode steps that a request's drafting must beat "
                        "(1..100, e.g. 1.5; default: the ratio of the bytes a round and a "
                        "decode step read at batch 1, plus 0.15; the [model] line shows it)")
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
    p.add_argument("--max-prefill-batch", type=int, default=8,
                   help="requests whose prompt chunks one prefill call holds (>= 1; 1: one "
                        "request per call; default %(default)s, at most "
                        "--max-running-requests); a call's rows x padded chunk length stays "
                        "within the --chunked-prefill-size bucket; outputs are the same")
    p.add_argument("--disable-prefix-cache", action="store_true",
                   help="do not reuse KV / GDN state of shared prompt prefixes")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each round's result before dispatching the next (by default "
                        "the next round is dispatched first, overlapping host and device work)")
    p.add_argument("--num-scheduler-steps", type=scheduler_steps, default=None,
                   help="rounds (decode steps, or speculative rounds) per program call: "
                        "'auto' (the default: the engine chooses, 4, fewer with speculation "
                        "and the prefix cache, 1 with an external proposer) or 1..16 "
                        "(multi-step scheduling). Above 1 the host's per-call work is paid once "
                        "for that many rounds: faster when the host bounds a round (small "
                        "models at batch 1); outputs are identical")
    p.add_argument("--mem-fraction", type=float, default=0.9,
                   help="fraction of device memory for weights and pools, in (0, 1] "
                        "(default %(default)s)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV positions for all requests together (overrides --mem-fraction)")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA compilation cache folder, or 'none' (default: "
                        "$MTP_JAX_COMPILATION_CACHE, else $MTP_JAX_CACHE/xla, by default "
                        "~/.cache/mtp_jax/xla)")
    p.add_argument("--quantization", default="auto", choices=["auto", "dequantize", "keep"],
                   help="how a quantized checkpoint's projections (block FP8, ModelOpt FP8 / "
                        "NVFP4, compressed-tensors NVFP4, GGUF blocks) are held: keep = kept "
                        "as stored and dequantized inside each program (FP8 half, NVFP4 about "
                        "0.28 of the bf16 bytes, but slower on the GPU); dequantize = "
                        "dequantized to --dtype at load; auto = dequantize, or keep (with a "
                        "warning) where only the kept weights fit the device "
                        "(docs/quantization.md; default %(default)s)")
    p.add_argument("--ple-backend", default=None, choices=["auto", "disk", "memory", "device"],
                   help="Qwen3.8-Flash-Next checkpoints (model_type qwen4_exp) only: their "
                        "PLE n-gram tables memory-mapped from disk, held in host RAM, or "
                        "copied to the accelerator (device: looked up inside the programs, no "
                        "host callback; the tables must fit in device memory); auto (the "
                        "default): device where the tables take at most a quarter of the "
                        "accelerator's memory, else disk (the CPU). With disk / memory the "
                        "programs look their rows up on the host: by a C++ lookup built with "
                        "g++ on a GPU, else by a callback ($MTP_JAX_PLE_LOOKUP=auto|native|"
                        "callback; docs/cli.md)")
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
                speculative_adaptive=not args.disable_adaptive_speculation,
                speculative_adaptive_round_cost=args.speculative_adaptive_round_cost,
                seed=args.seed, max_model_len=args.max_model_len, page_size=args.page_size,
                dummy_weight=args.dummy_weight, chunked_prefill_size=args.chunked_prefill_size,
                max_prefill_batch=args.max_prefill_batch,
                enable_prefix_cache=not args.disable_prefix_cache,
                overlap_schedule=not args.disable_overlap_schedule,
                num_scheduler_steps=args.num_scheduler_steps,
                mem_fraction=args.mem_fraction, max_total_tokens=args.max_total_tokens,
                compilation_cache_dir=args.compilation_cache_dir,
                ple_backend=args.ple_backend, quantization=args.quantization,
                attention_backend=args.attention_backend,
                gdn_backend=args.gdn_backend, moe_backend=args.moe_backend,
                norm_backend=args.norm_backend, gemv_backend=args.gemv_backend)


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
    ``error`` printed), 2 bad settings, files or prompts when none can run (message on
    stderr, before the model loads), 130 interrupted (Ctrl-C: one ``interrupted`` line, no
    traceback); a missing dependency (a Python without the set-up's packages) is 2 too, its
    message naming the set-up command. Warnings print as ``warning: ...`` lines on stderr."""
    with warnings.catch_warnings():  # restores the process's warning display afterwards
        warnings.showwarning = _show_warning
        try:
            return _main(argv)
        except KeyboardInterrupt:
            print("\ninterrupted (Ctrl-C): the run stopped before its results were printed.",
                  file=sys.stderr)
            return 130
        except ModuleNotFoundError as e:  # run outside the set-up's environment
            print(f"error: {e}: this Python ({sys.executable}, {sys.version.split()[0]}) lacks "
                  "mtp_jax's dependencies; install them with scripts/setup_venv.sh (Python >= "
                  "3.12) and run .venv/bin/python -m mtp_jax.generate (README, Set-up).",
                  file=sys.stderr)
            return 2


def _flag_params(defaults: dict):
    """The ``SamplingParams`` of the sampling flags; a ``ValueError`` naming the flag of a bad
    field."""
    from mtp_jax.sampling.params import SamplingParams

    try:
        return SamplingParams(**defaults)
    except ValueError as e:  # name the flag that set the bad field
        field, rest = (str(e).split(" ", 1) + [""])[:2]
        flag = f" (--{field.replace('_', '-')})" if field in defaults else ""
        raise ValueError(f"{field}{flag} {rest}") from None


def _file_params(fields: list[dict], labels: list[str]) -> tuple[list, dict[int, str]]:
    """Each prompts-file request's ``SamplingParams`` (None where refused) and the message of
    each refused one: a bad line's request fails alone."""
    from mtp_jax.sampling.params import SamplingParams

    params, errors = [], {}
    for i, f in enumerate(fields):
        try:
            params.append(SamplingParams(**f))
        except (TypeError, ValueError) as e:
            errors[i] = f"{labels[i]}: {_as_json(str(e), f)}"
            params.append(None)
    return params, errors


def _as_json(message: str, fields: dict) -> str:
    """A ``SamplingParams`` message (``"field value ..."``, the value as Python writes it)
    about a prompts-file field, with the key and value as the file's JSON writes them and
    the JSON type where Python's spelling hides it: ``"max_tokens": true (a boolean) ...``."""
    field, rest = (message.split(" ", 1) + [""])[:2]
    if field not in fields or not rest.startswith(repr(fields[field])):
        return message
    value = fields[field]
    ints = ("top_k", "max_tokens", "seed")  # where 3.0 is refused for its decimal point
    kind = (" (a boolean)" if isinstance(value, bool) else
            " (a number written with a decimal point)" if isinstance(value, float)
            and field in ints else "")
    return f'"{field}": {json.dumps(value)}{kind}{rest[len(repr(value)):]}'


def _read_run(args) -> tuple[list, list[str], list, dict[int, str]]:
    """The run's prompts, their labels, their sampling params (one per prompt; None where
    refused) and the message of each refused one (its prompts-file line's sampling fields)."""
    from mtp_jax.cli_prompts import check_stream, prompt_labels

    if not 0 <= args.seed < 2**32:
        raise ValueError(f"seed (--seed) {args.seed} must be an int in [0, 2**32); pass a "
                         f"non-negative one such as {args.seed % 2**32} (the same 32 bits).")
    # Requests without their own seed take one from LLM(seed=--seed) and their index.
    defaults = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    min_p=args.min_p, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens,
                    ignore_eos=args.ignore_eos, stop=args.stop)
    flag_params = _flag_params(defaults)
    if args.prompts_file:
        prompts, fields, lines = read_prompts_file(args.prompts_file, defaults)
        labels = prompt_labels(args.prompts_file, None, lines)
        params, errors = _file_params(fields, labels)
    else:
        prompts = args.prompt or [DEFAULT_PROMPT]
        labels = prompt_labels(None, args.prompt, None)
        params, errors = [flag_params] * len(prompts), {}
    # --stream with --json or several prompts: refused now, before anything loads (without a
    # tokenizer: once the checkpoint's tokenizer is known, prepare_prompts)
    check_stream(args, len(prompts), has_tokenizer=True)
    return prompts, labels, params, errors


class _NothingToRun(Exception):
    """Every prompt of several was refused before the model loaded (each has its output)."""


def _load(args, prompts: list, labels: list[str], params: list, errors: dict[int, str]):
    """``(llm, run)``: the ``LLM`` of the flags and the run's prompts
    (:class:`~mtp_jax.cli_prompts.CliPrompts`), checked once its settings and config passed
    their checks and before its weights load (:func:`mtp_jax.cli_prompts.prepare_prompts`, as
    ``LLM(before_load=...)``). ``(None, run)`` when every prompt of several was refused:
    nothing loads."""
    from mtp_jax import LLM
    from mtp_jax.cli_prompts import prepare_prompts

    checked = {}

    def check(tokenizer, limits) -> None:
        checked["run"] = run = prepare_prompts(args, prompts, labels, params, errors,
                                               tokenizer, limits)
        if not run.runnable:
            raise _NothingToRun

    try:
        return LLM(**llm_kwargs(args), before_load=check), checked["run"]
    except _NothingToRun:
        return None, checked["run"]


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    from mtp_jax.errors import ConfigError  # not mtp_jax.config: that imports the models (jax)

    try:
        prompts, labels, params, errors = _read_run(args)
        llm, run = _load(args, prompts, labels, params, errors)
    except (ConfigError, ValueError, OSError) as e:
        for line in str(e).splitlines() or [""]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if llm is None:  # several prompts, all refused: each one's error, and no model loaded
        _print_outputs(args, _outputs(run, []), run.labels, 0.0)
        return 1
    todo = run.runnable
    prompts, todo_params = [run.prompts[i] for i in todo], [params[i] for i in todo]
    # Lean (one prefill and one batch bucket, which every call pads up to) and in the
    # background (each call waits for its own program only: the first token comes after the
    # prefill program alone); the time calls wait is left out of seconds and tokens/s
    # (issue 32 item 5: the start-up of a one-off run is mostly compilation).
    warm_s = llm.warmup(prompts, todo_params, lean=True, background=True)
    status = _serve(args, llm, run, prompts, todo_params, warm_s)
    finish_programs(llm)  # not after an error or Ctrl-C: the process ends without waiting
    return status


def _serve(args, llm, run, prompts: list, todo_params: list, warm_s: float) -> int:
    """Generate the runnable prompts and print their outputs; returns the exit status."""
    before = llm.prefix_cache_stats()
    print_model_line(args, llm, warm_s)
    try:
        t0 = time.perf_counter()
        if args.stream:
            done = _stream(llm, prompts, todo_params, sys.stdout)
        else:  # a bar for a person watching; a log would fill with redraws
            done = llm.generate(prompts, todo_params,
                                use_tqdm=bool(args.prompts_file) and sys.stderr.isatty())
        seconds = print_program_wait(llm, time.perf_counter() - t0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    outs = _outputs(run, done)
    stats = {k: v - before.get(k, 0) for k, v in llm.prefix_cache_stats().items()}
    failed = _print_outputs(args, outs, run.labels, seconds, stats or None)
    served = [o for o in done if o.finish_reason != "error"]
    if len(served) > 1 and not args.json:
        total = sum(len(o.token_ids) for o in served)
        print(f"[total] requests={len(served)} output_tokens={total} seconds={seconds:.2f} "
              f"tokens/s={total / max(seconds, 1e-9):.1f} (all requests together; each "
              "[stats] line's seconds is this batch's wall time)")
    if stats and not args.json:
        print(f"[prefix-cache] lookups={stats['lookups']} hits={stats['hits']} "
              f"reused_tokens={stats['reused_tokens']} of prompt_tokens={stats['prompt_tokens']}")
    return 1 if failed else 0


def scheduler_steps(text: str) -> int | None:
    """``--num-scheduler-steps`` value: ``auto`` (``None``: the engine chooses) or an int
    (checked with the other settings)."""
    if text == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor an int (use auto, "
                                         "the default, or 1..16)") from None


def _stream(llm, prompts: list, params: list, out) -> list:
    """Generate through ``LLM.generate_stream``, writing each update's ``new_text`` to ``out``
    as it comes (held back while it could be the start of a stop string, as the server's
    stream), then a newline. Returns the outputs."""
    done = [None] * len(prompts)
    for chunk in llm.generate_stream(prompts, params):
        if chunk.finished:
            done[chunk.index] = chunk.output
        if chunk.new_text:
            out.write(chunk.new_text)
            out.flush()
    out.write("\n")
    return done


def _outputs(run, done: list) -> list:
    """Every prompt's output, in order: the run's, and an error output for each refused."""
    from mtp_jax import RequestOutput

    outs = [None] * len(run.prompts)
    for i, out in zip(run.runnable, done):
        outs[i] = out
    for i, msg in run.errors.items():
        p = run.prompts[i]
        outs[i] = RequestOutput(request_id=f"request{i + 1}", prompt=p if isinstance(p, str)
                                else None, prompt_token_ids=[], token_ids=[], text="",
                                finish_reason="error", error=msg)
    return outs


def _print_outputs(args, outs: list, labels: list[str], seconds: float,
                   prefix_cache: dict | None = None) -> int:
    """Print each output (its text, or the streamed text's stats line; JSON with ``--json``,
    ``prefix_cache`` in each record; ``error: ...`` on stderr for a refused one, and with
    several requests its header and a ``(refused...)`` line on stdout); returns how many were
    refused."""
    failed = 0
    for i, out in enumerate(outs):
        if out.finish_reason == "error" and not out.error.startswith(labels[i]):
            out = dataclasses.replace(out, error=f"{labels[i]}: {out.error}")
        failed += out.finish_reason == "error"
        if args.json:
            print(json.dumps(_json_record(out, seconds, prefix_cache), ensure_ascii=False))
            continue
        if len(outs) > 1:  # every request has its header, a refused one too
            print(f"--- request {i + 1} of {len(outs)} ---")
        if out.finish_reason == "error":
            print(f"error: {out.error}", file=sys.stderr)
            if len(outs) > 1:
                print("(refused; its error is on stderr)")
            continue
        if not args.stream:
            print(out.text if out.text or not out.token_ids
                  else f"(no tokenizer) token ids: {out.token_ids}")
        print(_stats_line(out, seconds))
    return failed


def _json_record(out, seconds: float, prefix_cache: dict | None = None) -> dict:
    """One ``--json`` line: the request's output and stats (``seconds``: the batch's wall
    time), and ``prefix_cache``: the run's prefix-cache counters (all requests together, the
    ``[prefix-cache]`` line's figures: ``lookups``, ``hits``, ``prompt_tokens``,
    ``reused_tokens``; None with the cache off or no request run)."""
    return {"prompt": out.prompt, "text": out.text, "token_ids": out.token_ids,
            "prompt_tokens": (None if out.finish_reason == "error"  # ids not known
                              and not out.prompt_token_ids else len(out.prompt_token_ids)),
            "output_tokens": len(out.token_ids),
            "finish_reason": out.finish_reason, "error": out.error,
            "seconds": round(seconds, 4),
            "tokens_per_second": round(len(out.token_ids) / max(seconds, 1e-9), 2),
            "accept_length": out.accept_length, "acceptance_rate": out.acceptance_rate,
            "num_rounds": out.num_rounds, "num_draft_tokens": out.num_draft_tokens,
            "num_accepted_tokens": out.num_accepted_tokens, "cached_tokens": out.cached_tokens,
            "prefix_cache": prefix_cache}


if __name__ == "__main__":
    status = main()
    if status == 130:  # interrupted: exit now, not after the programs still compiling
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
