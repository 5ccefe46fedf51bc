"""A synthetic "motif language" for tiny test models, deterministic in its seeds.

The language is a cycle of :data:`NUM_MOTIFS` motifs (4..8 tokens each, over the
:data:`NUM_SYMBOLS` ids ``FIRST_ID ..``), walked motif after motif. :data:`NUM_BRANCHES` motifs
are branch points: after them the walk takes the cycle's next motif with probability
:data:`P_MAJOR` (0.75) and a fixed other motif otherwise. Tokens are shared between motifs, so
the current token alone rarely says what comes next, but the last :data:`CONTEXT` (3) tokens
always do, except at a branch point, where they give the 75/25 choice (far from a tie, so greedy
decoding is stable). A prompt of 3 or more tokens from the language therefore fixes its whole
greedy continuation. Ids 0 and 1 never occur (1 is the tiny fixtures' eos id), so continuations
run to ``max_tokens``.

The language is chosen by ``language_seed``; the sequences and prompts drawn from it by ``seed``
(use another ``seed`` for held-out data).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["FIRST_ID", "NUM_SYMBOLS", "NUM_MOTIFS", "NUM_BRANCHES", "P_MAJOR", "CONTEXT",
           "MotifLanguage", "motif_language", "motif_sequences", "motif_prompts"]

FIRST_ID = 2  # ids 0 and 1 are never used (1 is the tiny fixtures' eos id)
NUM_SYMBOLS = 20
NUM_MOTIFS = 16
MOTIF_LENGTHS = (4, 8)  # inclusive
NUM_BRANCHES = 4
P_MAJOR = 0.75
CONTEXT = 3  # tokens that determine the next one (motifs are longer, so a window spans <= 2)


@dataclasses.dataclass(frozen=True)
class MotifLanguage:
    """A motif language (make one with :func:`motif_language`).

    Attributes:
      motifs: the motifs' token ids.
      successors: per motif, ``((motif, probability), ...)``: one entry (probability 1), or two
        at a branch point (the cycle's next motif first, with :data:`P_MAJOR`).
      table: every ``CONTEXT``-token window of the language -> ``{next id: probability}``.
    """

    motifs: tuple[tuple[int, ...], ...]
    successors: tuple[tuple[tuple[int, float], ...], ...]
    table: dict = dataclasses.field(repr=False, compare=False, hash=False)

    def next_tokens(self, context) -> dict[int, float]:
        """``{id: probability}`` of the token after ``context`` (its last ``CONTEXT`` ids).
        Raises ``ValueError`` for a context that is not in the language."""
        key = tuple(int(t) for t in context[-CONTEXT:])
        if key not in self.table:
            raise ValueError(f"context {key} is not in the motif language (it needs "
                             f"{CONTEXT} tokens the language produces).")
        return self.table[key]

    def greedy(self, context, n: int) -> list[int]:
        """The ``n`` most likely next ids after ``context``, each from the one before."""
        out = [int(t) for t in context]
        for _ in range(n):
            dist = self.next_tokens(out)
            out.append(max(dist, key=dist.get))
        return out[len(context):]

    def determined(self, tokens) -> np.ndarray:
        """``[len(tokens)]`` bool: entry t is True when token t+1 is a function of tokens
        ``t-CONTEXT+1 .. t`` (False for the first ``CONTEXT-1`` positions, at branch points,
        and for the last position)."""
        out = np.zeros(len(tokens), bool)
        for t in range(CONTEXT - 1, len(tokens) - 1):
            out[t] = len(self.next_tokens(tokens[t - CONTEXT + 1:t + 1])) == 1
        return out

    def sample(self, rng: np.random.Generator, length: int) -> list[int]:
        """``length`` ids of a walk that starts at a random motif and offset."""
        m = int(rng.integers(len(self.motifs)))
        out = list(self.motifs[m][int(rng.integers(len(self.motifs[m]))):])
        while len(out) < length:
            succ = self.successors[m]
            m = succ[0][0] if len(succ) == 1 or rng.random() < succ[0][1] else succ[1][0]
            out.extend(self.motifs[m])
        return out[:length]


def _windows(motifs, successors):
    """``(context, {next: probability})`` of every window, one site at a time."""
    for i, motif in enumerate(motifs):
        for j in range(len(motif) - CONTEXT):
            yield motif[j:j + CONTEXT], {motif[j + CONTEXT]: 1.0}
        yield motif[-CONTEXT:], {motifs[s][0]: p for s, p in successors[i]}
        for s, _ in successors[i]:
            joined = motif + motifs[s]
            for j in range(len(motif) - CONTEXT + 1, len(motif)):
                yield joined[j:j + CONTEXT], {joined[j + CONTEXT]: 1.0}


def _table(motifs, successors) -> dict | None:
    """The context table, or None when two sites share a context with different nexts."""
    table: dict = {}
    for ctx, dist in _windows(motifs, successors):
        if table.setdefault(ctx, dist) != dist:
            return None
    return table


@functools.lru_cache(maxsize=8)
def motif_language(language_seed: int = 0) -> MotifLanguage:
    """The motif language of ``language_seed`` (drawn again until every context is
    unambiguous; deterministic in the seed)."""
    rng = np.random.default_rng([language_seed, 0x6D6F7469])
    while True:
        lo, hi = MOTIF_LENGTHS
        motifs = tuple(tuple(int(t) for t in FIRST_ID + rng.integers(
            NUM_SYMBOLS, size=int(rng.integers(lo, hi + 1)))) for _ in range(NUM_MOTIFS))
        order = rng.permutation(NUM_MOTIFS)
        major = {int(order[k]): int(order[(k + 1) % NUM_MOTIFS]) for k in range(NUM_MOTIFS)}
        successors = [((major[i], 1.0),) for i in range(NUM_MOTIFS)]
        for i in rng.choice(NUM_MOTIFS, NUM_BRANCHES, replace=False):
            i = int(i)
            others = [s for s in range(NUM_MOTIFS) if s not in (i, major[i])
                      and motifs[s][0] != motifs[major[i]][0]]
            minor = int(rng.choice(others))
            successors[i] = ((major[i], P_MAJOR), (minor, 1.0 - P_MAJOR))
        table = _table(motifs, successors)
        if table is not None:
            return MotifLanguage(motifs, tuple(successors), table)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < FIRST_ID + NUM_SYMBOLS:
        raise ValueError(f"vocab_size {vocab_size} is too small for the motif language (ids "
                         f"{FIRST_ID}..{FIRST_ID + NUM_SYMBOLS - 1}); use at least "
                         f"{FIRST_ID + NUM_SYMBOLS}.")


def motif_sequences(n: int, length: int, seed: int, vocab_size: int = 256, *,
                    language_seed: int = 0) -> list[list[int]]:
    """``n`` sequences of ``length`` ids drawn from the language of ``language_seed``.

    Each starts at a random motif and offset (so its first ``CONTEXT - 1`` next tokens are not
    yet determined). Ids lie in ``[FIRST_ID, FIRST_ID + NUM_SYMBOLS)``; ``vocab_size`` is only
    checked against that (``ValueError`` when smaller).
    """
    _check_vocab(vocab_size)
    lang = motif_language(language_seed)
    rng = np.random.default_rng([seed, 1])
    return [lang.sample(rng, length) for _ in range(n)]


def motif_prompts(n: int, seed: int, *, min_len: int = 3, max_len: int = 40,
                  language_seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``min_len .. max_len`` ids (uniform; default 3..40) from the language,
    each starting at a random motif and offset; their greedy continuations are
    ``motif_language(language_seed).greedy(prompt, k)``."""
    if not CONTEXT <= min_len <= max_len:
        raise ValueError(f"prompt lengths {min_len}..{max_len} must satisfy "
                         f"{CONTEXT} <= min_len <= max_len (a shorter prompt does not fix its "
                         "continuation).")
    lang = motif_language(language_seed)
    rng = np.random.default_rng([seed, 2])
    return [lang.sample(rng, int(rng.integers(min_len, max_len + 1))) for _ in range(n)]
