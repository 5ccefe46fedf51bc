"""Prompts and sampling parameters in, requests and outputs out: the checks and conversions of
``LLM``'s calls, as pure functions (each bad value gets a ``ValueError`` naming it).

:func:`prompt_ids` turns one prompt (text, token ids, or vLLM's ``{"prompt": text}`` /
``{"prompt_token_ids": ids}`` dicts: :func:`unwrap_prompt`) into ids; :func:`prompt_list` and
:func:`params_list` normalise a call's arguments; :func:`request_output` and
:func:`error_output` build what the caller gets back.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from mtp_jax.engine.requests import Request, RequestOutput
from mtp_jax.sampling import SamplingParams

__all__ = ["prompt_ids", "unwrap_prompt", "too_long_message", "check_stops", "chat_prompt",
           "chat_message", "short_repr", "prompt_list", "conversation_list", "params_list",
           "request_output", "error_output"]


PROMPT_DICT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt / TokensPrompt


def unwrap_prompt(prompt):
    """A vLLM-style prompt dict, ``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, as the
    text or ids it holds; any other prompt as it is. Raises ``ValueError`` for a dict with
    other keys (named, with the keys taken) or with both or neither."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(str(k) for k in prompt if k not in PROMPT_DICT_KEYS)
    if unknown:
        raise ValueError(f"prompt dict keys {unknown} are not supported; a prompt dict holds "
                         "one of 'prompt' (text) or 'prompt_token_ids' (a list of ints).")
    if len(prompt) != 1:
        raise ValueError("a prompt dict holds exactly one of 'prompt' (text) or "
                         f"'prompt_token_ids' (a list of ints); got {sorted(prompt) or 'none'}.")
    key, value = next(iter(prompt.items()))
    if key == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' is {type(value).__name__}, not text; token ids go in "
                         "'prompt_token_ids'.")
    if key == "prompt_token_ids" and isinstance(value, str):
        raise ValueError("'prompt_token_ids' is text, not a list of ints; text goes in "
                         "'prompt'.")
    return value


def prompt_ids(prompt, tokenizer, vocab_size: int, max_model_len: int, *,
               max_positions: int | None = None) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt: a string (encoded with ``tokenizer``) or a
    list / 1-D array of ints. Raises ``ValueError`` for text without a tokenizer, non-int ids,
    an empty prompt, ids outside ``[0, vocab_size)``, or a prompt that leaves no room in
    ``max_model_len`` (the context limit) for one output token; ``max_positions`` (the model's
    ``max_position_embeddings``, when known) says whether raising ``max_model_len`` can help.
    A prompt dict is unwrapped first (:func:`unwrap_prompt`)."""
    prompt = unwrap_prompt(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer files; pass prompts "
                             "as lists of token ids (Python: LLM.generate([[1, 2, 3]]); "
                             "CLI: --prompts-file FILE with lines like "
                             "{\"prompt\": [1, 2, 3]}). (A GGUF has no tokenizer when its "
                             "metadata holds no tokenizer.ggml.* keys.)")
        check_text(prompt)
        ids, text = tokenizer.encode(prompt), prompt
    elif isinstance(prompt, (list, tuple)) or (hasattr(prompt, "tolist")
                                               and getattr(prompt, "ndim", 0) == 1):
        prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
        bad = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(f"prompt token ids must be ints; got {bad[:5]!r}. Pass a string "
                             "or a list of token ids.")
        ids, text = [int(t) for t in prompt], None
    else:
        raise ValueError(f"prompt {prompt!r} is neither a string, a list of token ids nor a "
                         "prompt dict ({'prompt': text} or {'prompt_token_ids': ids}).")
    if not ids:
        raise ValueError("empty prompt: a prompt needs at least one token; pass some text "
                         "or token ids.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                         f"[0, {vocab_size}); use ids from this checkpoint's tokenizer.")
    if len(ids) >= max_model_len:
        raise ValueError(too_long_message(len(ids), max_model_len, max_positions))
    return text, ids


def check_text(text: str) -> None:
    """Refuse prompt text that is not Unicode (a lone surrogate: what Python makes of a byte
    that was not UTF-8 in a command line or file), which the tokenizer cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        c = ord(text[e.start])
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"U+{c:04X}"
        raise ValueError(f"prompt text holds {what} at character {e.start}, which is not UTF-8 "
                         "(a command line or file in another encoding); pass UTF-8 text.") from None


def too_long_message(num_tokens: int, max_model_len: int, max_positions: int | None) -> str:
    """The refusal of a prompt of ``num_tokens`` tokens under the context limit
    ``max_model_len``: its count, the limit and the fix (a larger ``--max-model-len``, unless
    the model's ``max_positions`` is what caps it)."""
    head = (f"prompt of {num_tokens} tokens does not fit max_model_len {max_model_len} (it "
            "needs room for one output token); ")
    shorten = f"shorten the prompt to at most {max_model_len - 1} tokens"
    if max_positions is not None and max_model_len >= max_positions:
        return (head + f"the model's max_position_embeddings ({max_positions}) caps "
                f"max_model_len, so {shorten}.")
    room = "" if max_positions is None else f" (the model allows up to {max_positions})"
    return (head + f"raise max_model_len (--max-model-len) to at least {num_tokens + 1}{room}, "
            f"or {shorten}.")


def check_stops(params: SamplingParams, vocab_size: int, tokenizer) -> None:
    """Refuse stops that could never fire: token ids outside the vocabulary, and stop strings
    without a tokenizer to decode the output into text."""
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, "
                         f"{vocab_size}); use ids from this checkpoint's tokenizer.")
    if params.stop and tokenizer is None:
        raise ValueError(f"stop strings {params.stop!r} need a tokenizer to match the text, and "
                         "this checkpoint has no tokenizer files; use stop_token_ids "
                         "instead, or a checkpoint with its tokenizer.")


def chat_prompt(messages, tokenizer, template_kwargs: dict | None = None) -> str:
    """The prompt text ``LLM.chat`` generates from: ``messages`` (``[{"role": ...,
    "content": ...}, ...]``) rendered with the tokenizer's chat template, the generation prompt
    added; ``template_kwargs``: more variables for the template (vLLM's
    ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``), checked by
    :func:`check_template_kwargs`. Raises ``ValueError`` without a tokenizer (no template),
    for messages that are not a non-empty list of dicts, or for a message whose role is not a
    string or whose content is not text (:func:`chat_message`), or for template kwargs the
    template does not read; :class:`~mtp_jax.tokenizer.TemplateError` (a ``ValueError``) when
    the template refuses them."""
    if tokenizer is None:
        raise ValueError("this checkpoint folder has no tokenizer, so it has no chat "
                         "template; use generate() with token-id prompts, or a checkpoint "
                         "with its tokenizer files.")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"a conversation is a list of {{'role': ..., 'content': ...}} dicts; "
                         f"got {type(messages).__name__} {str(messages)[:80]!r}.")
    if not messages:
        raise ValueError("the conversation is empty; pass at least one message, e.g. "
                         "[{'role': 'user', 'content': 'Hi'}].")
    kwargs = check_template_kwargs(template_kwargs, tokenizer)
    return tokenizer.apply_chat_template([chat_message(m, i) for i, m in enumerate(messages)],
                                         add_generation_prompt=True, **kwargs)


# What the engine itself sets in the template's context: not for template kwargs to replace.
_TEMPLATE_OWN = ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token")


def check_template_kwargs(kwargs: dict | None, tokenizer) -> dict:
    """``kwargs`` (None: ``{}``) when each key is a variable the chat template reads (so a
    misspelt ``enable_thinkng`` is not dropped without a word). Raises ``ValueError`` naming
    the key for one the template does not read, one the engine sets itself (``messages``,
    ``add_generation_prompt``, the special tokens), or ``kwargs`` that is not a dict with
    string keys."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"chat_template_kwargs {short_repr(kwargs)} must be a dict of "
                         "template variables, e.g. {'enable_thinking': False}.")
    own = [k for k in kwargs if k in _TEMPLATE_OWN]
    if own:
        raise ValueError(f"chat_template_kwargs {own} are set by the engine itself; leave "
                         "them out (the generation prompt is always added).")
    reads = tokenizer.template_variables()
    unread = [k for k in kwargs if k not in reads]
    if unread:
        known = sorted(tokenizer.template_variables(assigned=False) - set(_TEMPLATE_OWN))
        raise ValueError(f"chat_template_kwargs {unread}: this checkpoint's chat template does "
                         f"not read {'it' if len(unread) == 1 else 'them'}; it reads {known}.")
    return dict(kwargs)


CHAT_ROLES = ("system", "user", "assistant", "tool")  # the roles Qwen's chat templates render


def chat_message(message: dict, i: int) -> dict:
    """``message`` with its text content as the template reads it, as the server's
    ``/v1/chat/completions`` takes it: a string or a list of ``{"type": "text", "text": ...}``
    parts (joined); an assistant message may leave it None or absent (empty text: OpenAI's
    form for one that carried tool calls). Raises ``ValueError`` naming ``messages[i]`` for a
    role missing or not one of :data:`CHAT_ROLES` (Qwen's templates drop other roles without a
    word), content missing from another role, or content of another kind."""
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        what = "is missing" if "role" not in message else f"{short_repr(role)} is not a role"
        raise ValueError(f"messages[{i}]['role'] {what}; give each message one of "
                         f"{', '.join(map(repr, CHAT_ROLES))} (the roles the chat template "
                         "renders).")
    if content is None and role != "assistant":
        raise ValueError(f"messages[{i}] ({role!r}) has no content; give it a string (only an "
                         "assistant message may leave content out).")
    if isinstance(content, (list, tuple)):
        for j, p in enumerate(content):
            if not (isinstance(p, dict) and p.get("type") == "text"
                    and isinstance(p.get("text"), str)):
                raise ValueError(f"messages[{i}]['content'][{j}] {short_repr(p)} is not a text "
                                 "part; only {'type': 'text', 'text': ...} parts are supported.")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ValueError(f"messages[{i}]['content'] {short_repr(content)} "
                         f"({type(content).__name__}) must be a string, or a list of "
                         "{'type': 'text', 'text': ...} parts.")
    return {**message, "content": content or ""}


def short_repr(value, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...`` when longer (for messages)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def conversation_list(conversations) -> list:
    """A call's chat prompts as a list: one conversation (a list of message dicts) is one
    prompt, else a list of conversations. Raises ``ValueError`` for what is not a list."""
    if not isinstance(conversations, (list, tuple)):
        raise ValueError(f"chat prompts {str(conversations)[:80]!r} "
                         f"({type(conversations).__name__}) must be a conversation (a list of "
                         "{'role': ..., 'content': ...} dicts) or a list of conversations.")
    if conversations and isinstance(conversations[0], dict):
        return [conversations]
    return list(conversations)


def prompt_list(prompts) -> list:
    """A call's prompts as a list: one string, one token-id list or one prompt dict is one
    prompt. Raises ``ValueError`` for anything else that is not a list of prompts."""
    single = isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and len(prompts) > 0
        and isinstance(prompts[0], numbers.Integral))
    if single or (hasattr(prompts, "ndim") and prompts.ndim == 1):
        prompts = [prompts]
    if not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        raise ValueError(f"prompts {prompts!r} ({type(prompts).__name__}) must be a string, "
                         "a list of token ids, a prompt dict, or a list of these.")
    return list(prompts)


def params_list(sampling_params, n: int) -> list[SamplingParams]:
    """One :class:`SamplingParams` per prompt (``None``: the defaults; one: for all), each
    validated again (a parameter changed after construction is caught here). Raises
    ``ValueError`` for a count or type that does not fit."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * n
    if not isinstance(sampling_params, (list, tuple)):
        raise ValueError(f"sampling_params is a {type(sampling_params).__name__}; pass a "
                         "SamplingParams (e.g. SamplingParams(**d) for a dict d) or a list "
                         "of one per prompt.")
    sampling_params = list(sampling_params)
    if len(sampling_params) != n:
        raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts; "
                         "pass one for all or one per prompt.")
    for i, sp in enumerate(sampling_params):
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params[{i}] is {type(sp).__name__}, not "
                             "SamplingParams.")
        sp.validate()
    return sampling_params


def request_output(r: Request, tokenizer) -> RequestOutput:
    """What a caller gets for a request that ran (the text cut at a matched stop string)."""
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(r.output_ids)
        if r.stop_text_len is not None:
            text = text[:r.stop_text_len]
    return RequestOutput(request_id=r.request_id, prompt=r.prompt,
                         prompt_token_ids=r.prompt_ids, token_ids=list(r.output_ids),
                         text=text, finish_reason=r.finish_reason, num_rounds=r.num_rounds,
                         num_draft_tokens=r.num_draft_tokens,
                         num_accepted_tokens=r.num_accepted_tokens,
                         cached_tokens=r.cached_tokens, sample_index=r.sample_index,
                         logprobs=(list(r.logprobs) if r.params.logprobs is not None
                                   else None))


def error_output(request_id: str, prompt, message: str) -> RequestOutput:
    """The output of a prompt refused among several (``finish_reason="error"``)."""
    if isinstance(prompt, dict) and len(prompt) == 1:  # a prompt dict: what it holds
        prompt = next(iter(prompt.values()))
    ids = ([int(t) for t in prompt] if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, numbers.Integral) for t in prompt) else [])
    return RequestOutput(request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
                         prompt_token_ids=ids, token_ids=[], text="", finish_reason="error",
                         error=message)
