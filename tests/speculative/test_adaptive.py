"""Adaptive speculation (mtp_jax.speculative.adaptive): the policy's arithmetic, and engines
whose external proposer is right with probability 0, 0.5 and 1. The output always equals plain
greedy decoding; the rounds' draft counts follow the acceptance: every round drafts when the
drafts are right, rounds turn plain (with probes) when they are never right, and at 0.5 the
choice follows the round cost the drafts must beat; a round that cannot pay is never drafted."""

import numpy as np
import pytest

from mtp_jax.bench.compiles import CompileWatch
from mtp_jax.config import ConfigError, EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.engine.warmup import round_variants
from mtp_jax.models.loader import load_model
from mtp_jax.speculative.adaptive import (DECAY, PROBE_FIRST, PROBE_MAX, PROBE_ROUNDS,
                                          AdaptivePolicy, RequestAcceptance, round_cost)
from mtp_jax.train.synthetic import motif_prompts
from tests.helpers.engine_runs import greedy_requests, run_per_round
from tests.helpers.paths import fixture_path

K = 3
MAX_NEW = 100


# ---- the policy alone ---------------------------------------------------------------------

def test_acceptance_estimate_is_the_decayed_mean_of_settled_rounds():
    est = RequestAcceptance.fresh(K)
    seen = [1, 4, 2, 1, 1]
    for i, t in enumerate(seen):
        est.observe(i, t)
    est.settle(3)  # rounds 0..2 count, 3 and 4 wait
    values = [K + 1] + seen[:3]
    w = [DECAY ** (len(values) - 1 - i) for i in range(len(values))]
    assert est.tokens_per_round == pytest.approx(np.dot(w, values) / sum(w))
    assert [i for i, _ in est.pending] == [3, 4]


def _states(pol, tokens, calls, rounds):
    """The (first, later) caps of ``calls`` calls of a request whose every observed round
    commits ``tokens``."""
    st, out = RequestAcceptance.fresh(K), []
    for _ in range(calls):
        first, later = pol.plan(st, rounds)
        out.append((first, later))
        for j in range(rounds):
            if (first if j == 0 else later) == K:
                st.observe(st.dispatched - rounds + j, tokens)
    return out


def test_policy_drafts_while_it_pays_and_probes_with_doubling_gaps():
    pol = AdaptivePolicy(K, 2.0)
    assert set(_states(pol, 3, 50, 1)) == {(K, K)}  # 3 tokens a round beat 2 steps
    caps = _states(pol, 1, PROBE_FIRST + 2 * PROBE_FIRST + 4 * PROBE_FIRST + 2 * PROBE_MAX
                   + 40, 1)
    drafts = "".join("d" if later else "." for _, later in caps)
    start = drafts.index(".")
    assert 1 <= start <= 8  # the optimistic start, then the rounds show 1 token each
    runs = drafts[start:].split("d" * PROBE_ROUNDS)
    # plain rounds between probes of PROBE_ROUNDS rounds: the gap doubles (the probe's first
    # round is the gap's last count) up to PROBE_MAX
    assert [len(r) for r in runs[:5]] == [PROBE_FIRST - 1, 2 * PROBE_FIRST - 1,
                                          4 * PROBE_FIRST - 1, PROBE_MAX - 1,
                                          PROBE_MAX - 1], runs
    # a probe's first round verifies no draft (stale), its second verifies k
    i = start + PROBE_FIRST - 1
    assert caps[i] == (0, K) and caps[i + 1] == (K, K)
    # several rounds per call: plain rounds counted per round, a probe is one call
    caps = _states(AdaptivePolicy(K, 2.0), 1, 60, 4)
    drafts = "".join("d" if later else "." for _, later in caps)
    assert drafts.startswith("dd.") and drafts[:40].count("d") == 3, drafts
    assert drafts.index("d", 2) == 2 + PROBE_FIRST // 4 - 1 and PROBE_MAX == 8 * PROBE_FIRST


def test_observations_count_one_call_late():
    pol = AdaptivePolicy(K, 2.0)
    st = RequestAcceptance.fresh(K)
    assert pol.plan(st, 2) == (K, K)
    st.observe(0, 1)
    st.observe(1, 1)
    assert pol.plan(st, 2) == (K, K)  # the first call's rounds are not counted yet
    assert pol.plan(st, 2) == (0, 0)  # now they are: 4 * 0.64 + 1.8 over 2.44 < 2
    assert AdaptivePolicy(K, 2.0, enabled=False).plan(RequestAcceptance(1.0), 1) == (K, K)


def test_a_round_that_cannot_pay_is_never_drafted_nor_probed():
    """A round costing the k + 1 tokens it commits at most, or more, never drafts: not at the
    optimistic start, not in a probe, sampled or greedy. Just under k + 1 the same calls
    draft at the start and in probes (the test's teeth)."""
    for cost, never in ((K + 1.0, True), (K + 2.5, True), (K + 0.99, False)):
        pol = AdaptivePolicy(K, cost)
        assert pol.never_drafts == never
        sampled = _states(pol, K + 1, PROBE_FIRST + 2 * PROBE_FIRST + 8, 1)
        greedy = [pol.plan_call([RequestAcceptance.fresh(K), RequestAcceptance(1.0)],
                                [True, True], 1) for _ in range(PROBE_FIRST + 8)]
        drafted = {c for c in sampled if c[1]} | {c for call in greedy for c in call if c[1]}
        assert (not drafted) == never, (cost, drafted)
    assert not AdaptivePolicy(K, K + 1.0, enabled=False).never_drafts


def test_a_prefill_drafts_for_requests_that_draft_in_their_first_call():
    """``drafts_first``: sampled requests (optimistic) and greedy ones with no engine estimate
    or one that pays, yes; greedy ones starting below the cost, and every request where no
    call can draft, no; adaptation off, always."""
    pol = AdaptivePolicy(K, 2.0)
    assert pol.drafts_first(pol.fresh(False)) and pol.drafts_first(pol.fresh(True))
    for _ in range(20):
        pol.greedy.observe(1)
    assert not pol.drafts_first(pol.fresh(True))
    assert pol.drafts_first(pol.fresh(False))
    assert pol.drafts_first(RequestAcceptance(2.5)) and not pol.drafts_first(RequestAcceptance(2.0))
    never = AdaptivePolicy(K, K + 1.0)
    assert not never.drafts_first(never.fresh(False))
    off = AdaptivePolicy(K, K + 1.0, enabled=False)
    assert off.drafts_first(RequestAcceptance(1.0))


def test_round_cost_is_the_byte_ratio_of_the_released_shapes():
    from mtp_jax.bench.floor import load_config
    two = round_cost(load_config("configs/Qwen3.5-2B.json"), 3, 1, 2)
    big = round_cost(load_config("configs/Qwen3.6-27B.json"), 3, 1, 2)
    # the 2B's draft re-reads its 1 GB LM head per draft step; the 27B's head is a smaller
    # part of its bytes (the H200's measured round / step: 2B 1.98-2.2, 27B 1.30)
    assert 1.8 < two < 2.3 and 1.2 < big < 1.5, (two, big)


def test_settings_are_checked():
    for bad in ("yes", 0.5, 1000.0, True):
        kw = {"adaptive": bad} if bad == "yes" else {"adaptive_round_cost": bad}
        with pytest.raises(ConfigError, match="adaptive") as e:
            SpeculativeConfig(**kw).validate()
        # the message names only the bad setting
        assert ("round_cost" in str(e.value)) == ("adaptive_round_cost" in kw), str(e.value)


# ---- engines with external proposers ------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model(fixture_path("tiny_trained"), "float32", with_mtp=True)


@pytest.fixture(scope="module")
def prompts():
    return motif_prompts(3, seed=4)


def _engine(model, algo, proposer=None, **spec):
    return Engine(model, EngineConfig(max_running_requests=4, dtype="float32", page_size=4,
                                      max_model_len=160, enable_prefix_cache=False,
                                      chunked_prefill_size=64),
                  SpeculativeConfig(algorithm=algo, num_steps=K, **spec), proposer=proposer)


@pytest.fixture(scope="module")
def plain(model, prompts):
    reqs = greedy_requests(prompts, [f"r{i}" for i in range(len(prompts))], MAX_NEW)
    _engine(model, "none").run(reqs)
    return {r.request_id: r.prompt_ids + r.output_ids for r in reqs}


def right_with(p: float, truth: dict, vocab: int):
    """A proposer whose draft j is the plain continuation's token with probability ``p``
    (independently, seeded by request and position), else another token."""

    def proposer(request_id, ids, k):
        seq = truth[request_id]
        out = []
        for j in range(k):
            at = len(ids) + j
            right = seq[at] if at < len(seq) else 0
            rng = np.random.default_rng([int(request_id[1:]), at, j])
            out.append(right if rng.random() < p else (right + 1) % vocab)
        return out

    return proposer


def _run(model, prompts, plain, p, **spec):
    eng = _engine(model, "external", right_with(p, plain, model.cfg.vocab_size), **spec)
    reqs = greedy_requests(prompts, [f"r{i}" for i in range(len(prompts))], MAX_NEW)
    seen = run_per_round(eng, reqs)
    for r in reqs:
        assert r.prompt_ids + r.output_ids == plain[r.request_id], r.request_id
    drafted = [np.diff([0] + [d for d, _ in seen[r.request_id]]) for r in reqs]
    return eng, reqs, drafted


def test_always_right_drafts_every_round(model, prompts, plain):
    eng, reqs, drafted = _run(model, prompts, plain, 1.0)
    assert eng.stats.plain_rounds == 0
    for r, d in zip(reqs, drafted):
        assert r.num_accepted_tokens == r.num_draft_tokens and (d[:-K] == K).all()


def test_never_right_turns_plain_and_probes(model, prompts, plain):
    eng, reqs, drafted = _run(model, prompts, plain, 0.0)
    assert eng.stats.plain_rounds >= 0.7 * eng.stats.rounds
    for r, d in zip(reqs, drafted):
        assert r.num_accepted_tokens == 0
        full = np.flatnonzero(d)
        # the optimistic start drafts a few rounds, then plain rounds with probes
        start = int(np.argmin(d > 0))
        assert 1 <= start <= 10 and full[-1] >= start + PROBE_FIRST, d.tolist()
        assert len(full) <= start + 3 * PROBE_ROUNDS, d.tolist()


def test_half_right_follows_the_round_cost(model, prompts, plain):
    # k = 3 drafts each right with probability 0.5: 1.875 tokens per round expected
    cheap = _run(model, prompts, plain, 0.5, adaptive_round_cost=1.4)[0]
    dear = _run(model, prompts, plain, 0.5, adaptive_round_cost=2.6)[0]
    assert cheap.stats.plain_rounds < 0.3 * cheap.stats.rounds
    assert dear.stats.plain_rounds > 0.6 * dear.stats.rounds


def test_an_engine_whose_round_cannot_pay_decodes_plain_and_builds_no_drafting_round(
        model, prompts, plain):
    """MTP with ``adaptive_round_cost`` k + 1 (as the built-in default model's bytes give):
    plain decoding's output, no draft proposed in 100 tokens (past the first probe's
    PROBE_FIRST plain rounds), so no acceptance rate (n/a), and the warm-up's round variants are
    plain steps only. At k + 0.9 the same engine drafts (the optimistic start and probes)."""
    for cost, never in ((K + 1.0, True), (K + 0.9, False)):
        eng = Engine(model, EngineConfig(max_running_requests=4, dtype="float32", page_size=4,
                                         max_model_len=160, enable_prefix_cache=False,
                                         chunked_prefill_size=64),
                     SpeculativeConfig(algorithm="mtp", num_steps=K, adaptive_round_cost=cost))
        assert {v.k for v in round_variants(eng.scheduler)} == ({0} if never else {0, K})
        reqs = greedy_requests(prompts, [f"r{i}" for i in range(len(prompts))], MAX_NEW)
        eng.run(reqs)
        for r in reqs:
            assert r.prompt_ids + r.output_ids == plain[r.request_id], r.request_id
        assert all((r.num_draft_tokens == 0) == never for r in reqs), cost  # rate: n/a
        assert (eng.stats.plain_rounds == eng.stats.rounds) == never


def test_adaptation_off_drafts_every_round(model, prompts, plain):
    eng, reqs, drafted = _run(model, prompts, plain, 0.0, adaptive=False)
    assert eng.stats.plain_rounds == 0 and all((d[:-K] == K).all() for d in drafted)


def test_a_sampled_request_draws_the_same_alone_and_beside_one_that_drafts(model, prompts,
                                                                           plain):
    """Request r0 (sampled) is served alone, and beside r1 (greedy, drafts always right):
    r0's drafts are never right, so it stops drafting, while the calls it shares with r1
    run the drafting program (r0 verifying none). r0 draws the same tokens both times."""
    vocab = model.cfg.vocab_size
    never, always = right_with(0.0, plain, vocab), right_with(1.0, plain, vocab)

    def proposer(request_id, ids, k):
        return (never if request_id == "r0" else always)(request_id, ids, k)

    def reqs(ids):
        sampled = SamplingParams(temperature=3.0, top_k=50, max_tokens=MAX_NEW,
                                 ignore_eos=True)
        greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        return [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=list(prompts[i]),
                        params=sampled if i == 0 else greedy, seed=7) for i in ids]

    together = reqs([0, 1])
    eng = _engine(model, "external", proposer)
    eng.run(together)
    assert together[1].num_accepted_tokens == together[1].num_draft_tokens >= 60
    shared = together[1].num_rounds  # calls r0 shared with the drafting r1
    assert together[0].num_draft_tokens < K * shared  # r0 skipped drafting in some
    alone = reqs([0])
    eng = _engine(model, "external", proposer)
    eng.run(alone)
    assert eng.stats.plain_rounds > 0.7 * eng.stats.rounds
    assert together[0].output_ids == alone[0].output_ids
    assert together[0].num_draft_tokens == alone[0].num_draft_tokens  # the same choices


def test_greedy_rows_draft_together_and_probe_in_shared_windows():
    """The policy alone: greedy rows draft in every call that drafts (a paying greedy row, a
    sampled row's own rule, or the shared window) and in no other; a sampled row keeps its
    own rule."""
    pol = AdaptivePolicy(K, 2.0)
    low = lambda: RequestAcceptance(1.0)  # an estimate that does not pay
    g1, g2, s1 = low(), low(), low()
    caps = [pol.plan_call([g1, g2], [True, True], 1) for _ in range(3 * PROBE_FIRST + 8)]
    assert all(c[0] == c[1] for c in caps)  # the greedy rows together
    drafting = [i for i, c in enumerate(caps) if c[0][1]]
    # the window: PROBE_ROUNDS calls after PROBE_FIRST - 1 plain ones, then a doubled gap
    first = list(range(PROBE_FIRST - 1, PROBE_FIRST - 1 + PROBE_ROUNDS))
    second = [first[-1] + 2 * PROBE_FIRST + j for j in range(PROBE_ROUNDS)]
    assert drafting == first + second, drafting
    assert [c[0][0] for c in caps if c[0][1]] == [0, K] * 2  # stale drafts after plain calls
    # beside a sampled row, the greedy rows draft whenever its own rule does
    caps = [pol.plan_call([g1, g2, s1], [True, True, False], 1) for _ in range(PROBE_FIRST + 4)]
    own = [i for i, c in enumerate(caps) if c[2][1]]
    assert own == first and all(caps[i][0][1] == K for i in own)
    # a paying greedy row makes every greedy row draft; the sampled row keeps its own rule
    rich = RequestAcceptance(float(K + 1))
    c = pol.plan_call([g1, rich, s1], [True, True, False], 1)
    assert c[0][1] == c[1][1] == K and c[2] == (0, 0)
    # a new greedy request starts from the engine's greedy estimate once there is one
    assert pol.fresh(True).tokens_per_round == K + 1  # none yet: optimistic
    for _ in range(20):
        pol.greedy.observe(1)
    assert pol.fresh(True).tokens_per_round == pytest.approx(1.0, abs=0.1)
    assert pol.fresh(False).tokens_per_round == K + 1


def test_a_batch_of_greedy_requests_that_never_accept_drafts_in_few_calls(model):
    """8 greedy requests whose drafts are never right, then 8 more on the same engine. With
    per-request probes about a quarter of the calls drafted (each request probing at its own
    time); shared windows leave the optimistic start and one window, and the second 8 start
    from the engine's estimate, so they draft only in a window. The output is plain
    decoding's, and drafts that are always right still draft in every call."""
    n = 8
    prompts = motif_prompts(2 * n, seed=11)
    ids = [f"r{i}" for i in range(2 * n)]

    def engine(algo, proposer=None):
        return Engine(model, EngineConfig(max_running_requests=n, dtype="float32", page_size=4,
                                          max_model_len=160, enable_prefix_cache=False,
                                          chunked_prefill_size=16),
                      SpeculativeConfig(algorithm=algo, num_steps=K), proposer=proposer)

    reqs = greedy_requests(prompts, ids, MAX_NEW)
    engine("none").run(reqs)
    truth = {r.request_id: r.prompt_ids + r.output_ids for r in reqs}
    for p, most in ((0.0, (0.15, 0.05)), (1.0, None)):
        eng = engine("external", right_with(p, truth, model.cfg.vocab_size))
        for half in (0, 1):
            batch = greedy_requests(prompts[half * n:(half + 1) * n],
                                    ids[half * n:(half + 1) * n], MAX_NEW)
            rounds, plain = eng.stats.rounds, eng.stats.plain_rounds
            run_per_round(eng, batch)
            calls = eng.stats.rounds - rounds
            drafting = calls - (eng.stats.plain_rounds - plain)
            for r in batch:
                assert r.prompt_ids + r.output_ids == truth[r.request_id], r.request_id
            if most is None:
                assert drafting == calls
                assert all(r.num_accepted_tokens == r.num_draft_tokens > 0 for r in batch)
            else:
                assert drafting <= most[half] * calls, (half, drafting, calls)
                assert all(r.num_accepted_tokens == 0 for r in batch)


def test_round_cost_needs_adaptation_on():
    for kw in (dict(adaptive=False), dict(algorithm="none", num_steps=0)):
        with pytest.raises(ConfigError, match="--speculative-adaptive-round-cost"):
            SpeculativeConfig(adaptive_round_cost=1.5, **kw).validate()


def test_greedy_requests_below_the_cost_prefill_without_drafts(model, prompts, plain):
    """MTP with the trained head and a round cost its drafts do not beat: the first requests
    (no engine estimate yet) prefill with drafts, the next ones start from the engine's low
    greedy estimate and prefill without (the draft KV only), their first rounds verifying no
    draft; the output is plain decoding's, drafts are still accepted in probe windows, and the
    warm-up built both prefill variants (no compile while serving)."""
    eng = _engine(model, "mtp", adaptive_round_cost=K + 0.9)
    eng.warmup(sampled=False, max_batch=len(prompts), max_prompt_len=max(map(len, prompts)))
    variants = []
    prefill = eng.scheduler.device.prefill
    eng.scheduler.device.prefill = lambda b, v: variants.append(v) or prefill(b, v)
    with CompileWatch() as w:
        for half in ("a", "b"):
            reqs = greedy_requests(prompts, [f"r{i}" for i in range(len(prompts))], MAX_NEW)
            eng.run(reqs)
            for r in reqs:
                assert r.prompt_ids + r.output_ids == plain[r.request_id], (half, r.request_id)
            assert half == "a" or sum(r.num_accepted_tokens for r in reqs) > 0
    assert w.compiles == 0
    finals = [v.drafts for v in variants]
    assert finals[0] and not finals[-1], finals
