"""``python -m mtp_jax.bench prefix-hits``: the workloads' tallies. Without speculation each
follow-up reuses up to the deepest snapshot boundary of what it shares with earlier requests
(the shared count is re-derived here from the prompts); the table shows the rows."""

import pytest

from mtp_jax.bench import prefix_hits
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.models.loader import load_model
from tests.helpers.paths import fixture_path

EVERY = 8  # page 4, snapshots every 2 pages


@pytest.fixture(scope="module")
def engine():
    model = load_model(fixture_path("tiny_dense"), "float32", with_mtp=False)
    return Engine(model, EngineConfig(max_running_requests=1, dtype="float32", page_size=4,
                                      snapshot_interval_pages=2, max_model_len=128),
                  SpeculativeConfig(algorithm="none"))


def test_shared_prefix_count():
    assert prefix_hits._shared([1, 2, 3, 4], []) == 0
    assert prefix_hits._shared([1, 2, 3, 4], [[1, 2, 9], [1, 2, 3, 7]]) == 3
    assert prefix_hits._shared([1, 2, 3], [[1, 2, 3, 4]]) == 2  # one token left to prefill


def test_workloads_reuse_to_the_deepest_boundary(engine):
    vocab = engine.model.cfg.vocab_size
    chat = prefix_hits.multi_turn(engine, 3, (5, 12), 6, vocab, seed=1)
    system = prefix_hits.shared_system(engine, 3, 20, (5, 12), 6, vocab, seed=2)
    for row in (chat, system):
        first, *later = row["per_request"]
        assert first["cached"] == first["shared"] == 0
        for r in later:
            assert r["shared"] > EVERY and r["cached"] == r["shared"] // EVERY * EVERY
        assert row["cached_tokens"] == sum(r["cached"] for r in row["per_request"])
        assert row["hit_rate"] == row["cached_tokens"] / row["prompt_tokens"]
    assert all(r["shared"] >= 20 for r in system["per_request"][1:])  # the system prompt
    table = prefix_hits.hit_table([{"workload": "w", "speculation": "off", **chat}])
    assert f"| w | off | {chat['prompt_tokens']} | {chat['shared_tokens']} |" in table


def _engine(model, snapshots):
    return Engine(model, EngineConfig(max_running_requests=1, dtype="float32", page_size=4,
                                      snapshot_interval_pages=2, max_model_len=128,
                                      max_prefix_snapshots=snapshots),
                  SpeculativeConfig(algorithm="none"))


def test_few_snapshot_ids_keep_the_deepest_boundaries(engine):
    """Few snapshot ids, many boundaries. A conversation (two ids): a turn out of ids gives up
    the shallowest snapshot of its own chain for each deeper boundary, so every follow-up
    resumes at the deepest boundary it shares (keeping the first ids instead, reuse stopped at
    the second boundary, 16 tokens). A shared 44-token system prompt (four ids): the first
    request, alone in the tree, gives up its shallowest snapshot for the one boundary it
    decodes past (one id for it: the call after the one in flight does not carry it too), so
    40 stays and every later request resumes at the system prompt's deepest boundary, 40;
    once the second's prompt branches off the first's, the snapshots at or above the branch
    are kept. (When both calls carried the boundary, it cost two ids and 40 with them: the
    second request missed.)"""
    vocab = engine.model.cfg.vocab_size
    chat = prefix_hits.multi_turn(_engine(engine.model, 2), 3, (20, 30), 6, vocab, seed=4)
    for r in chat["per_request"][1:]:
        assert r["shared"] > 3 * EVERY and r["cached"] == r["shared"] // EVERY * EVERY
    system = prefix_hits.shared_system(_engine(engine.model, 4), 4, 44, (10, 18), 12, vocab,
                                       seed=4)
    assert [r["cached"] for r in system["per_request"]] == [0, 40, 40, 40]
