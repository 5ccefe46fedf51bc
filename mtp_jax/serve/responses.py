"""OpenAI response objects as pure functions of the engine's outputs: completions, chat
completions, their stream chunks, ``usage``, and the per-request speculative stats (a field of
their own, ``speculative``), plus the server-sent-event framing."""

from __future__ import annotations

import json
import time
import uuid

from mtp_jax.engine.requests import RequestOutput

__all__ = ["new_id", "usage", "speculative", "finish_reason", "completion_object",
           "chat_object", "completion_chunk", "chat_chunk", "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    """A response id such as ``cmpl-<32 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(out: RequestOutput) -> str | None:
    """OpenAI's ``finish_reason``: ``stop`` (EOS, stop string or id), ``length``, or the
    engine's own (``abort``)."""
    return out.finish_reason


def usage(outs: list[RequestOutput]) -> dict:
    """``usage`` of a call's outputs (prompt tokens counted once per prompt: for its sample
    0)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs if o.sample_index == 0)
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}


def speculative(outs: list[RequestOutput]) -> dict:
    """Speculative-decoding stats of a call's outputs: ``accept_length`` (committed tokens
    per verify round), ``acceptance_rate`` (accepted / proposed drafts; None when none was
    proposed), and the counts they come from."""
    rounds = sum(o.num_rounds for o in outs)
    drafts = sum(o.num_draft_tokens for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    committed = sum(max(len(o.token_ids) - 1, 0) for o in outs)
    return {"accept_length": committed / rounds if rounds else None,
            "acceptance_rate": accepted / drafts if drafts else None,
            "num_rounds": rounds, "num_draft_tokens": drafts, "num_accepted_tokens": accepted}


def _head(rid: str, obj: str, model: str, created: int | None) -> dict:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def completion_object(rid: str, model: str, outs: list[RequestOutput],
                      created: int | None = None, logprobs: list | None = None) -> dict:
    """A ``text_completion`` with one choice per output (``token_ids`` added to each);
    ``logprobs``: each choice's ``logprobs`` object (or None)."""
    logprobs = logprobs or [None] * len(outs)
    choices = [{"index": i, "text": o.text, "logprobs": lp, "finish_reason": finish_reason(o),
                "token_ids": o.token_ids} for i, (o, lp) in enumerate(zip(outs, logprobs))]
    return {**_head(rid, "text_completion", model, created), "choices": choices,
            "usage": usage(outs), "speculative": speculative(outs)}


def chat_object(rid: str, model: str, outs: list[RequestOutput],
                created: int | None = None, logprobs: list | None = None) -> dict:
    """A ``chat.completion`` with one assistant message per output; ``logprobs`` as
    :func:`completion_object`'s."""
    logprobs = logprobs or [None] * len(outs)
    choices = [{"index": i, "message": {"role": "assistant", "content": o.text},
                "logprobs": lp, "finish_reason": finish_reason(o), "token_ids": o.token_ids}
               for i, (o, lp) in enumerate(zip(outs, logprobs))]
    return {**_head(rid, "chat.completion", model, created), "choices": choices,
            "usage": usage(outs), "speculative": speculative(outs)}


def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     token_ids: list[int], reason: str | None = None,
                     logprobs: dict | None = None) -> dict:
    """One streamed ``text_completion`` chunk of choice ``index`` (``logprobs``: of its
    tokens)."""
    return {**_head(rid, "text_completion", model, created),
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": reason, "token_ids": token_ids}]}


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict,
               reason: str | None = None, token_ids: list[int] | None = None,
               logprobs: dict | None = None) -> dict:
    """One ``chat.completion.chunk`` of choice ``index`` (``logprobs``: of its tokens)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_head(rid, "chat.completion.chunk", model, created), "choices": [choice]}


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
