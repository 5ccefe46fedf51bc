"""Small parameters packed into one buffer per dtype (``load_model(pack_small_params=True)``,
:mod:`mtp_jax.engine.param_packing`): the layout round-trips every leaf exactly, leaves read by
the fused GDN kernels stay separate, and the engine with packed arguments generates what it
generates without them (greedy, speculative rounds on)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.param_packing import ParamPacking
from mtp_jax.engine.requests import Request, SamplingParams
from mtp_jax.engine.programs import programs_for
from mtp_jax.models.loader import load_model
from tests.helpers.paths import fixture_path


def test_plan_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    tree = {
        "layers": [{"norm": {"weight": jnp.asarray(rng.standard_normal(8), jnp.bfloat16)},
                    "linear_attn": {"A_log": jnp.asarray(rng.standard_normal(4), jnp.float32),
                                    "conv1d": {"weight": jnp.asarray(rng.standard_normal(
                                        (6, 1, 4)), jnp.bfloat16)}},
                    "big": jnp.asarray(rng.standard_normal((40, 50)), jnp.bfloat16)}
                   for _ in range(2)],
        "scale": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
    }
    leaves = jax.tree_util.tree_leaves(tree)
    plan = ParamPacking.plan(tree, max_elements=1000)
    assert plan.n_leaves == len(leaves)
    assert sorted(plan.dtypes) == ["bfloat16", "float32"]
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    kept = {names[i] for i in plan.kept}
    assert all("A_log" in n or "conv1d" in n or "big" in n for n in kept)  # not packed
    assert len(kept) == 6
    args = plan.pack(leaves)
    assert len(args) == plan.buffers + len(plan.kept)
    for got, want in zip(jax.jit(plan.unpack)(args), leaves):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="3 leaves, the plan has"):
        plan.pack(leaves[:3])


def _requests(prompts):
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    return [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=list(p), params=sp,
                    seed=i) for i, p in enumerate(prompts)]


def test_engine_with_packed_small_params_generates_the_same_tokens():
    ckpt = fixture_path("tiny_moe_fused")
    plain = load_model(ckpt, "float32")
    packed = dataclasses.replace(plain, pack_small_params=True)
    leaves = jax.tree_util.tree_leaves(plain.params)
    small = sum(1 for x in leaves if x.size <= 1 << 16)
    packed_leaves = programs_for(packed).leaves
    assert len(packed_leaves) < len(leaves) - small // 2  # most small leaves packed
    rng = np.random.default_rng(5)
    prompts = [rng.integers(2, 300, n).tolist() for n in (4, 13)]
    cfg = EngineConfig(max_running_requests=2, dtype="float32", max_model_len=64,
                       enable_prefix_cache=False)
    spec = SpeculativeConfig(algorithm="mtp", num_steps=2)
    want = [r.output_ids for r in Engine(plain, cfg, spec).run(_requests(prompts))]
    got = [r.output_ids for r in Engine(packed, cfg, spec).run(_requests(prompts))]
    assert got == want and all(len(w) == 9 for w in want)


def test_qwen4_exp_with_packed_small_params_matches_transformers():
    """qwen4_exp loaded with ``pack_small_params``: its programs take the packed buffers
    (fewer arguments than parameters) and MTP rounds give transformers' greedy tokens (the
    golden fixture)."""
    ckpt = fixture_path("tiny_qwen4_exp")
    g = np.load(ckpt + "/golden.npz")
    model = load_model(ckpt, "float32", with_mtp=True, pack_small_params=True)
    eng = Engine(model, EngineConfig(max_running_requests=2, dtype="float32", max_model_len=96),
                 SpeculativeConfig(algorithm="mtp", num_steps=3))
    assert len(eng.device.leaves) < len(jax.tree_util.tree_leaves(model.params))
    n = g["greedy_tokens"].shape[1]
    reqs = [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=row.tolist(),
                    params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), seed=0)
            for i, row in enumerate(g["input_ids"])]
    eng.run(reqs)
    assert [r.output_ids for r in reqs] == g["greedy_tokens"].tolist()
