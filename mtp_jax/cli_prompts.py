"""The prompts of ``python -m mtp_jax.generate``, read and checked before the model loads.

:func:`read_prompts_file` reads a ``--prompts-file`` (JSONL, UTF-8; every malformed line named by
file and line); :func:`prepare_prompts` wraps the prompts of the flags or the file in the chat
template (``--chat``) and checks each against the checkpoint's tokenizer, vocabulary and context
limit (:mod:`mtp_jax.prompt_checks`). The CLI runs it as ``LLM(before_load=...)``, once the
settings and the config passed their checks and before any weight loads: a bad prompt is
refused in seconds, named by its flag or file line.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import warnings

__all__ = ["DEFAULT_PROMPT", "FILE_KEYS", "CliPrompts", "read_prompts_file", "decode_line",
           "prompt_labels", "prepare_prompts", "check_stream"]

DEFAULT_PROMPT = "Explain speculative decoding in one paragraph."
PROMPT_KEYS = ("prompt", "prompt_token_ids")  # a line's prompt: text or ids / ids (vLLM's)
FILE_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos")


def decode_line(raw: bytes, path: str, line: int) -> str:
    """One line of a prompts file as text: UTF-8 (a byte-order mark on line 1 is dropped); a
    ``ValueError`` naming the file, the line, the byte and the fix otherwise."""
    try:
        return raw.decode("utf-8-sig" if line == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                         f"{e.start + 1} of the line); JSON lines must be UTF-8: save the file "
                         f"as UTF-8 (e.g. iconv -f latin1 -t utf-8 {path} > fixed.jsonl), or "
                         "write other characters as \\u escapes.") from None


def read_prompts_file(path: str, defaults: dict) -> tuple[list, list[dict], list[int]]:
    """``(prompts, fields, lines)`` of a JSONL file: each request's prompt, its sampling
    fields (``defaults`` overridden by the line's) and its line number. A ``ValueError``
    naming the file and line for a malformed line (bad sampling values are reported per
    request by the CLI); ``OSError`` for a file that cannot be opened."""
    prompts, fields, lines = [], [], []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise OSError(f"--prompts-file {path}: {e.strerror or e}; pass an existing JSONL "
                      "file (one {\"prompt\": ...} object per line).") from None
    with f:
        for n, raw in enumerate(f, 1):
            line = decode_line(raw, path, n)
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e}); each line is one JSON object "
                                 "such as {\"prompt\": \"Hello\", \"max_tokens\": 32} (a "
                                 "file of plain-text lines: wrap each as {\"prompt\": ...}, "
                                 "or pass them with --prompt).") from None
            given = [k for k in PROMPT_KEYS if isinstance(rec, dict) and k in rec]
            if len(given) != 1:
                raise ValueError(f"{path}:{n}: each line must be an object with one \"prompt\" "
                                 "(text or token ids) or \"prompt_token_ids\""
                                 + (" (not both)." if given else "."))
            unknown = sorted(set(rec) - {*PROMPT_KEYS, *FILE_KEYS})
            if unknown:
                close = [f"{k} -> {m[0]}" for k in unknown
                         if (m := difflib.get_close_matches(k, [*PROMPT_KEYS, *FILE_KEYS], n=1))]
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ValueError(f"{path}:{n}: unknown keys {unknown}{hint}; allowed: prompt, "
                                 f"prompt_token_ids, {', '.join(FILE_KEYS)}.")
            if given == ["prompt_token_ids"] and not isinstance(rec["prompt_token_ids"], list):
                raise ValueError(f"{path}:{n}: \"prompt_token_ids\" must be a list of ints; "
                                 "text goes in \"prompt\".")
            prompts.append(rec[given[0]])
            fields.append({**defaults, **{k: rec[k] for k in FILE_KEYS if k in rec}})
            lines.append(n)
    if not prompts:
        raise ValueError(f"{path} holds no requests; write one {{\"prompt\": ...}} object per "
                         "line.")
    return prompts, fields, lines


def prompt_labels(prompts_file: str | None, flag_prompts: list | None,
                  lines: list[int] | None) -> list[str]:
    """How an error names each prompt: ``FILE:LINE (request i)``, ``--prompt`` (``--prompt
    i of n`` with several), or ``the demo prompt``."""
    if prompts_file:
        return [f"{prompts_file}:{n} (request {i + 1})" for i, n in enumerate(lines)]
    if not flag_prompts:
        return ["the demo prompt"]
    n = len(flag_prompts)
    return ["--prompt"] if n == 1 else [f"--prompt {i + 1} of {n}" for i in range(n)]


@dataclasses.dataclass
class CliPrompts:
    """A run's prompts as they go to ``LLM.generate`` (chat template applied), the label of
    each, and the message of each refused one (by index; the others run)."""

    prompts: list
    labels: list[str]
    errors: dict[int, str]

    @property
    def runnable(self) -> list[int]:
        return [i for i in range(len(self.prompts)) if i not in self.errors]


def _demo_or_chat_refusal(tokenizer, model: str | None, given: bool, chat: bool) -> str | None:
    """Why the run cannot start for want of a tokenizer (None: it can)."""
    if tokenizer is not None:
        return None
    if not given:
        return (f"no --prompt was given, and the demo prompt {DEFAULT_PROMPT!r} is text, which "
                f"{model!r} cannot encode: it has no tokenizer files. Pass token ids with "
                "--prompts-file FILE (lines like {\"prompt\": [1, 2, 3]}).")
    if chat:
        return ("--chat needs a tokenizer (its chat template) in the checkpoint folder, which "
                "has none; drop --chat and pass token ids with --prompts-file.")
    return None


def _chat_refusals(prompts: list, labels: list[str], errors: dict[int, str]) -> dict[int, str]:
    """With ``--chat``, the message of each prompt (not already refused) that is not text:
    the template wraps a text prompt as one user message, so token ids cannot go through it."""
    found = {}
    for i, p in enumerate(prompts):
        if i in errors or isinstance(p, str):
            continue
        ids = isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p)
        fix = ("token ids; give it as text, or drop --chat (token ids then go to the model as "
               "they are)." if ids else
               f"a {type(p).__name__}, not text; give the user message's text as the prompt (a "
               "conversation of several messages goes through LLM.chat).")
        found[i] = (f"{labels[i]}: --chat wraps a text prompt in the chat template as one user "
                    f"message, and this prompt is {fix}")
    return found


def prepare_prompts(args, prompts: list, labels: list[str], params: list,
                    errors: dict[int, str], tokenizer, limits) -> CliPrompts:
    """Check the run's prompts before the model loads, with the checkpoint's ``tokenizer``
    and :class:`~mtp_jax.prompt_checks.PromptLimits`: apply the chat template with
    ``args.chat`` (and ``args.chat_template_kwargs``), and add to ``errors`` (the requests
    already refused for their sampling fields) each prompt the engine would refuse, named by
    ``labels``. ``params[i]`` is the request's ``SamplingParams`` (None where refused).
    Raises ``ValueError`` when the run cannot start: the demo prompt, ``--chat`` or ``--stop``
    without a tokenizer, template kwargs without ``--chat`` or that the template does not
    read, its one prompt refused (the message), or ``--stream`` where it cannot stream
    (:func:`check_stream`). Several prompts all refused are not an error here: each gets its
    own output."""
    from mtp_jax.prompt_checks import check_prompts
    from mtp_jax.prompts import check_template_kwargs

    why = _demo_or_chat_refusal(tokenizer, args.model, bool(args.prompt or args.prompts_file),
                                args.chat)
    if why:
        raise ValueError(why)
    if args.stop and tokenizer is None:
        raise ValueError(f"--stop {args.stop}: stop strings are matched in the text, and this "
                         "checkpoint folder has no tokenizer to make text; drop --stop (a "
                         "--prompts-file line may stop on \"stop_token_ids\" instead).")
    if args.chat_template_kwargs is not None and not args.chat:
        raise ValueError("--chat-template-kwargs gives the chat template's variables, and this "
                         "run does not apply the template; add --chat, or drop it.")
    if args.chat:
        kwargs = check_template_kwargs(args.chat_template_kwargs, tokenizer)
        errors = {**errors, **_chat_refusals(prompts, labels, errors)}
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], **kwargs)
                   if isinstance(p, str) and i not in errors else p
                   for i, p in enumerate(prompts)]
    todo = [i for i in range(len(prompts)) if i not in errors]
    ids, found = check_prompts([prompts[i] for i in todo], [labels[i] for i in todo],
                               tokenizer, limits, [params[i] for i in todo])
    errors = {**errors, **{todo[j]: msg for j, msg in found.items()}}
    _warn_context_cuts([(labels[i], ids[j], params[i]) for j, i in enumerate(todo)
                        if ids[j] is not None], limits.context)
    if len(prompts) == 1 and errors:
        raise ValueError(errors[0])
    check_stream(args, len(prompts), tokenizer is not None)
    return CliPrompts(prompts=prompts, labels=labels, errors=dict(sorted(errors.items())))


def _warn_context_cuts(requests: list, context: int) -> None:
    """A warning for each request ``(label, prompt ids, SamplingParams)`` whose prompt plus
    ``max_tokens`` exceed the engine's ``context`` (``--max-model-len``, capped by the model):
    its output stops at the context with ``finish_reason=length``, before ``max_tokens``."""
    for label, ids, params in requests:
        room = context - len(ids)
        if params is not None and params.max_tokens > room:
            warnings.warn(f"{label}: {len(ids)} prompt tokens + max_tokens {params.max_tokens} "
                          f"exceed the context of {context} tokens (--max-model-len, capped by "
                          f"the model's max_position_embeddings), so its output stops after "
                          f"{room} tokens (finish_reason=length); raise --max-model-len or "
                          "lower --max-tokens.", stacklevel=2)


def check_stream(args, n_prompts: int, has_tokenizer: bool) -> None:
    """``--stream`` prints one request's text as it comes: refuse it (``ValueError`` naming the
    fix) with ``--json``, with several prompts and without a tokenizer to decode with."""
    if not args.stream:
        return
    if args.json:
        raise ValueError("--stream prints text as it is generated and --json prints one object "
                         "per request at the end; pass one of them.")
    if n_prompts != 1:
        raise ValueError(f"--stream prints one request's text as it is generated, and this run "
                         f"has {n_prompts} prompts; pass one --prompt (or a one-line "
                         "--prompts-file), or drop --stream.")
    if not has_tokenizer:
        raise ValueError("--stream prints text, and this checkpoint folder has no tokenizer "
                         "files to decode tokens with; drop --stream (the token ids print at "
                         "the end).")
