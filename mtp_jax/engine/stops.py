"""Per-token stops on the host: EOS (unless ``ignore_eos``), stop token ids, stop strings,
``max_tokens`` and ``max_model_len``, applied token by token inside a committed chunk so that
nothing after a stop is kept (used by the scheduler)."""

from __future__ import annotations

from typing import Iterable

from mtp_jax.engine.requests import Request


def append_tokens(req: Request, tokens: Iterable[int], eos_ids, tokenizer,
                  max_model_len: int) -> int:
    """Append committed tokens one by one, applying every stop (EOS unless ``ignore_eos``, stop
    ids, stop strings, ``max_tokens``, ``max_model_len``); nothing after a stop is kept.
    Returns how many tokens were kept."""
    kept = 0
    p = req.params
    for tok in tokens:
        tok = int(tok)
        req.output_ids.append(tok)
        kept += 1
        if (not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids:
            req.finish_reason = "stop"
        elif p.stop and tokenizer is not None and _stop_string(req, tokenizer):
            req.finish_reason = "stop"
        elif len(req.output_ids) >= p.max_tokens:
            req.finish_reason = "length"
        elif len(req.prompt_ids) + len(req.output_ids) >= max_model_len:
            req.finish_reason = "length"
        if req.finished:
            break
    return kept


def _stop_string(req: Request, tokenizer) -> bool:
    text = tokenizer.decode(req.output_ids)
    hits = [text.find(s) for s in req.params.stop if s in text]
    if hits:
        req.stop_text_len = min(hits)
        return True
    return False
