"""Static sampling variants: programs whose host already knows whether some row samples and
whether some row filters (top-k / top-p) trace no run-time test of either.

On a GPU each ``lax.cond`` reads its predicate back to the host, which then waits for the device
(docs/benchmarks.md, session 21: about 0.15 ms of a sampled 2B round for three of them). These
tests check that the static variants hold no conditional beyond the keep set's sort fallback,
that their results are the float64 reference's (filters) and the run-time variant's draws, and
that the engine picks the variant from its requests.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.sampling import keep_set
from mtp_jax.engine.variants import sampling_choice
from mtp_jax.sampling import SamplingParams, SamplingTensors, filtered_probs, sample
from mtp_jax.speculative.accept import accept
from tests.sampling.test_sampling import assert_matches_reference


def _conditionals(fn, *args) -> int:
    """How many conditionals (``lax.cond``) the lowered program of ``fn(*args)`` holds."""
    text = jax.jit(fn).lower(*args).as_text()
    return text.count("stablehlo.case") + text.count("stablehlo.if")


def _params(rows):
    return SamplingTensors.from_params(rows, host=True)


def test_filters_any_follows_top_k_and_top_p_of_sampled_rows():
    v = 100
    assert not _params([(0.0, 5, 0.5, 0)]).filters_any(v)  # greedy rows never filter
    assert not _params([(0.7, -1, 1.0, 0), (0.0, 5, 0.9, 1)]).filters_any(v)
    assert not _params([(0.7, 100, 1.0, 0), (1.0, 500, 1.0, 1)]).filters_any(v)  # top_k >= V
    assert _params([(0.7, -1, 1.0, 0), (0.7, 99, 1.0, 1)]).filters_any(v)
    assert _params([(0.7, -1, 0.95, 0)]).filters_any(v)
    assert not SamplingTensors.greedy(4).filters_any(v)  # padding rows


@pytest.mark.parametrize("filtering", [False, True])
def test_static_filter_variant_matches_the_reference(filtering):
    # Above MIN_VOCAB (the candidates path), rows that filter and rows that do not.
    rng = np.random.default_rng(11)
    v = keep_set.MIN_VOCAB + 256
    x = (rng.normal(size=(4, v)) * 3).astype(np.float32)
    t = np.array([0.7, 1.0, 0.0, 1.3], np.float32)
    if filtering:
        k, p = np.array([-1, 40, 5, -1], np.int32), np.array([0.9, 1.0, 0.5, 1.0], np.float32)
    else:
        k, p = np.array([-1, 0, 5, v + 3], np.int32), np.array([1.0, 1.0, 0.5, 1.0], np.float32)
    assert _params(list(zip(t, k.tolist(), p, [0] * 4))).filters_any(v) == filtering
    fn = lambda x, t, k, p: filtered_probs(x, t, k, p, filtering=filtering)
    got = np.asarray(jax.jit(fn)(x, t, k, p))
    for i in range(len(x)):
        assert_matches_reference(got[i], x[i], float(t[i]), int(k[i]), float(p[i]), f"row {i}")
    # No test of any(filtered); with the filter, only the sort fallback for undecided rows.
    assert _conditionals(fn, x, t, k, p) == (1 if filtering else 0)
    assert _conditionals(lambda x, t, k, p: filtered_probs(x, t, k, p), x, t, k, p) == 2


@pytest.mark.parametrize("filtering", [False, True])
def test_static_sample_draws_as_the_run_time_variant(filtering):
    rng = np.random.default_rng(12)
    b, v = 6, 64
    logits = jnp.asarray(rng.normal(size=(b, v)).astype(np.float32) * 2)
    rows = [(0.8, 8 if filtering and i % 2 else -1, 0.9 if filtering and i == 0 else 1.0, 7 + i)
            for i in range(b - 1)] + [(0.0, -1, 1.0, 0)]
    params = SamplingTensors.from_params(rows)
    step = jnp.arange(b, dtype=jnp.int32)
    static = jax.jit(lambda l, s: sample(l, params, s, filtering=filtering))
    dynamic = jax.jit(lambda l, s: sample(l, params, s))
    for n in range(5):  # the same keys and distribution: the same draws
        np.testing.assert_array_equal(static(logits, step + n), dynamic(logits, step + n))
    assert int(static(logits, step)[-1]) == int(jnp.argmax(logits[-1]))  # the greedy row
    # Below MIN_VOCAB the filter is the sort: no conditional at all.
    assert _conditionals(lambda l, s: sample(l, params, s, filtering=filtering), logits, step) == 0
    assert _conditionals(lambda l, s: sample(l, params, s), logits, step) == 2


def test_static_accept_equals_the_run_time_variant():
    rng = np.random.default_rng(13)
    b, k, v = 5, 3, 48
    target = jnp.asarray(rng.normal(size=(b, k + 1, v)).astype(np.float32) * 2)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)).astype(np.float32)), -1)
    drafts = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
    params = SamplingTensors.from_params(
        [(0.9, 10, 0.95, 3), (1.0, -1, 1.0, 4), (0.0, -1, 1.0, 0), (0.6, -1, 0.8, 5),
         (1.2, 4, 1.0, 6)])
    step = jnp.arange(b, dtype=jnp.int32) * 3
    static = jax.jit(lambda t, d, q, s: accept(t, d, q, params, s, filtering=True))
    dynamic = jax.jit(lambda t, d, q, s: accept(t, d, q, params, s))
    for n in range(4):
        for a, c in zip(static(target, drafts, q, step + n), dynamic(target, drafts, q, step + n)):
            np.testing.assert_array_equal(a, c)
    assert _conditionals(lambda t, d, q, s: accept(t, d, q, params, s, filtering=True),
                         target, drafts, q, step) == 0
    assert _conditionals(lambda t, d, q, s: accept(t, d, q, params, s),
                         target, drafts, q, step) == 2


class _Req:
    def __init__(self, temperature, top_k=-1, top_p=1.0, min_p=0.0, presence=0.0):
        self.params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                     min_p=min_p, presence_penalty=presence)


def test_engine_sampling_variant_from_its_requests():
    v = 1000
    def variant(reqs):
        tensors = SamplingTensors.from_params(
            [(r.params.temperature, r.params.top_k, r.params.top_p, 0, r.params.min_p,
              r.params.presence_penalty) for r in reqs], pad_to=8, host=True)
        return sampling_choice([r.params.greedy for r in reqs], tensors, v)
    off = {"penalties": False}
    assert variant([_Req(0.0, 5, 0.5), _Req(0.0)]) == {"greedy_only": True, "filtering": None,
                                                       **off}
    assert variant([_Req(0.0, 5, 0.5), _Req(0.7)]) == {"greedy_only": False, "filtering": False,
                                                       **off}
    assert variant([_Req(0.7, 1000)]) == {"greedy_only": False, "filtering": False, **off}
    assert variant([_Req(0.7), _Req(0.6, 20, 0.95)]) == {"greedy_only": False,
                                                         "filtering": True, **off}
    assert variant([_Req(0.7, min_p=0.1)]) == {"greedy_only": False, "filtering": True, **off}
    assert variant([_Req(0.0), _Req(0.0, presence=-0.5)]) == {"greedy_only": True,
                                                              "filtering": None,
                                                              "penalties": True}
