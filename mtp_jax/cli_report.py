"""The CLI's ``[model]`` and ``[warm-up]`` lines on stderr (:mod:`mtp_jax.generate`)."""

from __future__ import annotations

import os
import sys

from mtp_jax.cli_prompts import DEFAULT_PROMPT

__all__ = ["DEFAULT_MODEL_LINE", "adaptive_note", "quant_note", "print_model_line",
           "print_program_wait", "finish_programs"]

DEFAULT_MODEL_LINE = ("built-in default (tiny: layers and MTP head trained on the docs, "
                      "random embedding and LM head; real Qwen3.5 tokenizer)")


def adaptive_note(llm) -> str:
    """The ``[model]`` line's note on adaptive speculation: the round cost a request's drafting
    must beat, and a warning when no round can (k + 1 tokens at most)."""
    policy = llm.engine.scheduler.adaptive
    if policy is None:
        return ""
    note = (f"; adaptive (a round costs {policy.cost:.2f} decode steps; a request drafts while "
            "its rounds commit more tokens")
    if policy.never_drafts:
        note += (f", and they commit at most k + 1 = {policy.k + 1}, so no request drafts or "
                 "probes; --disable-adaptive-speculation drafts anyway")
    return note + ")"


def _size(n: int) -> str:
    """``n`` bytes as GiB, MiB or KiB, whichever shows it with a leading digit."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def gguf_note(args, llm) -> str:
    """The ``[model]`` line's note on a GGUF target: the file and the Strata pack it drafts
    with (the draft path's, else the target folder's one pack); empty for other checkpoints."""
    from mtp_jax.weights.gguf_header import folder_pack, gguf_draft_file, gguf_file

    if not args.model or not os.path.exists(args.model) or gguf_file(args.model) is None:
        return ""
    note = f"; GGUF target {os.path.basename(gguf_file(args.model))}"
    if not llm.speculative.enabled:
        return note
    draft = args.speculative_draft_model_path
    pack = gguf_draft_file(draft) if draft else folder_pack(args.model)
    return note + (f", draft: Strata pack {pack}" if pack else "")


def quant_note(args, llm) -> str:
    """The ``[model]`` line's note on a quantized checkpoint: its weights kept as stored (and
    the bytes that saves), or dequantized at load (``--quantization`` and what ``auto``
    chose); empty for an unquantized one."""
    saved = getattr(llm.model, "weight_bytes_saved", 0)
    if saved:
        return f"; quantized weights kept as stored ({_size(saved)} less than {llm.model.dtype})"
    if args.model and os.path.isdir(args.model):
        from mtp_jax.weights.quant_config import quantization_from_folder

        method = quantization_from_folder(args.model).method
        if method is not None:
            return (f"; {method} checkpoint dequantized to {llm.model.dtype} at load "
                    f"(--quantization {args.quantization})")
    return ""


def ple_note(llm) -> str:
    """The ``[model]`` line's note on a qwen4_exp model's PLE n-gram rows: where the programs
    look them up (device tables, the native host lookup, or a host callback, with the reason
    when the native lookup was wanted but could not be built)."""
    model = llm.model
    if not getattr(model.cfg, "ple_layers", None):
        return ""
    if not model.host_callbacks:
        return "; PLE rows from the device tables"
    from mtp_jax.models.qwen4_exp import ple_native

    if ple_native.registered(model.module().ple_source):
        return "; PLE rows by the native host lookup"
    why = ple_native.unavailable_reason()
    return "; PLE rows by a host callback" + (f" (native lookup unavailable: {why})"
                                              if why else "")


def print_model_line(args, llm, warm_s: float) -> None:
    """The ``[model]`` and ``[warm-up]`` lines on stderr, once the run is accepted (so that a
    refusal is the only thing on stderr). ``warm_s``: seconds the warm-up took (with programs
    still building in the background, the ``[warm-up]`` line says how many)."""
    print(f"[model] {args.model or DEFAULT_MODEL_LINE}"
          f"; speculative_algorithm={llm.speculative.algorithm}"
          + (f" (k={llm.speculative.num_steps})" if llm.speculative.enabled else "")
          + (f"; draft vocabulary {llm.engine.draft_vocab_size} hot ids"
             if llm.engine.draft_vocab_size else "")
          + (f"; draft LM head {llm.speculative.draft_head_dtype}" if llm.speculative.draft_head_dtype
             else "")
          + (f"; draft layer {llm.speculative.draft_layer_dtype}" if llm.speculative.draft_layer_dtype
             else "")
          + gguf_note(args, llm)
          + ple_note(llm)
          + adaptive_note(llm)
          + quant_note(args, llm)
          + (f"; {llm.engine.rounds_per_call} rounds per call"
             if llm.engine.rounds_per_call > 1 else "")
          + ("" if args.prompt or args.prompts_file else f"; prompt {DEFAULT_PROMPT!r}"),
          file=sys.stderr)
    building = llm.engine.device.building()
    if building:
        print(f"[warm-up] {building} programs compiling or loading in the background (the "
              "prefill's first); each call waits for its own", file=sys.stderr)
    else:
        print(f"[warm-up] programs compiled or loaded from the compilation cache in "
              f"{warm_s:.1f}s", file=sys.stderr)


def print_program_wait(llm, seconds: float) -> float:
    """Say on stderr how long the run's calls spent getting programs that were not ready
    (waiting for the background build, or compiling or loading them themselves). Returns
    ``seconds`` (the run's wall time) less that time: the run's own time."""
    waited = llm.engine.program_wait_seconds()
    if waited >= 0.05:
        print(f"[warm-up] the run's calls spent {waited:.1f}s waiting for programs to compile or"
              " load (not in its seconds)", file=sys.stderr)
    return max(seconds - waited, 1e-9)


def finish_programs(llm) -> None:
    """At the end of a CLI run: the background build finishes the programs it is compiling
    (saved for the next start) and drops those it has not started, with a note on stderr
    when that takes more than half a second. Ctrl-C there ends the process at once (``os._exit(130)``, output
    flushed): the programs still compiling are not saved."""
    try:
        if llm.engine.wait_for_programs(cancel=True, timeout=0.5):
            return
        print("[warm-up] finishing the programs being compiled, for the next start (Ctrl-C "
              "skips) ...", file=sys.stderr, flush=True)
        llm.engine.wait_for_programs(cancel=True)
    except KeyboardInterrupt:
        print("\ninterrupted (Ctrl-C): the programs still compiling are not saved.",
              file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
