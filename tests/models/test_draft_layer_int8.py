"""The int8 draft layer (``speculative_draft_layer_dtype="int8"``): the quantized projections
against float64 numpy, which parameters are quantized (the draft's projections only, never
the target's or a MoE layer's routed experts), the engine's output against plain decoding,
the bytes counted for memory and the benchmark's floor, and the refusals (the settings'
own: ``test_draft_head_int8.py``, for both draft dtypes).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtp_jax.config import ConfigError, EngineConfig, ModelConfig, SpeculativeConfig
from mtp_jax.engine.engine import Engine
from mtp_jax.engine.memory import planned_weights_bytes
from mtp_jax.models.draft_head import draft_layer_bytes, with_draft_head
from mtp_jax.models.layers.basic import (Linear, MergedLinear, merge_linears,
                                          quantize_projections)
from mtp_jax.models.loader import load_model
from mtp_jax.models.layers.mlp import folds_shared_expert
from mtp_jax.models.params import param_name
from mtp_jax.weights import names
from tests.helpers.paths import fixture_path

FLAG = "speculative_draft_layer_dtype (--speculative-draft-layer-dtype)"


def _np_int8_rows(w: np.ndarray) -> np.ndarray:
    """float64 re-derivation of the stored rows: per-row absmax / 127, round half to even
    (as ``jnp.round``), clipped to +-127; returns the dequantized ``[N, K]`` float64."""
    amax = np.abs(w).max(1)
    scale = np.where(amax > 0, amax / 127, 1.0)
    return np.clip(np.round(w / scale[:, None]), -127, 127) * scale[:, None]


@pytest.mark.parametrize("rows", [(1,), (3, 4), (11,)])
def test_quantized_projections_match_float64(rows):
    """A Linear and a MergedLinear after ``quantize_projections``: int8 weights with one
    float32 scale per row, and a call equals ``x @ dequantized.T`` in float64 (not the
    unquantized product), split back per merged projection, in ``x``'s dtype."""
    rng = np.random.default_rng(0)
    w1, w2, w3 = (rng.normal(0, 0.05, (n, 48)).astype(np.float32) for n in (40, 24, 8))
    w2[3] = 0.0  # an all-zero row
    lin = Linear(48, 40, jnp.float32)
    lin.weight = nnx.Param(jnp.asarray(w1))
    merged = MergedLinear([jnp.asarray(w2), jnp.asarray(w3)])
    holder = nnx.List([lin, merged])
    x = rng.normal(0, 1, (*rows, 48)).astype(np.float32)
    before = np.asarray(lin(jnp.asarray(x)), np.float64)
    assert quantize_projections(holder) == 2
    assert quantize_projections(holder) == 0  # already quantized: skipped
    for m in (lin, merged):
        assert m.weight[...].dtype == jnp.int8 and m.scale[...].dtype == jnp.float32
        assert m.scale[...].shape == (m.weight[...].shape[0],)
    got = lin(jnp.asarray(x))
    assert got.dtype == jnp.float32 and got.shape == (*rows, 40)
    want = x.astype(np.float64) @ _np_int8_rows(w1.astype(np.float64)).T
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got) - before).max() > 1e-5  # it is not the float product
    a, b = merged(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(a), x @ _np_int8_rows(w2.astype(np.float64)).T,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(b), x @ _np_int8_rows(w3.astype(np.float64)).T,
                               rtol=1e-5, atol=1e-5)
    assert not np.asarray(a)[..., 3].any()
    bf = lin(jnp.asarray(x, jnp.bfloat16))
    assert bf.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="merge them before quantize_projections"):
        merge_linears([lin, lin])  # the scales would be dropped


def _by_name(model) -> dict:
    return {param_name(p): v[...] for p, v in nnx.to_flat_state(model.params)}


@pytest.mark.parametrize("ckpt", ["tiny_dense", "tiny_moe_fused"])
def test_only_the_draft_projections_are_quantized(ckpt):
    """``with_draft_head(model, None, None, "int8")``: every 2-D projection of ``mtp.*``
    (merged or not; ``names.mtp_projections``) is int8 with a scale; the target's parameters,
    the draft's norms and a MoE draft layer's routed experts are the same arrays as the
    model's; the model itself keeps its float draft."""
    model = load_model(fixture_path(ckpt), "float32", with_mtp=True)
    derived = with_draft_head(model, None, None, "int8")
    assert with_draft_head(model, None, None, "int8") is derived  # made once
    head_only = with_draft_head(model, None, "int8")  # the layer dtype is part of the key
    both = with_draft_head(model, None, "int8", "int8")
    assert len({id(derived), id(head_only), id(both)}) == 3
    assert head_only.module().mtp.fc.weight[...].dtype == jnp.float32
    assert both.module().mtp.fc.weight[...].dtype == jnp.int8
    old, new = _by_name(model), _by_name(derived)
    int8 = {n for n, a in new.items() if a.dtype == jnp.int8}
    assert int8 and all(n.startswith("mtp.") and n.endswith(".weight") for n in int8)
    assert {n.rsplit(".", 1)[0] + ".scale" for n in int8} == {n for n in new
                                                              if n.endswith(".scale")}
    rows = sum(new[n].shape[0] for n in int8)
    folded = folds_shared_expert(model.cfg)  # its projections are routed expert E's then
    assert folded == (ckpt == "tiny_moe_fused")
    assert rows == sum(s[0] for n, s in names.mtp_projections(model.cfg).items()
                       if not (folded and ".mlp.shared_expert." in n))
    for n, a in old.items():
        assert a.dtype != jnp.int8
        if n not in int8:
            assert new[n] is a, n  # shared, not copied
    experts = [n for n in new if ".experts." in n and n.startswith("mtp.")]
    assert bool(experts) == (ckpt == "tiny_moe_fused")
    assert all(new[n].dtype == jnp.float32 for n in experts)
    module = derived.module()
    gate_up = getattr(module.mtp.layers[0].mlp, "gate_up_proj", None)
    if gate_up is not None:  # the fused norm + gate/up kernel takes model-dtype rows only
        gate_up.backend = "fused"
        assert not module.mtp.layers[0]._fuses_mlp(jnp.zeros((1, 1, model.cfg.hidden_size)))


@pytest.fixture(scope="module")
def moe():
    return load_model(fixture_path("tiny_moe_fused"), "float32", with_mtp=True)


def test_engine_with_int8_draft_equals_plain_decoding(moe):
    """Greedy MTP rounds with the int8 draft layer and int8 head on the MoE model: every
    token equals plain decoding (the target verifies whatever the draft proposes), drafts
    are made."""
    from mtp_jax.engine.requests import Request, SamplingParams

    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, 200, n).tolist() for n in (5, 13)]

    def run(spec):
        eng = Engine(moe, EngineConfig(max_running_requests=2, dtype="float32",
                                       max_model_len=64, enable_prefix_cache=False), spec)
        reqs = [Request(request_id=f"r{i}", index=i, prompt=None, prompt_ids=p, seed=i,
                        params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
                for i, p in enumerate(prompts)]
        return eng.run(reqs), eng

    want, _ = run(SpeculativeConfig(algorithm="none"))
    got, eng = run(SpeculativeConfig(algorithm="mtp", num_steps=3, draft_layer_dtype="int8",
                              draft_head_dtype="int8"))
    assert eng.draft_layer_dtype == "int8" and eng.draft_head_dtype == "int8"
    assert eng.model.module().mtp.fc.weight[...].dtype == jnp.int8
    for r, w in zip(got, want):
        assert r.output_ids == w.output_ids
        assert r.num_draft_tokens > 0


def _unique_bytes(*models) -> int:
    seen, total = set(), 0
    for m in models:
        for a in jax.tree_util.tree_leaves(m.params):
            if id(a) not in seen:
                seen.add(id(a))
                total += a.size * a.dtype.itemsize
    return total


@pytest.mark.parametrize("head", [None, "int8"])
def test_planned_bytes_count_the_int8_layer(moe, head):
    """The engine's plan and ``planned_weights_bytes`` (LLM's check before load) count the
    int8 copy of the draft's projections as held next to the model's own parameters."""
    spec = SpeculativeConfig(algorithm="mtp", num_steps=2, draft_layer_dtype="int8",
                      draft_head_dtype=head)
    eng = Engine(moe, EngineConfig(max_running_requests=2, dtype="float32", max_model_len=64,
                                   max_total_tokens=200), spec)
    held = _unique_bytes(moe, eng.model)
    assert eng.plan.weights_bytes == held
    assert planned_weights_bytes(moe.cfg, "float32", True, spec) == held
    no_layer = dataclasses.replace(spec, draft_layer_dtype=None)
    assert held - planned_weights_bytes(moe.cfg, "float32", True, no_layer) == \
        draft_layer_bytes(moe.cfg, "int8") > 0


def test_bench_engine_holds_the_int8_draft():
    """The bench's engine for a k > 0 row with ``draft_layer_dtype="int8"`` runs the int8
    draft (the bench's rows: ``test_bench.py``)."""
    from mtp_jax.bench.run import Settings, make_engine

    model = load_model(fixture_path("tiny_dense"), "float32", with_mtp=True)
    eng = make_engine(model, 1, 3, Settings(prompt_len=16, decode_tokens=4,
                                            draft_layer_dtype="int8"))
    assert eng.model.module().mtp.fc.weight[...].dtype == jnp.int8


def test_floor_counts_int8_draft_projections():
    from mtp_jax.bench.floor import round_bytes

    cfg = ModelConfig.from_folder(fixture_path("tiny_dense"))
    k = 3
    proj = names.mtp_projections(cfg)
    assert "mtp.fc.weight" in proj and "mtp.norm.weight" not in proj
    full = round_bytes(cfg, 2, k, 100, 2)
    int8 = round_bytes(cfg, 2, k, 100, 2, draft_layer_dtype="int8")
    assert int8["weights"] == full["weights"]  # the target stays in the model dtype
    saved = sum(o * i * 2 - o * (i + 4) for o, i in proj.values())
    assert full["draft_weights"] - int8["draft_weights"] == k * saved


def test_cli_llm_and_bench_take_the_option_and_refuse_before_load(capsys, tmp_path):
    from mtp_jax import LLM, generate
    from mtp_jax.bench import main as bench_main

    ckpt = fixture_path("tiny_dense")
    assert generate.main(["--model", ckpt, "--speculative-algorithm", "none",
                          "--speculative-draft-layer-dtype", "int8"]) == 2
    assert FLAG in capsys.readouterr().err
    parse = generate.build_parser().parse_args
    assert parse(["--speculative-draft-layer-dtype", "INT8"]).speculative_draft_layer_dtype \
        == "int8"
    assert parse([]).speculative_draft_layer_dtype == "auto"
    with pytest.raises(SystemExit):
        parse(["--speculative-draft-layer-dtype", "int4"])
    with pytest.raises(ConfigError, match="speculative_draft_layer_dtype"):
        LLM(ckpt, speculative_algorithm="none", speculative_draft_layer_dtype="int8")
    with pytest.raises(ConfigError, match="speculative_draft_layer_dtype"):  # no draft there
        LLM(fixture_path("tiny_qwen4_exp"), speculative_algorithm="none",
            speculative_draft_layer_dtype="int8")
    model = load_model(ckpt, "float32", with_mtp=False)
    with pytest.raises(ValueError, match="with_mtp=True"):
        with_draft_head(model, None, None, "int8")
    with pytest.raises(ValueError, match="unknown"):
        with_draft_head(model, None, None, "int4")
    with pytest.raises(SystemExit):
        bench_main(["--config", f"{ckpt}/config.json", "--draft-layer-dtype", "int4",
                    "--out", str(tmp_path / "o.json")])
