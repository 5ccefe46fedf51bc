"""The speculative contract on qwen4_exp (float32, CPU): greedy speculative decoding through the
batched engine reproduces plain greedy decoding token for token, and after every round each
slot state (GDN recurrent and conv, QSA open index groups, PLE conv windows) equals the state
plain decoding leaves at that position.

Drafts come from an external proposer that knows the plain continuation and is right for j
drafts then wrong (every j in 0..k, k = 1, 3, 5), and from the checkpoint's MTP layer. Prompts
of mixed lengths end inside a QSA index block and on a block edge (compress ratio 2); one run
prefills in chunks of 4 tokens with the prefix cache on and the memory PLE backend, and hits
the cache. Plain decoding itself is checked against the cache-free research forward.
"""

import jax
import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.models.loader import load_model
from tests.helpers.engine_runs import greedy_requests
from tests.helpers.paths import fixture_path

CKPT = fixture_path("tiny_qwen4_exp")
PROMPT_LENS = (3, 8, 13)  # the pending token inside a block (3, 13) and on a block edge (8)
MAX_TOKENS = 9


def _prompts(vocab):
    rng = np.random.default_rng(11)
    return [rng.integers(2, vocab, n).tolist() for n in PROMPT_LENS]


def _engine(model, spec, proposer=None, **cfg):
    settings = dict(max_running_requests=4, dtype="float32", overlap_schedule=False,
                    page_size=4, max_model_len=64, enable_prefix_cache=False,
                    num_scheduler_steps=1)
    settings.update(cfg)
    return Engine(model, EngineConfig(**settings), spec, proposer=proposer)


def _run_recording(engine, requests):
    """Run; record {request_id: {position: slot-state leaves}} after every round."""
    states = {r.request_id: {} for r in requests}

    def on_round(reqs):
        for r in reqs:
            if not r.finished and r.slot:
                leaves = [np.asarray(a[r.slot])
                          for a in jax.tree_util.tree_leaves(engine.pools.gdn)]
                states[r.request_id][r.position] = leaves

    engine.run(requests, on_round=on_round)
    return states


def _assert_states_match(states, ref_states, tag, ref_tag):
    assert states[tag], f"{tag}: no round was observed"
    for pos, leaves in states[tag].items():
        for i, (a, b) in enumerate(zip(leaves, ref_states[ref_tag][pos])):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0,
                                       err_msg=f"{tag} slot-state leaf {i} @ {pos}")


@pytest.fixture(scope="module")
def model():
    return load_model(CKPT, "float32", with_mtp=True)


@pytest.fixture(scope="module")
def reference(model):
    prompts = _prompts(model.cfg.vocab_size)
    eng = _engine(model, SpeculativeConfig(algorithm="none"))
    reqs = greedy_requests(prompts, [f"p{i}" for i in range(len(prompts))], MAX_TOKENS + 6)
    states = _run_recording(eng, reqs)
    return prompts, [r.output_ids for r in reqs], states


def test_plain_decoding_equals_the_forward(model, reference):
    prompts, ref_out, _ = reference
    for p, out in zip(prompts, ref_out):
        logits, _ = model.forward(np.asarray([p + out]))
        greedy = np.asarray(logits)[0].argmax(-1)[len(p) - 1:-1]
        assert greedy.tolist() == out


@pytest.mark.parametrize("k", [1, 3, 5])
def test_external_drafts_reproduce_plain_decoding(model, reference, k):
    prompts, ref_out, ref_states = reference
    vocab = model.cfg.vocab_size
    tags, req_prompts, right = [], [], {}
    for pi, p in enumerate(prompts):
        for j in range(k + 1):  # j = number of right drafts per round
            tags.append(f"p{pi}-j{j}")
            req_prompts.append(p)
            right[tags[-1]] = (pi, j)

    def proposer(request_id, ids, kk):
        pi, j = right[request_id]
        done = len(ids) - len(prompts[pi])
        truth = ref_out[pi][done:done + kk]
        return [t if i < j else (t + 1) % vocab for i, t in enumerate(truth)]

    eng = _engine(model, SpeculativeConfig(algorithm="external", num_steps=k), proposer,
                  max_running_requests=8)
    reqs = greedy_requests(req_prompts, tags, MAX_TOKENS)
    states = _run_recording(eng, reqs)
    for r in reqs:
        pi, j = right[r.request_id]
        assert r.output_ids == ref_out[pi][:MAX_TOKENS], r.request_id
        # Every round but the last commits exactly min(j, k) drafts plus the target's token.
        full = r.num_rounds - 1
        assert min(j, k) * full <= r.num_accepted_tokens <= min(j, k) * r.num_rounds, r.request_id
        _assert_states_match(states, ref_states, r.request_id, f"p{pi}")


def test_mtp_reproduces_plain_decoding(model, reference):
    prompts, ref_out, ref_states = reference
    eng = _engine(model, SpeculativeConfig(algorithm="mtp", num_steps=3))
    reqs = greedy_requests(prompts, [f"p{i}" for i in range(len(prompts))], MAX_TOKENS)
    states = _run_recording(eng, reqs)
    for i, r in enumerate(reqs):
        assert r.output_ids == ref_out[i][:MAX_TOKENS]
        assert r.num_draft_tokens > 0
        _assert_states_match(states, ref_states, r.request_id, r.request_id)


def test_chunked_prefill_prefix_hits_and_memory_backend(reference):
    """Chunks of 4 tokens, the prefix cache on (snapshots every 8 tokens) and the memory PLE
    backend; a second request sharing an 18-token prefix reuses its first 16 (the snapshot at 16,
    whose last page is keyed with the shared token after it) and still decodes exactly as plain
    decoding does (external drafts, all right)."""
    model = load_model(CKPT, "float32", with_mtp=False, ple_backend="memory")
    prompts, ref_out, _ = reference
    rng = np.random.default_rng(5)
    shared = rng.integers(2, model.cfg.vocab_size, 18).tolist()
    pair = [shared + [7, 9, 11], shared + [5, 3]]
    plain = _engine(model, SpeculativeConfig(algorithm="none"), chunked_prefill_size=4)
    want = greedy_requests(pair, ["a", "b"], MAX_TOKENS)
    plain.run(want)

    def proposer(request_id, ids, kk):
        i = "ab".index(request_id)
        done = len(ids) - len(pair[i])
        return (want[i].output_ids + [0] * kk)[done:done + kk]

    eng = _engine(model, SpeculativeConfig(algorithm="external", num_steps=3), proposer,
                  chunked_prefill_size=4, enable_prefix_cache=True, snapshot_interval_pages=2)
    first = greedy_requests(pair[:1], ["a"], MAX_TOKENS)
    eng.run(first)
    second = greedy_requests(pair[1:], ["b"], MAX_TOKENS)
    eng.run(second)
    assert first[0].output_ids == want[0].output_ids
    assert second[0].output_ids == want[1].output_ids
    assert second[0].cached_tokens == 16
    assert second[0].num_accepted_tokens > 0
