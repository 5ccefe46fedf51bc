"""The host side of per-token log-probabilities: a call's logprob columns read back
(:mod:`mtp_jax.sampling.logprobs`) become each request's :class:`TokenLogprob`s, one per kept
output token, with the request's own number of top alternatives."""

from __future__ import annotations

import numpy as np

from mtp_jax.engine.requests import Request, TokenLogprob
from mtp_jax.sampling.logprobs import split_logprob_columns, top_bucket

__all__ = ["call_top", "record", "record_first", "round_logprobs"]


def call_top(reqs) -> int:
    """The ``logprobs`` field of a call's variant over ``reqs`` (-1: nobody asks)."""
    return top_bucket(r.params.logprobs for r in reqs)


def round_logprobs(host) -> tuple | None:
    """``(chosen [R, B, k+1], top_ids [R, B, k+1, N], top_logprobs [R, B, k+1, N])`` of a
    host :class:`~mtp_jax.engine.programs.RoundOutput`, or None for a call without them."""
    if host.top < 0:
        return None
    return split_logprob_columns(host.logprob_columns, host.top)


def record(req: Request, chosen: np.ndarray, top_ids: np.ndarray, top_lps: np.ndarray,
           tokens: list[int]) -> None:
    """Append ``tokens``' log-probabilities to ``req.logprobs`` when it asked for them:
    position r's token and its ``req.params.logprobs`` best alternatives (of the call's
    ``top_ids [R, N]`` / ``top_lps [R, N]``, most likely first); ``chosen [R]``."""
    want = req.params.logprobs
    if want is None:
        return
    for r, tok in enumerate(tokens):
        top = [(int(i), float(v)) for i, v in zip(top_ids[r, :want], top_lps[r, :want])]
        req.logprobs.append(TokenLogprob(int(tok), float(chosen[r]), top))


def record_first(req: Request, row: np.ndarray, k: int, top: int) -> None:
    """The first token's log-probabilities from a prefill's output row ``[k+1 + 1 + 2 top]``
    (``top < 0``: the call computed none)."""
    if top < 0:
        return
    chosen, ids, lps = split_logprob_columns(np.asarray(row)[k + 1:], top)
    record(req, chosen, ids, lps, req.output_ids[:1])
