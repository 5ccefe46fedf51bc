"""Adaptive speculation: draft only where it pays, so that MTP is never slower than plain decoding.

A round of k drafts costs ``c`` decode steps (``c`` > 1: the verify reads the target once for
k+1 rows, the draft runs k times) and commits ``1 + accepted`` tokens; a plain decode step
costs 1 and commits 1. Drafting pays when the tokens a round commits exceed ``c``.

Per request, the host keeps an estimate of the tokens a full round commits
(:class:`RequestAcceptance`: an exponentially weighted mean over its rounds that verified all
k drafts, started at the optimistic ``k + 1`` so that every request first drafts). Per call,
:class:`AdaptivePolicy` picks the call's k: the engine's k when the batch's mean estimate
exceeds ``c`` of its batch bucket, else 0, a plain decode step (the round program's ``k = 0``
variant: one verify row, no draft chain; with MTP it still writes the draft's KV of the
committed row, so that the draft is ready when drafting resumes). A compiled round verifies
its k drafts for every row whatever the row's acceptance, so a per-row k below the program's
would save no time: the choice is per call, and a request with poor drafts only turns a
batch plain when the batch as a whole gains nothing from drafting.

While a batch decodes plainly, no draft is verified and nothing is learnt; every
``probe_interval`` plain rounds (doubling after each probe that finds drafting still unpaid,
from :data:`PROBE_FIRST` to :data:`PROBE_MAX` rounds, reset when drafting pays) the batch
drafts for :data:`PROBE_ROUNDS` rounds to measure again. The first round after plain rounds
verifies no draft (the MTP drafts of plain rounds are not made; the program marks them stale),
so a probe is at least two rounds.

``c`` comes from the bytes the round and the decode step must read
(:func:`round_cost`, :func:`~mtp_jax.models.round_bytes.round_bytes`), not from timings, so
that the choice and therefore a seeded sampled output do not depend on the machine's speed;
on the H200 those ratios match the measured ones (2B 1.9 vs 2.0-2.2, 35B-A3B 2.5 vs 2.4,
docs/benchmarks.md). The output is exact either way: a plain step and a round commit
target-verified tokens only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from mtp_jax.config import ModelConfig, SpeculativeConfig
from mtp_jax.models.round_bytes import round_bytes

__all__ = ["DECAY", "ROUND_OVERHEAD", "PROBE_FIRST", "PROBE_MAX", "PROBE_ROUNDS", "ROUND_COST_CONTEXT",
           "RequestAcceptance", "AdaptivePolicy", "round_cost", "policy_for"]

DECAY = 0.8  # weight of the past per observed round (about the last 5 rounds count)
PROBE_FIRST = 64  # plain rounds before the first probe
PROBE_MAX = 512  # the longest gap between probes, in plain rounds
PROBE_ROUNDS = 2  # rounds of a probe (the first verifies no draft after plain rounds)
ROUND_COST_CONTEXT = 1024  # tokens of context the cost ratio is computed at
# What a round costs beyond its bytes (the verify's accept and commit, more launches), in decode
# steps: on the H200 at batch 1 the measured round / step less the byte ratio was 2B +0.09,
# 4B +0.19, 27B +0.10, 35B-A3B -0.10 (docs/benchmarks.md, 2026-12-04).
ROUND_OVERHEAD = 0.15


@dataclasses.dataclass
class RequestAcceptance:
    """A request's estimate of the tokens a full round (all ``k`` drafts verified) commits:
    ``weighted_tokens / weight``, an exponentially weighted mean (decay :data:`DECAY` per
    observed round) started at ``k + 1`` with weight 1."""

    weighted_tokens: float
    weight: float = 1.0

    @classmethod
    def fresh(cls, k: int) -> "RequestAcceptance":
        """The optimistic start: every draft accepted."""
        return cls(float(k + 1))

    @property
    def tokens_per_round(self) -> float:
        return self.weighted_tokens / self.weight

    def observe(self, tokens: int) -> None:
        """One full round that committed ``tokens`` (accepted drafts + 1)."""
        self.weighted_tokens = DECAY * self.weighted_tokens + tokens
        self.weight = DECAY * self.weight + 1.0


def round_cost(cfg: ModelConfig, k: int, batch: int, itemsize: int,
               draft_vocab_size: int | None = None, draft_head_dtype: str | None = None,
               draft_layer_dtype: str | None = None,
               context: int = ROUND_COST_CONTEXT, host_drafts: bool = False) -> float:
    """The time of a round of ``k`` MTP drafts over ``batch`` requests in decode steps,
    modelled as the ratio of the bytes each must read at ``context`` tokens
    (:func:`~mtp_jax.models.round_bytes.round_bytes`; the draft head and layer options as
    there), plus :data:`ROUND_OVERHEAD`; ``host_drafts``: the drafts come from the host
    (an external proposer), so the draft's bytes are not counted. A float > 1. At large
    batches, where the verify's k+1 rows per request become compute-bound, it is low (4B at
    batch 32: 1.50 against 1.78 measured)."""
    parts = round_bytes(cfg, batch, k, context, itemsize, draft_vocab_size=draft_vocab_size,
                        draft_head_dtype=draft_head_dtype, draft_layer_dtype=draft_layer_dtype)
    full = parts["total"]
    if host_drafts:
        full -= parts["draft_weights"] + parts["draft_kv_read"]
    return full / round_bytes(cfg, batch, 0, context, itemsize)["total"] + ROUND_OVERHEAD


@dataclasses.dataclass
class AdaptivePolicy:
    """Chooses each round call's k (see the module docstring).

    ``k``: the engine's k (``speculative_num_steps``, the most a call drafts); ``cost(b)``:
    the round's time in decode steps at batch bucket ``b`` (:func:`round_cost`, or a fixed
    ratio); ``enabled``: False keeps every call at ``k``. The probe state is the policy's own:
    plain rounds since the last probe, the current gap and the probe rounds still to run."""

    k: int
    cost: Callable[[int], float]
    enabled: bool = True
    probe_interval: int = PROBE_FIRST
    plain_rounds: int = 0
    probe_left: int = 0

    def choose(self, rows: list[RequestAcceptance], bucket: int, rounds: int) -> int:
        """The k of the next call of ``rounds`` rounds over requests with estimates ``rows``
        at batch bucket ``bucket``: ``self.k`` or 0."""
        if not self.enabled or self.k == 0 or not rows:
            return self.k
        if self.probe_left > 0:
            self.probe_left = max(0, self.probe_left - rounds)
            return self.k
        mean = sum(r.tokens_per_round for r in rows) / len(rows)
        if mean > self.cost(bucket):
            self.probe_interval, self.plain_rounds = PROBE_FIRST, 0
            return self.k
        self.plain_rounds += rounds
        if self.plain_rounds < self.probe_interval:
            return 0
        self.plain_rounds = 0
        self.probe_interval = min(2 * self.probe_interval, PROBE_MAX)
        self.probe_left = max(0, PROBE_ROUNDS - rounds)
        return self.k


def policy_for(cfg: ModelConfig, speculative: SpeculativeConfig, itemsize: int,
               draft_vocab_size: int | None = None) -> AdaptivePolicy | None:
    """The engine's policy for ``speculative`` (None with speculation off or adaptation off):
    its ``adaptive_round_cost`` when set, else per batch bucket the byte ratio of
    :func:`round_cost` (with the draft options; for a host proposer, only the verify's
    bytes: its drafts cost no device time). ``itemsize``: bytes per model-dtype weight."""
    if not speculative.enabled or not speculative.adaptive:
        return None
    k, fixed = speculative.k, speculative.adaptive_round_cost
    if fixed is not None:
        return AdaptivePolicy(k, lambda bucket: float(fixed))

    @functools.lru_cache(maxsize=None)
    def cost(bucket: int) -> float:
        return round_cost(cfg, k, bucket, itemsize, draft_vocab_size,
                          speculative.draft_head_dtype, speculative.draft_layer_dtype,
                          host_drafts=speculative.algorithm != "mtp")

    return AdaptivePolicy(k, cost)
