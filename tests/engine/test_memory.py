"""The memory planner: planned bytes equal allocated bytes; refusals name the numbers."""


import pytest

from mtp_jax.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.memory import plan_memory, weights_bytes
from mtp_jax.models.loader import load_model
from tests.helpers.paths import fixture_path


@pytest.fixture(scope="module")
def model():
    return load_model(fixture_path("tiny_moe_fused"), "float32", with_mtp=True)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_planned_bytes_equal_allocated(model, k):
    algo = "mtp" if k else "none"
    eng = Engine(model, EngineConfig(max_running_requests=3, dtype="float32", max_model_len=100,
                                     max_total_tokens=500),
                 SpeculativeConfig(algorithm=algo, num_steps=k or 3))
    assert eng.pools.nbytes == eng.plan.pool_bytes
    assert eng.plan.num_pages == 1 + 500 // 16 + (500 % 16 > 0)
    import jax
    assert eng.plan.weights_bytes == sum(a.size * a.dtype.itemsize
                                         for a in jax.tree_util.tree_leaves(model.params))


@pytest.mark.parametrize("head", [dict(draft_head_dtype="int8"), dict(token_map=40),
                                  dict(token_map=40, draft_head_dtype="int8"),
                                  dict(draft_vocab_size=50, draft_head_dtype="int8")])
def test_planned_bytes_count_the_draft_head(model, head, tmp_path):
    """With a draft head of its own (int8 rows, a token map's hot ids, both; N = 40 leaves a
    partial block of 32) the engine plans the bytes its parameters really take, and LLM's
    check before load (``planned_weights_bytes``) counts the same."""
    import jax
    import numpy as np

    from mtp_jax.engine.memory import planned_weights_bytes

    head = dict(head)
    if "token_map" in head:
        np.save(tmp_path / "map.npy", np.arange(7, 7 + head.pop("token_map")))
        head["token_map_path"] = str(tmp_path / "map.npy")
    spec = SpeculativeConfig(algorithm="mtp", num_steps=2, **head)
    eng = Engine(model, EngineConfig(max_running_requests=2, dtype="float32", max_model_len=64,
                                     max_total_tokens=200), spec)
    held = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(eng.model.params))
    assert eng.plan.weights_bytes == held
    assert planned_weights_bytes(model.cfg, "float32", True, spec) == held
    assert held > planned_weights_bytes(model.cfg, "float32", True, None)


def test_budget_from_device_memory_and_refusal():
    cfg = ModelConfig.from_folder(fixture_path("tiny_moe_fused"))
    w = weights_bytes(cfg, "bfloat16", True)
    plan = plan_memory(cfg, dtype="bfloat16", page_size=16, max_running_requests=4,
                       max_model_len=1000, k=3, mtp=True, weights_bytes=w,
                       device_bytes=10 * 2**20, mem_fraction=0.9)
    used = w + plan.pool_bytes
    assert used <= 0.9 * 10 * 2**20 < used + plan.page_bytes + 1 or plan.num_pages == 1 + 4 * 63
    with pytest.raises(ConfigError, match="max_model_len=100000.*--max-model-len"):
        plan_memory(cfg, dtype="bfloat16", page_size=16, max_running_requests=4,
                    max_model_len=100000, k=3, mtp=True, weights_bytes=w,
                    device_bytes=10 * 2**20, mem_fraction=0.9)
    with pytest.raises(ConfigError, match=r"max_model_len=50 tokens \(\+3 for the verify window "
                       r"and draft chain\) needs 4 KV pages.*max_total_tokens=40\. Raise "
                       r"--max-total-tokens to at least 64 or lower --max-model-len\.$"):
        plan_memory(cfg, dtype="float32", page_size=16, max_running_requests=1,
                    max_model_len=50, k=1, mtp=False, weights_bytes=w, max_total_tokens=40)
    with pytest.raises(ConfigError, match=r"max_model_len=60 tokens \(\+1\) needs 4 KV pages"):
        plan_memory(cfg, dtype="float32", page_size=16, max_running_requests=1,
                    max_model_len=60, k=0, mtp=False, weights_bytes=w, max_total_tokens=40)


def test_check_before_load_counts_prefix_snapshots(monkeypatch):
    """The check before any weight loads plans the prefix-cache snapshots as the engine does:
    a device budget that holds one full-length request beside the weights and slots passes
    with the cache off and is refused with it on (its snapshots do not fit too)."""
    import dataclasses

    from mtp_jax.cache.allocator import pages_needed
    from mtp_jax.engine import serving
    from mtp_jax.engine.memory import page_bytes, planned_weights_bytes, slot_bytes

    cfg = ModelConfig.from_folder(fixture_path("tiny_moe_fused"))
    spec = SpeculativeConfig(algorithm="mtp", num_steps=2)
    on = EngineConfig(max_running_requests=2, dtype="float32", max_model_len=64)
    off = dataclasses.replace(on, enable_prefix_cache=False)
    pages = 1 + pages_needed(64 + 2 * 2 + 1, 16)  # the trash page and one request's
    need = (planned_weights_bytes(cfg, "float32", True, spec)
            + 3 * slot_bytes(cfg, 2, "float32", True, False)
            + pages * page_bytes(cfg, 16, "float32", True))

    class Device:
        def memory_stats(self):
            return {"bytes_limit": int(need / on.mem_fraction) + 1}

    monkeypatch.setattr(serving.jax, "devices", lambda: [Device()])
    serving.check_memory_before_load(cfg, off, spec)
    with pytest.raises(ConfigError, match="max_model_len=64 tokens"):
        serving.check_memory_before_load(cfg, on, spec)


def test_resize_cache_keeps_generation_working(model):
    from mtp_jax.engine.requests import Request, SamplingParams

    # One slot to start: the reference run is one row at a time (prefill and the batch-1
    # round only); the slot resize then gives three requests a slot each at once.
    eng = Engine(model, EngineConfig(max_running_requests=1, dtype="float32", max_model_len=64),
                 SpeculativeConfig(algorithm="mtp", num_steps=2))

    def run():
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        reqs = [Request(request_id=str(i), index=i, prompt=None, prompt_ids=[5 + i, 7, 9, 11],
                        params=params, seed=0) for i in range(3)]
        eng.run(reqs)
        return [r.output_ids for r in reqs]

    ref = run()
    kv_before = eng.pools.kv
    assert eng.pools.gdn.recurrent[0].shape[0] == 2
    eng.resize_cache(max_running_requests=3)  # slot pool only: KV and draft KV kept
    assert eng.pools.kv is kv_before and eng.pools.gdn.recurrent[0].shape[0] == 4
    assert run() == ref
    eng.resize_cache(num_pages=30)  # KV pool: rebuilt with the draft KV
    assert eng.pools.kv.k[0].shape[0] == 30 and eng.pools.draft_kv.k[0].shape[0] == 30
    assert run() == ref
    with pytest.raises(ConfigError, match="cannot hold one request"):
        eng.resize_cache(num_pages=3)
