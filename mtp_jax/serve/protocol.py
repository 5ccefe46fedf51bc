"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``: the fields this server
takes (pydantic models, strict types), the OpenAI fields it does not support (a 400 naming
the field unless the value is the one that changes nothing), and the sampling parameters of a
request."""

from __future__ import annotations

import numbers
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mtp_jax.prompts import short_repr
from mtp_jax.sampling import MAX_LOGPROBS, SamplingParams
from mtp_jax.serve.errors import APIError

__all__ = ["CompletionBody", "ChatBody", "parse_body", "sampling_params"]

# OpenAI (and vLLM) fields that need what this server does not have; taken only with the value
# that asks for nothing (None, or the listed ones).
UNSUPPORTED = {
    "repetition_penalty": (1,),
    "logit_bias": ({},), "best_of": (1,), "echo": (False,), "suffix": (),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (), "response_format": ({"type": "text"},), "min_tokens": (0,),
    "guided_json": (), "guided_regex": (), "guided_choice": (),
    "prediction": (), "audio": (), "modalities": (["text"],), "reasoning_effort": (),
    "store": (False,), "metadata": (), "service_level": (), "service_tier": (),
    "web_search_options": (),
}


def _neutral(value, neutrals) -> bool:
    """Whether ``value`` asks for nothing: None, or equal to a neutral value of its kind (a
    bool is not a number here)."""
    if value is None:
        return True
    for n in neutrals:
        same_kind = (isinstance(value, bool) == isinstance(n, bool)
                     and (type(value) is type(n) or (isinstance(value, numbers.Real)
                                                    and isinstance(n, numbers.Real))))
        if same_kind and value == n:
            return True
    return False


def check_unsupported(body: dict) -> None:
    """Raise a 400 :class:`APIError` naming the first field this server cannot honour."""
    for name, value in body.items():
        if name in UNSUPPORTED and not _neutral(value, UNSUPPORTED[name]):
            raise APIError(400, f"'{name}' is not supported by this server (got {value!r}); "
                                "leave it out.", param=name, code="unsupported_field")


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float | None = None  # None (JSON null, as some clients send): off
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = 1


class CompletionBody(_Sampling):
    """``/v1/completions``: ``prompt`` is a string, token ids, or a list of either (one choice
    per prompt)."""

    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None  # top alternatives per token (0: the chosen token's only)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message (text content only)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[TextPart], None] = None


class ChatBody(_Sampling):
    """``/v1/chat/completions``: ``messages`` rendered by the checkpoint's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # variables the template reads
    logprobs: bool = False
    top_logprobs: int | None = None


def parse_body(body: Any, model_cls: type[BaseModel]) -> BaseModel:
    """Validate a decoded JSON body: a 400 :class:`APIError` naming the field for a body that
    is not an object, a field not supported, an unknown field, or a value of the wrong type."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not "
                            f"{type(body).__name__}.")
    check_unsupported(body)
    taken = {k: v for k, v in body.items() if k not in UNSUPPORTED}
    try:
        return model_cls.model_validate(taken)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            raise APIError(400, f"unknown field '{param}'; this server takes: "
                                f"{', '.join(sorted(model_cls.model_fields))}.",
                           param=param, code="unknown_field") from None
        union = _union_error(e.errors())
        if union is not None:
            raise APIError(400, union[1], param=union[0]) from None
        raise APIError(400, f"{param}: {err['msg']} "
                            f"(got {short_repr(err.get('input'), 80)}).", param=param) from None


# pydantic's name of a union member in an error's location (a type, not a field name).
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict|[A-Za-z_]+\[.*\])$")
# How a union member's name (pydantic's tag in an error's location) reads in a message.
_MEMBER_NAMES = {"str": "a string", "list[int]": "a list of token ids",
                 "list[str]": "a list of strings", "list[list[int]]": "a list of token-id lists",
                 "list[TextPart]": 'a list of {"type": "text", "text": ...} parts (text only)'}


def _union_error(errors: list) -> tuple[str, str] | None:
    """``(param, message)`` when a value matched none of a field's types: pydantic reports
    one error per member of the union, each under the member's name (``content.str``,
    ``content.list[TextPart].1.type``), which names no real field. The message names the
    field, its accepted forms, and the deepest mismatch found (the member the value came
    closest to). None for errors of another kind."""
    locs = [tuple(e["loc"]) for e in errors]
    n = 0
    while all(len(loc) > n for loc in locs) and len({loc[n] for loc in locs}) == 1:
        n += 1
    members = list(dict.fromkeys(loc[n] for loc in locs if len(loc) > n))
    if len(errors) < 2 or len(members) < 2 or n == 0 or not all(
            isinstance(m, str) and _TYPE_TAG.match(m) for m in members):
        return None  # errors of several fields, or of list items: not one union's members
    param = ".".join(str(p) for p in locs[0][:n])
    value = next((e.get("input") for loc, e in zip(locs, errors) if len(loc) == n + 1),
                 errors[0].get("input"))
    loc, deepest = max(zip(locs, errors), key=lambda pair: len(pair[0]))
    where = ".".join(str(p) for p in loc[n + 1:])
    at = f"as {loc[n]}{', at ' + where if where else ''}: {deepest['msg']}"
    forms = " or ".join(_MEMBER_NAMES.get(m, m) for m in members)
    return param, f"{param} {short_repr(value, 80)} must be {forms} ({at})."


def logprobs_asked(body: _Sampling) -> int | None:
    """``SamplingParams.logprobs`` of a body: completions' ``logprobs`` (an int: top
    alternatives), chat's ``top_logprobs`` when ``logprobs`` is true (0 when not given);
    None when not asked. A 400 for chat's ``top_logprobs`` without ``logprobs: true`` or out
    of range (OpenAI's rules)."""
    if not isinstance(body, ChatBody):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, f"top_logprobs {body.top_logprobs} needs \"logprobs\": true.",
                       param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs {body.top_logprobs} must be an int in "
                            f"[0, {MAX_LOGPROBS}].", param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None


def sampling_params(body: _Sampling, max_tokens: int) -> SamplingParams:
    """The :class:`SamplingParams` of a request with ``max_tokens`` resolved; a 400 naming
    the bad value (the engine's own message)."""
    logprobs = logprobs_asked(body)
    try:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p,
                              top_k=body.top_k, min_p=body.min_p or 0.0,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0,
                              max_tokens=max_tokens,
                              seed=body.seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                              ignore_eos=body.ignore_eos, n=body.n, logprobs=logprobs)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param if param in type(body).model_fields
                       else None) from None
