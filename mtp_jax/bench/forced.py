"""Forced drafts: speculative rounds at a chosen accept length whose output must equal plain
decoding.

Given each request's greedy continuation from plain decoding (k = 0), the drafts a round will
verify (``pools.next_tokens[slot, 1:]``, written by the MTP draft steps of the previous round or
of the prefill, which still run for their cost) are overwritten before the round by the
continuation with the first ``m`` drafts right and the rest wrong. Greedy acceptance then takes
exactly ``m`` drafts and the bonus token, so the round commits ``m + 1`` tokens (its accept
length), and with an exact engine every committed token equals the continuation.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np


def accept_fraction(accept_length: float, k: int) -> Fraction:
    """``accept_length`` as an exact fraction (denominator <= 100); ``ValueError`` unless
    ``1 <= accept_length <= k + 1`` (a round commits 1..k+1 tokens)."""
    if not (isinstance(accept_length, (int, float)) and math.isfinite(accept_length)):
        raise ValueError(f"accept length {accept_length!r} must be a number.")
    a = Fraction(str(accept_length)).limit_denominator(100)
    if not 1 <= a <= k + 1:
        raise ValueError(f"accept length {accept_length} cannot be forced with k={k}: a round "
                         f"commits 1..{k + 1} tokens; pick --accept-lengths in [1, {k + 1}].")
    return a


def commits_of_round(a: Fraction, r: int) -> int:
    """Tokens round ``r`` (0-based) commits so that rounds ``0..r`` commit ``floor(a (r+1))``
    together: alternates ``floor(a)`` and ``ceil(a)`` (e.g. 2, 3, 2, 3 for 2.5)."""
    return math.floor(a * (r + 1)) - math.floor(a * r)


def forced_drafts(outputs: list[list[int]], reference: list[list[int]], m: int, k: int,
                  vocab: int) -> np.ndarray:
    """Drafts for the next round of each request, ``[B, k]`` int32.

    ``outputs[i]``: request i's committed tokens (the last one is the pending token, verified
    at row 0); ``reference[i]``: its plain-decoding continuation (``reference[i][0]`` is the
    prefill's token). Draft j (1-based) is ``reference[i][n - 1 + j]`` (n = committed count) for
    ``j <= m`` and that token + 1 (mod ``vocab``), a wrong one, for ``j > m``.
    Raises ``ValueError`` when the reference is too short for the drafts up to ``m + 1``.
    """
    out = np.zeros((len(outputs), k), np.int32)
    for i, (done, ref) in enumerate(zip(outputs, reference)):
        n = len(done)
        for j in range(1, k + 1):
            idx = n - 1 + j
            if idx < len(ref):
                out[i, j - 1] = ref[idx] if j <= m else (ref[idx] + 1) % vocab
            elif j <= m + 1:
                raise ValueError(f"request {i}: the reference continuation has {len(ref)} "
                                 f"tokens; draft {j} after {n} committed tokens needs index "
                                 f"{idx}. Decode a longer reference.")
    return out


@functools.partial(jax.jit, donate_argnums=(0,))
def force_on_device(next_tokens: jax.Array, step: jax.Array, slot: jax.Array,
                    reference: jax.Array, m: jax.Array, vocab: jax.Array) -> jax.Array:
    """:func:`forced_drafts` written into ``next_tokens [S, k+1]`` (donated) on the device, from
    each slot's generated-token count ``step [S]`` (``Pools.step``, equal to the host's
    committed count), so that it can run between two rounds without reading the first one's
    result.

    ``slot [B]`` int32; ``reference [B, L]`` int32 plain continuations; ``m`` and ``vocab``
    int32 scalars. Draft j of row b is ``reference[b, step - 1 + j]`` for ``j <= m``, else that
    token + 1 (mod ``vocab``). Indices past ``L - 1`` read the last reference token (the host
    sizes the reference so that the right drafts never need them)."""
    k = next_tokens.shape[1] - 1
    j = jnp.arange(1, k + 1, dtype=jnp.int32)[None, :]
    idx = jnp.clip(step[slot][:, None] - 1 + j, 0, reference.shape[1] - 1)
    truth = jnp.take_along_axis(reference, idx, axis=1)
    drafts = jnp.where(j <= m, truth, (truth + 1) % vocab)
    return next_tokens.at[slot, 1:].set(drafts)


def compare_to_reference(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """Whether every request's committed tokens are a prefix of its reference.

    Returns ``{"exact", "tokens_compared", "mismatched_requests", "first_mismatch"}`` where
    ``first_mismatch`` is ``None`` or ``{"request", "index", "expected", "got"}`` (``expected``
    is ``None`` when the output ran past the reference).
    """
    bad, first, compared = [], None, 0
    for i, (done, ref) in enumerate(zip(outputs, reference)):
        compared += len(done)
        for j, tok in enumerate(done):
            want = ref[j] if j < len(ref) else None
            if tok != want:
                bad.append(i)
                if first is None or j < first["index"]:
                    first = {"request": i, "index": j, "expected": want, "got": int(tok)}
                break
    return {"exact": not bad, "tokens_compared": compared, "mismatched_requests": bad,
            "first_mismatch": first}
