"""OpenAI's ``logprobs`` objects from the engine's :class:`~mtp_jax.engine.requests.TokenLogprob`
lists: completions' ``{tokens, token_logprobs, top_logprobs, text_offset}`` and chat's
``{content: [{token, logprob, bytes, top_logprobs}], refusal}``.

The values are the engine's (:func:`mtp_jax.sampling.filtered_logprobs`: the distribution a
sampled request draws from, after temperature, top-k and top-p; greedy requests: the model's
``log_softmax``). JSON has no ``-inf``: ids a top-k / top-p filter drops are sent as
:data:`NEG_INF` (-9999.0, as vLLM sends them). A token's text is its own decoded text; an id
the tokenizer does not know (or a server without one) is ``"token_id:<id>"``. Completions' ``top_logprobs`` are keyed by text, so alternatives whose
texts coincide show once (the most likely); chat's lists show each."""

from __future__ import annotations

import math

from mtp_jax.engine.requests import TokenLogprob

__all__ = ["NEG_INF", "token_text", "completion_logprobs", "chat_logprobs"]

NEG_INF = -9999.0


def _num(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token id (special tokens included)."""
    if tokenizer is not None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if text:
            return text
    return f"token_id:{token_id}"


def completion_logprobs(lps: list[TokenLogprob], tokenizer, offset: int = 0) -> dict:
    """Completions' ``logprobs`` of ``lps``; ``offset``: the text offset of the first token
    (the length of the tokens' text before, in a stream)."""
    tokens = [token_text(tokenizer, x.token_id) for x in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_num(x.logprob) for x in lps],
            "top_logprobs": [_top_dict(x.top, tokenizer) for x in lps],
            "text_offset": offsets}


def _top_dict(top: list[tuple[int, float]], tokenizer) -> dict:
    """Completions' ``{text: logprob}`` of the top alternatives; ids whose texts coincide
    (bytes of one character decode alike) keep the first, most likely, value."""
    out: dict = {}
    for i, v in top:
        out.setdefault(token_text(tokenizer, i), _num(v))
    return out


def _chat_entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": _num(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(lps: list[TokenLogprob], tokenizer) -> dict:
    """Chat's ``logprobs`` of ``lps``."""
    return {"content": [{**_chat_entry(tokenizer, x.token_id, x.logprob),
                         "top_logprobs": [_chat_entry(tokenizer, i, v) for i, v in x.top]}
                        for x in lps],
            "refusal": None}
