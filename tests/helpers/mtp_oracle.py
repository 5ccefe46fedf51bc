"""What the MTP chain drafts, derived from teacher-forced ``mtp_forward`` calls only.

The research API's ``model.mtp_forward(hidden, next_ids)`` runs the draft layer causally over a
row of (hidden, next token) pairs. A round's chain started at row t (the last committed row) is
such a row: the target's hiddens of rows 0..t, then the chain's own outputs ``z_0 .. z_{j-1}``,
with the tokens that follow each position; its draft j is the argmax of the output at position
t + j. This module builds those rows (one ``mtp_forward`` call per chain step, every start row
at once) and nothing else of the engine or of :mod:`mtp_jax.train`, so it is an independent
reference for both the engine's accept counts and the trainer's chain.
"""

from __future__ import annotations

import numpy as np

from mtp_jax.speculative.adaptive import GreedyShare, RequestAcceptance


def chain_outputs(model, hidden: np.ndarray, ids: np.ndarray, k: int):
    """Chains started at every row of one sequence.

    Args: ``hidden [T, H]`` (target hidden after the final norm), ``ids [T]`` int, ``k`` steps.
    Returns: ``(logits [k, T, V] float32, z [k, T, H])``: step j of the chain started at row t
    (predicts token t + j + 2; meaningful where t + j + 1 < T).
    """
    hidden, ids = np.asarray(hidden), np.asarray(ids)
    t_len, h = hidden.shape
    length = t_len + k
    next_ids = np.zeros(length, np.int32)
    next_ids[:t_len - 1] = ids[1:]
    rows_ids = np.broadcast_to(next_ids, (t_len, length)).copy()
    rows_h = np.zeros((t_len, length, h), hidden.dtype)
    for t in range(t_len):
        rows_h[t, :t + 1] = hidden[:t + 1]
    logits_out, z_out = [], []
    for j in range(k):
        logits, z = model.mtp_forward(rows_h, rows_ids)
        logits, z = np.asarray(logits), np.asarray(z)
        at = np.arange(t_len) + j  # the chain's position at step j
        logits_out.append(logits[np.arange(t_len), at])
        z_out.append(z[np.arange(t_len), at])
        if j + 1 < k:
            rows_h[np.arange(t_len), at + 1] = z_out[-1].astype(rows_h.dtype)
    return np.stack(logits_out), np.stack(z_out)


def greedy_drafts(model, ids, k: int) -> np.ndarray:
    """``[T, k]`` int32: the greedy drafts of the chain started at each row of ``ids [T]``
    (the target's hidden from ``model.forward``)."""
    _, hidden = model.forward(np.asarray(ids)[None])
    logits, _ = chain_outputs(model, np.asarray(hidden)[0], ids, k)
    return np.argmax(logits, -1).T.astype(np.int32)


def expected_rounds(drafts: np.ndarray, sequence, prompt_len: int, k: int,
                    max_new: int, plan=(), prefill_drafts: bool = True
                    ) -> list[tuple[int, int, int]]:
    """The rounds of greedy MTP decoding of ``sequence`` (the plain greedy continuation: prompt
    of ``prompt_len`` tokens then ``max_new`` generated ones), as ``(pending position p, drafts
    verified, drafts accepted)`` per round.

    Prefill commits token ``prompt_len`` (the first generated) and drafts from row
    ``prompt_len - 1``; a round whose pending token is at position p verifies the drafts of the
    chain started at row p - 1, accepts the longest prefix equal to the sequence, and commits
    that many plus one. A round near ``max_new`` verifies only as many drafts as it may still
    emit tokens besides the bonus (the engine's clamp, :func:`mtp_jax.speculative.clamp.
    clamp_drafts`). ``drafts [T, >= k]``: :func:`greedy_drafts` of ``sequence``.

    ``plan``: the k of the first rounds (one round per call; later rounds draft ``k``), as
    adaptive speculation picks them: a plain round (0) commits one token and leaves the drafts
    stale, so the next drafting round verifies none (it drafts from its committed row); the
    drafting rounds after that verify as if no round had been plain. ``prefill_drafts``
    False: the prefill wrote the draft KV only and drafted nothing, so the first drafting
    round verifies none, as after a plain round.
    """
    seq, plan = np.asarray(sequence), list(plan)
    end = prompt_len + max_new  # tokens in the finished sequence
    out, p, fresh = [], prompt_len, prefill_drafts
    while p <= end - 2:  # a round emits at least one new token past the pending one
        drafting = (plan.pop(0) if plan else k) > 0
        room = min(k, end - 2 - p) if drafting and fresh else 0
        n = 0
        while n < room and drafts[p - 1, n] == seq[p + 1 + n]:
            n += 1
        out.append((p, room, n))
        p, fresh = p + n + 1, drafting
    return out


class ScriptedAdaptive:
    """A double of the engine's adaptive policy (``engine.scheduler.adaptive``) for one request
    at a time: whether each call drafts comes from ``plan`` (then always ``k``), with the caps
    as the policy sets them from the request's state (none in the first round after a call
    without drafts, or after a prefill that drafted none: the scheduler marks the state);
    ``prefill_drafts``: what :meth:`drafts_first` answers, so whether prefills draft."""

    enabled = True
    never_drafts = False

    def __init__(self, plan, k: int, prefill_drafts: bool = True):
        self.ks, self.k, self.prefill_drafts = list(plan), k, prefill_drafts
        self.greedy = GreedyShare()  # observed by the scheduler, unused here

    def fresh(self, greedy: bool) -> RequestAcceptance:
        return RequestAcceptance.fresh(self.k)

    def drafts_first(self, st) -> bool:
        return self.prefill_drafts

    def plan_call(self, states, greedy, rounds):
        return [self.plan(st, rounds) for st in states]

    def plan(self, st, rounds):
        k = self.ks.pop(0) if self.ks else self.k
        first = k if st.drafting else 0
        st.drafting = k > 0
        return first, k
