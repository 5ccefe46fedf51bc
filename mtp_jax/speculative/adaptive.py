"""Adaptive speculation: draft only where it pays, so that MTP is never slower than plain decoding.

A round of k drafts costs ``c`` decode steps (``c`` > 1: the verify reads the target once for
k+1 rows, the draft runs k times) and commits ``1 + accepted`` tokens; a plain decode step
costs 1 and commits 1. Drafting pays when the tokens a round commits exceed ``c``.

Per request, the host keeps an estimate of the tokens a full round commits
(:class:`RequestAcceptance`: an exponentially weighted mean over its rounds that verified all
k drafts, started at the optimistic ``k + 1`` so that every request first drafts), and
:class:`AdaptivePolicy` decides per request and call whether it drafts. A call in which no
request drafts runs the round program's ``k = 0`` variant: plain decode steps, no draft chain
(with MTP it still writes the draft's KV of the committed row, so that the draft is ready when
drafting resumes); a call in which some request drafts runs the k-draft program, and the
requests that do not draft verify no draft in it (``RoundBatch.draft_cap``). Either way such
a request's token is drawn the same: a plain round of a speculative engine samples with the
stream of a round that verified no draft. So a request's tokens depend on its own history
only, not on the requests it shares a batch with, nor (below) on the schedule.

A round costing at least the ``k + 1`` tokens it can commit (``cost >= k + 1``, as for the
built-in default model, whose LM head is most of its bytes) can never pay, whatever is
accepted: then no request drafts and none probes (:attr:`AdaptivePolicy.never_drafts`), and the
warm-up builds no drafting round program.

While a request does not draft, nothing is learnt; every ``probe_interval`` plain rounds
(doubling after each probe that finds drafting still unpaid, from :data:`PROBE_FIRST` to
:data:`PROBE_MAX` rounds, reset when drafting pays) it drafts for :data:`PROBE_ROUNDS` rounds
to measure again. The first round after a call it did not draft in verifies no draft (its
drafts are stale), so a probe is at least two rounds. An observation counts for decisions one
call later than it could (the call in flight under overlap scheduling), with and without
overlap, so that both schedules make the same choices.

**Greedy requests share.** A greedy request's tokens are the target's argmax whatever it drafts,
so its choices may follow the batch, and they do (:meth:`AdaptivePolicy.plan_call`): a call
drafts when some request's own rule says so (a sampled request's, as above, or a greedy
request whose estimate beats ``c``) or in a probe window that the engine's greedy requests
share (:class:`GreedyShare`: the same doubling gaps, counted in the engine's plain rounds; a
new greedy request resets the gap to :data:`PROBE_FIRST`), and in a call that drafts every greedy
request drafts too (the program verifies k + 1 rows a request either way, so its drafts cost
nothing more there). A new greedy request starts from the estimate of the engine's recent
greedy rounds (the optimistic ``k + 1`` before there is one). With per-request probes (each
request probing at its own time), 8 requests that never accept drafted in 24 of 106 calls on
the CPU (11 now, 2 for the next 8), and on an H100 a burst of 32 2B requests gave 25% fewer
tokens/s with MTP on than off (docs/benchmarks.md, session 37).

``c`` comes from the bytes the round and the decode step must read at batch 1
(:func:`round_cost`, :func:`~mtp_jax.models.round_bytes.round_bytes`), not from timings or the
batch, so that the choices and therefore a seeded sampled output do not depend on the
machine's speed or on other requests; on the H200 those ratios plus :data:`ROUND_OVERHEAD`
match the measured ones within 0.1 (docs/benchmarks.md, 2026-12-04). The output is exact
either way: plain steps and rounds commit target-verified tokens only.
"""

from __future__ import annotations

import dataclasses

from mtp_jax.config import ModelConfig, SpeculativeConfig
from mtp_jax.models.round_bytes import round_bytes

__all__ = ["DECAY", "ROUND_OVERHEAD", "PROBE_FIRST", "PROBE_MAX", "PROBE_ROUNDS", "ROUND_COST_CONTEXT",
           "RequestAcceptance", "GreedyShare", "AdaptivePolicy", "round_cost", "policy_for"]

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
    """A request's adaptive-speculation state (host side, one per request).

    The estimate of the tokens a full round (all ``k`` drafts verified) commits is
    ``weighted_tokens / weight``, an exponentially weighted mean (decay :data:`DECAY` per
    observed round) started at ``k + 1`` with weight 1. An observation of the request's round
    ``r`` counts only for calls that start at round ``r + rounds + 1`` or later
    (:meth:`AdaptivePolicy.plan`): with overlap scheduling the call before is still in flight
    when the next is dispatched, and without it the result is held back as long, so that the
    choices, and with them a seeded sampled output, do not depend on the schedule.
    ``dispatched``: rounds dispatched so far; ``drafting``: whether the request's last call
    drafted; the probe state: plain rounds since the last probe, the current gap, the probe
    rounds still to run."""

    weighted_tokens: float
    weight: float = 1.0
    dispatched: int = 0
    drafting: bool = True
    plain_rounds: int = 0
    probe_interval: int = PROBE_FIRST
    probe_left: int = 0
    pending: list = dataclasses.field(default_factory=list)  # (round index, tokens), in order

    @classmethod
    def fresh(cls, k: int) -> "RequestAcceptance":
        """The optimistic start: every draft accepted (prefill drafts, so the first call's
        drafts are fresh)."""
        return cls(float(k + 1))

    @property
    def tokens_per_round(self) -> float:
        return self.weighted_tokens / self.weight

    def observe(self, round_index: int, tokens: int) -> None:
        """The request's round ``round_index`` verified all its drafts and committed
        ``tokens`` (accepted drafts + 1); it counts from the call :meth:`settle` allows."""
        self.pending.append((round_index, tokens))

    def advance(self, rounds: int) -> None:
        """Count a call of ``rounds`` rounds as dispatched and fold in the observations that
        count for it (those of rounds before the call in flight)."""
        start = self.dispatched
        self.dispatched += rounds
        self.settle(start - rounds)

    def settle(self, before: int) -> None:
        """Fold the observations of rounds ``< before`` into the estimate."""
        while self.pending and self.pending[0][0] < before:
            tokens = self.pending.pop(0)[1]
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
class GreedyShare:
    """What an engine's greedy requests share (the module docstring, "Greedy requests share"):
    the decayed mean of the tokens their full rounds committed (``weighted_tokens / weight``;
    weight 0 before the first), and the probe window's clock: plain rounds since the last
    call that drafted, the current gap, and the open window's rounds still to run."""

    weighted_tokens: float = 0.0
    weight: float = 0.0
    plain_rounds: int = 0
    interval: int = PROBE_FIRST
    window_left: int = 0

    def observe(self, tokens: int) -> None:
        """A greedy request's round verified all its drafts and committed ``tokens``."""
        self.weighted_tokens = DECAY * self.weighted_tokens + tokens
        self.weight = DECAY * self.weight + 1.0

    def due(self, rounds: int) -> bool:
        """Whether a call of ``rounds`` rounds that no request's own rule drafts in probes."""
        return self.window_left > 0 or self.plain_rounds + rounds >= self.interval

    def after_call(self, rounds: int, drafted: bool, window: bool) -> None:
        """Count a call: a probe ``window`` (opening one doubles the gap, up to
        :data:`PROBE_MAX`), else one that ``drafted`` anyway (the gap's count restarts), else
        a plain one."""
        if window and self.window_left > 0:
            self.window_left = max(0, self.window_left - rounds)
        elif window:
            self.plain_rounds = 0
            self.interval = min(2 * self.interval, PROBE_MAX)
            self.window_left = max(0, PROBE_ROUNDS - rounds)
        elif drafted:
            self.plain_rounds = 0
        else:
            self.plain_rounds += rounds


@dataclasses.dataclass
class AdaptivePolicy:
    """Chooses, per request and call, whether the request drafts (see the module docstring).

    ``k``: the engine's k (``speculative_num_steps``, the most a round drafts); ``cost``: the
    round's time in decode steps that drafting must beat (:func:`round_cost` at batch 1, or a
    fixed ratio; one figure for every batch, so that a sampled request's choices do not depend
    on the others); ``enabled``: False drafts in every call; ``greedy``: the greedy requests'
    shared state (:class:`GreedyShare`)."""

    k: int
    cost: float
    enabled: bool = True
    greedy: GreedyShare = dataclasses.field(default_factory=GreedyShare)

    @property
    def never_drafts(self) -> bool:
        """Whether no call drafts: adaptation is on and a round costs at least the ``k + 1``
        tokens it commits at most, so no estimate can beat ``cost`` and a probe could not
        change that."""
        return self.enabled and self.k > 0 and self.cost >= self.k + 1

    def fresh(self, greedy: bool) -> RequestAcceptance:
        """A new request's state: a sampled one starts optimistic (:meth:`RequestAcceptance.
        fresh`); a greedy one from the engine's greedy estimate when there is one, and it
        resets the greedy probe gap to :data:`PROBE_FIRST`."""
        share = self.greedy
        if not greedy or share.weight == 0:
            return RequestAcceptance.fresh(self.k)
        share.interval = PROBE_FIRST
        return RequestAcceptance(share.weighted_tokens / share.weight)

    def drafts_first(self, st: RequestAcceptance) -> bool:
        """Whether a request of fresh state ``st`` drafts in its first call by its own rule,
        so that its prefill drafts ``d_1..d_k`` for it: its estimate beats ``cost`` (always
        for a sampled request, which starts optimistic, so its draws depend on its own
        history only). Not when no call drafts (:attr:`never_drafts`), nor for a greedy
        request starting from an estimate of the engine's greedy rounds that does not pay:
        it drafts only in a probe window or beside a drafting request, and then its first
        round verifies none, as after any plain call. True when adaptation is off."""
        if not self.enabled or self.k == 0:
            return True
        return not self.never_drafts and st.tokens_per_round > self.cost

    def plan_call(self, states: list[RequestAcceptance], greedy: list[bool], rounds: int
                  ) -> list[tuple[int, int]]:
        """The drafts each request of the next call verifies, ``(in its first round, in the
        others)`` per request, each ``k`` or 0: sampled requests by :meth:`plan`; greedy ones
        all draft when the call drafts (some request's own rule, or the greedy probe window),
        none otherwise, and none in the first round after a call they did not draft in.
        Advances every state and the greedy clock past the call."""
        if not self.enabled or self.k == 0 or self.never_drafts:
            return [self.plan(st, rounds) for st in states]
        caps: list = [None] * len(states)
        own = False  # some request's own rule drafts
        for i, (st, g) in enumerate(zip(states, greedy)):
            if not g:
                caps[i] = self.plan(st, rounds)
                own = own or caps[i][1] > 0
                continue
            st.advance(rounds)
            if st.tokens_per_round > self.cost:
                own = True
                self.greedy.interval = PROBE_FIRST
        window = any(greedy) and not own and self.greedy.due(rounds)
        self.greedy.after_call(rounds, own, window)
        for i, (st, g) in enumerate(zip(states, greedy)):
            if g:
                caps[i] = self._caps(st, own or window)
        return caps

    def plan(self, st: RequestAcceptance, rounds: int) -> tuple[int, int]:
        """The drafts ``st``'s request verifies in the next call of ``rounds`` rounds: ``(in
        its first round, in the others)``, each ``k`` or 0. A request that drafts verifies
        ``k`` drafts per round, but none in the first round after a call it did not draft in
        (its drafts are stale). Advances ``st`` past the call."""
        if not self.enabled or self.k == 0:
            st.dispatched += rounds
            return self.k, self.k
        st.advance(rounds)
        return self._caps(st, not self.never_drafts and self._drafts(st, rounds))

    def _caps(self, st: RequestAcceptance, draft: bool) -> tuple[int, int]:
        """``(first, later)`` caps of a call that ``draft``s or not (none in the first round
        after a call without drafts: they are stale); records whether it drafted."""
        first = self.k if draft and st.drafting else 0
        st.drafting = draft
        return first, self.k if draft else 0

    def _drafts(self, st: RequestAcceptance, rounds: int) -> bool:
        if st.probe_left > 0:
            st.probe_left = max(0, st.probe_left - rounds)
            return True
        if st.tokens_per_round > self.cost:
            st.probe_interval, st.plain_rounds = PROBE_FIRST, 0
            return True
        st.plain_rounds += rounds
        if st.plain_rounds < st.probe_interval:
            return False
        st.plain_rounds = 0
        st.probe_interval = min(2 * st.probe_interval, PROBE_MAX)
        st.probe_left = max(0, PROBE_ROUNDS - rounds)
        return True


def policy_for(cfg: ModelConfig, speculative: SpeculativeConfig, itemsize: int,
               draft_vocab_size: int | None = None) -> AdaptivePolicy | None:
    """The engine's policy for ``speculative`` (None with speculation off or adaptation off):
    its ``adaptive_round_cost`` when set, else the byte ratio of :func:`round_cost` at batch
    1 (with the draft options; for a host proposer, only the verify's bytes: its drafts cost
    no device time). ``itemsize``: bytes per model-dtype weight."""
    if not speculative.enabled or not speculative.adaptive:
        return None
    k, fixed = speculative.k, speculative.adaptive_round_cost
    if fixed is not None:
        return AdaptivePolicy(k, float(fixed))
    return AdaptivePolicy(k, round_cost(cfg, k, 1, itemsize, draft_vocab_size,
                                        speculative.draft_head_dtype,
                                        speculative.draft_layer_dtype,
                                        host_drafts=speculative.algorithm != "mtp"))
