"""The static choices of a program call, as frozen hashable dataclasses.

A program is compiled once per batch shape and variant; the variant is the static argument of
the jitted function (as gemma's sampler loop object is), so the executable caches key on it and
a typo in a field name is an error, not a new program. The host picks the variant of every
call from what it knows about the batch, so the programs hold no run-time test of it (on a GPU
each ``lax.cond`` predicate is a device-to-host round trip).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from mtp_jax.sampling import SamplingTensors

__all__ = ["PROPOSERS", "PrefillVariant", "RoundVariant", "sampling_choice"]

PROPOSERS = ("none", "mtp", "external")  # who drafts a round's tokens


@dataclasses.dataclass(frozen=True)
class PrefillVariant:
    """Static choices of a prefill program.

    k: drafts per round (``speculative_num_steps``; 0 with speculation off); mtp: the MTP draft
    runs over the chunk and drafts ``d_1..d_k``; greedy_only: every row is greedy, so no
    sampling path is traced; logprobs: -1, or the top alternatives whose log-probabilities
    the first token reports (:mod:`mtp_jax.sampling.logprobs`); penalties: some row whose
    prompt the chunk ends has a presence or frequency penalty, so the chunk sets its output
    counts and the MTP draft penalises its drafts (:mod:`mtp_jax.sampling.penalties`);
    drafts (with ``mtp``): the chunk drafts ``d_1..d_k``; False: it writes only the draft KV
    over its rows and leaves the drafts stale (-1: the first round verifies none), for a
    chunk whose drafts no round would verify
    (:meth:`~mtp_jax.engine.scheduler.Scheduler.prefill_drafts`)."""

    k: int
    mtp: bool
    greedy_only: bool = False
    logprobs: int = -1
    penalties: bool = False
    drafts: bool = True


@dataclasses.dataclass(frozen=True)
class RoundVariant:
    """Static choices of a round program (:func:`mtp_jax.engine.programs.rounds`).

    k: drafts per round (0: a plain decode step); proposer: one of :data:`PROPOSERS`;
    greedy_only: every row greedy (no sampling path traced); filtering: for rounds that sample,
    whether some row filters by top-k / top-p (``True``: the filter is traced, ``False``: none
    is; ``None``: tested at run time); snapshot: some row crosses a prefix-cache boundary, so
    the snapshot replay is traced; rounds: rounds per call (multi-step scheduling); logprobs:
    -1, or the top alternatives whose log-probabilities every emitted token reports
    (:class:`~mtp_jax.engine.programs.RoundOutput`; rounds without them compute none);
    penalties: some row has a presence or frequency penalty, so the round penalises the
    logits it reads and counts the tokens it commits (:mod:`mtp_jax.sampling.penalties`;
    rounds without traces neither). Raises ``ValueError`` for an unknown proposer or
    ``rounds < 1``."""

    k: int
    proposer: str
    greedy_only: bool = False
    filtering: bool | None = None
    snapshot: bool = False
    rounds: int = 1
    logprobs: int = -1
    penalties: bool = False

    def __post_init__(self):
        if self.proposer not in PROPOSERS:
            raise ValueError(f"RoundVariant proposer {self.proposer!r} is not one of "
                             f"{', '.join(PROPOSERS)}.")
        if self.rounds < 1:
            raise ValueError(f"RoundVariant rounds={self.rounds} must be >= 1.")


def sampling_choice(greedy: Iterable[bool], sampling: SamplingTensors,
                    vocab_size: int) -> dict:
    """The sampling fields of a variant for a batch: ``greedy_only`` when every request is
    greedy (``greedy``: each request's ``SamplingParams.greedy``), else ``filtering``, whether
    some row filters by top-k / top-p (:meth:`~mtp_jax.sampling.SamplingTensors.filters_any`
    on the batch's host rows), so that the program holds no run-time test of either (the 2B
    sampled round lost about 0.15 ms to three of them, ``docs/benchmarks.md``, session 21),
    and ``penalties``, whether some row has a penalty
    (:meth:`~mtp_jax.sampling.SamplingTensors.penalizes_any`). Returns keywords for
    ``dataclasses.replace`` of a variant."""
    penalties = sampling.penalizes_any()
    if all(greedy):
        return {"greedy_only": True, "filtering": None, "penalties": penalties}
    return {"greedy_only": False, "filtering": sampling.filters_any(vocab_size),
            "penalties": penalties}
