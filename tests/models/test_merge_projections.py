"""Merged projections (``MergedLinear``, ``load_model(merge_projections=...)``).

The merged model's forward against HF golden logits is in ``test_golden.py`` (the loader merges
by default); here: the merged module against float64 numpy, the parameter layout before and
after merging, and that merging is idempotent.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mtp_jax
from mtp_jax.models.layers.basic import Linear, MergedLinear, merge_linears, project
from mtp_jax.models.params import param_name
from tests.helpers.paths import FIXTURES

MERGED = {  # merged parameter -> the checkpoint tensors stacked in it, in order
    "linear_attn.in_proj.weight": ["linear_attn.in_proj_qkv.weight",
                                   "linear_attn.in_proj_z.weight",
                                   "linear_attn.in_proj_b.weight",
                                   "linear_attn.in_proj_a.weight"],
    "self_attn.qkv_proj.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight"],
    "mlp.gate_up_proj.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    # the shared expert folded into the routed experts (layers.mlp.FOLD_SHARED_EXPERT): the
    # router and its gate merged; the expert stacks below gain it as expert E
    "mlp.in_proj.weight": ["mlp.gate.weight", "mlp.shared_expert_gate.weight"],
    # qwen4_exp: a hyper-connection's low-rank down and inject projections (both read hn)
    "hyper_connection.down_inject.weight": ["hyper_connection.input_mix_weight_down.weight",
                                            "hyper_connection.block_inject_weight.weight"],
}
FOLDED = {  # routed stack -> the shared expert's tensors appended to it as one more expert
    "mlp.experts.gate_up_proj": ["mlp.shared_expert.gate_proj.weight",
                                 "mlp.shared_expert.up_proj.weight"],
    "mlp.experts.down_proj": ["mlp.shared_expert.down_proj.weight"],
}


def test_merged_linear_matches_numpy():
    rng = np.random.default_rng(3)
    ws = [rng.standard_normal((n, 24)).astype(np.float32) for n in (40, 8, 1, 5)]
    x = rng.standard_normal((2, 3, 24)).astype(np.float32)
    merged = MergedLinear([jnp.asarray(w) for w in ws])
    assert merged.sizes == (40, 8, 1, 5) and merged.weight.shape == (54, 24)
    outs = merged(jnp.asarray(x))
    assert len(outs) == 4
    for out, w in zip(outs, ws):
        ref = x.astype(np.float64) @ w.astype(np.float64).T
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)


def test_project_uses_merged_or_separate():
    rng = np.random.default_rng(4)
    lins = []
    for n in (6, 3):
        lin = Linear(5, n, jnp.float32)
        lin.weight[...] = jnp.asarray(rng.standard_normal((n, 5)), jnp.float32)
        lins.append(lin)
    x = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    separate = project(x, None, lins)
    merged = project(x, merge_linears(lins), lins)
    for a, b, lin in zip(separate, merged, lins):
        ref = np.asarray(x, np.float64) @ np.asarray(lin.weight[...], np.float64).T
        np.testing.assert_allclose(np.asarray(a), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(b), ref, rtol=1e-5, atol=1e-5)


def _flat(model) -> dict[str, np.ndarray]:
    return {param_name(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(model.params)}


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_moe_fused", "tiny_qwen4_exp"])
def test_loader_merges_the_checkpoint_tensors(name):
    path = os.path.join(FIXTURES, name)
    plain = _flat(mtp_jax.load_model(path, dtype="float32", merge_projections=False))
    merged = _flat(mtp_jax.load_model(path, dtype="float32"))
    found = folded = 0
    for pname, value in merged.items():
        suffix = next((s for s in MERGED if pname.endswith(s)), None)
        fold = next((s for s in FOLDED if pname.endswith(s)), None)
        if fold is not None:
            prefix = pname[: -len(fold)]
            shared = np.concatenate([plain.pop(prefix + t) for t in FOLDED[fold]], axis=0)
            np.testing.assert_array_equal(value, np.concatenate([plain.pop(pname),
                                                                 shared[None]]))
            folded += 1
            continue
        if suffix is None:
            np.testing.assert_array_equal(value, plain[pname])  # untouched parameters
            continue
        prefix = pname[: -len(suffix)]
        parts = [plain.pop(prefix + t) for t in MERGED[suffix]]
        np.testing.assert_array_equal(value, np.concatenate(parts, axis=0))
        found += 1
    # every separate projection went into a merged one: nothing left over on either side
    assert set(plain) == {n for n in merged
                          if not any(n.endswith(s) for s in (*MERGED, *FOLDED))}
    assert folded == (2 * sum(n.endswith("mlp.in_proj.weight") for n in merged))
    kinds = {s for n in merged for s in MERGED if n.endswith(s)}
    assert "linear_attn.in_proj.weight" in kinds and "self_attn.qkv_proj.weight" in kinds
    moe = "moe" in name or "qwen4" in name
    assert ("mlp.in_proj.weight" if moe else "mlp.gate_up_proj.weight") in kinds
    if "qwen4" in name:  # both hyper-connections of every layer, the target's and the draft's
        n = sum(n.endswith("hyper_connection.down_inject.weight") for n in merged)
        layers = sum(n.endswith("mlp.in_proj.weight") for n in merged)
        assert n == 2 * layers and layers >= 2
        # the final mixers have no inject: left as they were
        assert any(n.endswith("hyper_connection_mixer.input_mix_weight_down.weight")
                   for n in merged)
    assert found >= 4


def test_merging_twice_changes_nothing():
    m = mtp_jax.load_model(os.path.join(FIXTURES, "tiny_moe_fused"), dtype="float32")
    before = _flat(m)
    module = m.module()
    module.merge_projections()
    after = {param_name(p): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(module))}
    assert set(after) == set(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])


def test_merged_moe_block_with_pallas_router_matches_unmerged():
    """The merged MoE block feeds the Pallas router (interpret mode) the merged output whole
    (its first E columns read in place): same output as the unmerged block with XLA routing."""
    import copy

    m = mtp_jax.load_model(os.path.join(FIXTURES, "tiny_moe_fused"), dtype="float32",
                           merge_projections=False)
    moe = next(layer.mlp for layer in m.module().layers if hasattr(layer.mlp, "experts"))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, moe.experts.gate_up_proj
                                                                 .shape[-1])), jnp.float32)
    want = np.asarray(moe(x))
    merged = copy.deepcopy(moe)
    merged.merge_projections()
    merged._router_backend = lambda: "pallas"
    np.testing.assert_allclose(np.asarray(merged(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 6])  # decode (few pairs: gather-reduce), prefill (blocks)
def test_folded_shared_expert_is_routed_expert_e(monkeypatch, rows):
    """``FOLD_SHARED_EXPERT``: the shared expert becomes routed expert E (its gate/up and down
    appended to the stacks), every token routes to it with weight sigmoid(shared gate), and the
    block's output is the unfolded block's (float32)."""
    import copy

    from mtp_jax.models.layers import mlp

    m = mtp_jax.load_model(os.path.join(FIXTURES, "tiny_moe_fused"), dtype="float32",
                           merge_projections=False)
    moe = next(layer.mlp for layer in m.module().layers if hasattr(layer.mlp, "experts"))
    se, e = moe.shared_expert, moe.num_experts
    x = jnp.asarray(np.random.default_rng(5).standard_normal(
        (1, rows, moe.experts.gate_up_proj.shape[-1])), jnp.float32)
    want = np.asarray(moe(x))
    folded = copy.deepcopy(moe)
    monkeypatch.setattr(mlp, "FOLD_SHARED_EXPERT", 1)
    folded.merge_projections()
    assert folded.shared_expert is None and folded.in_proj.sizes == (e, 1)
    gate_up, down = folded.experts.gate_up_proj[...], folded.experts.down_proj[...]
    assert gate_up.shape[0] == down.shape[0] == e + 1
    np.testing.assert_array_equal(gate_up[e], np.concatenate(
        [se.gate_proj.weight[...], se.up_proj.weight[...]]))
    np.testing.assert_array_equal(down[e], se.down_proj.weight[...])
    np.testing.assert_array_equal(gate_up[:e], moe.experts.gate_up_proj[...])
    np.testing.assert_allclose(np.asarray(folded(x)), want, rtol=1e-5, atol=1e-5)
