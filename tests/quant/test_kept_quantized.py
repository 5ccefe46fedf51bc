"""Quantized projections kept quantized (``quantization="keep"``): the device forms dequantize
to the independent float64 reference (tests/quant/reference.py), projections merged in quantized
form keep their values, a checkpoint loaded kept holds its codes in their stored dtypes (fewer
bytes, counted by the memory plan and by the check before load) with the same values as the
dequantized load, and a trained model quantized from its float weights decodes the same tokens
with the same accepted drafts kept or dequantized, MTP on and off."""

import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mtp_jax import LLM, SamplingParams
from mtp_jax.config import ConfigError
from mtp_jax.models.loader import load_model
from mtp_jax.models.params import param_name
from mtp_jax.models.quantized import kept_projections, saved_bytes
from mtp_jax.tools.quantize_checkpoint import quantize_folder
from mtp_jax.train.synthetic import motif_prompts
from mtp_jax.weights.quant_config import keeps_quantized
from mtp_jax.weights.quant_tensors import folder_kept_bytes_saved
from pallas_kernels.quant import QuantFormat, concat_parts, dequantize, stored_bytes
from tests.helpers.paths import fixture_path
from tests.quant import reference

FORMATS = ("fp8-block", "modelopt-fp8", "modelopt-nvfp4", "ct-nvfp4")


def _fp8(rng, shape):
    return (rng.standard_normal(shape) * 3).astype(ml_dtypes.float8_e4m3fn)


def _nvfp4_parts(rng, n, k):
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scale = (rng.random((n, k // 16)) * 4 + 0.01).astype(ml_dtypes.float8_e4m3fn)
    return packed, scale


def _ulps(a, b):
    """Largest distance in float32 units in the last place."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return int(np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32))))


@pytest.mark.parametrize("block", [(128, 128), (32, 64), (1, 300)])
def test_fp8_device_form_equals_float64_reference(block):
    """Partial edge blocks (200 x 300 in 128-blocks), small blocks, one scale per row: equal
    to the float64 reference rounded to float32, and to bfloat16."""
    rng = np.random.default_rng(0)
    w = _fp8(rng, (200, 300))
    s = (rng.random((-(-200 // block[0]), -(-300 // block[1]))) + 0.1).astype(np.float32)
    ref = reference.block_fp8(w, s, block)
    fmt = QuantFormat("fp8", block, 300)
    for dtype in (jnp.float32, jnp.bfloat16):
        got = dequantize(fmt, jnp.asarray(w), jnp.asarray(s), None, dtype)
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      ref.astype(np.float32).astype(dtype).astype(np.float32))


@pytest.mark.parametrize("divide", [False, True])
def test_nvfp4_device_form_equals_float64_reference(divide):
    """13 groups of 16 columns: equal to the float64 reference (ModelOpt's scale_2), within one
    float32 ulp for compressed-tensors' division by its global scale."""
    rng = np.random.default_rng(1)
    packed, scale = _nvfp4_parts(rng, 24, 208)
    g = np.float32(3.7)
    ref = (reference.nvfp4(packed, scale, global_scale=np.array([g])) if divide
           else reference.nvfp4(packed, scale, scale_2=np.array([g])))
    fmt = QuantFormat("nvfp4", (1, 16), 208, divide=divide)
    got = dequantize(fmt, jnp.asarray(packed), jnp.asarray(scale), jnp.full((24,), g), jnp.float32)
    assert _ulps(got, ref.astype(np.float32)) <= (1 if divide else 0)


def test_merged_parts_keep_their_values():
    """Concatenated fp8 parts with row counts that are and are not multiples of the block
    (the scales then repeated per row), and NVFP4 parts of different scale_2: the merged form
    dequantizes to the parts' dequantizations stacked; its bytes are the parts' (aligned) or
    more (rows)."""
    rng = np.random.default_rng(2)
    for sizes, aligned in (((64, 32, 40), True), ((40, 64), False)):
        fmts, parts, refs = [], [], []
        for n in sizes:
            w = _fp8(rng, (n, 96))
            s = (rng.random((-(-n // 32), 3)) + 0.1).astype(np.float32)
            fmts.append(QuantFormat("fp8", (32, 32), 96))
            parts.append((jnp.asarray(w), jnp.asarray(s), None))
            refs.append(reference.block_fp8(w, s, (32, 32)))
        fmt, merged = concat_parts(fmts, parts)
        assert (fmt.block == (32, 32)) == aligned
        got = dequantize(fmt, *merged, jnp.float32)
        np.testing.assert_array_equal(np.asarray(got), np.concatenate(refs).astype(np.float32))
    fmts, parts, refs = [], [], []
    for n, g in ((8, 0.5), (16, 3.0)):
        packed, scale = _nvfp4_parts(rng, n, 32)
        fmts.append(QuantFormat("nvfp4", (1, 16), 32))
        parts.append((jnp.asarray(packed), jnp.asarray(scale), jnp.full((n,), g, jnp.float32)))
        refs.append(reference.nvfp4(packed, scale, scale_2=np.array([g])))
    fmt, merged = concat_parts(fmts, parts)
    np.testing.assert_array_equal(np.asarray(dequantize(fmt, *merged, jnp.float32)),
                                  np.concatenate(refs).astype(np.float32))
    with pytest.raises(ValueError, match="different forms"):
        concat_parts([QuantFormat("fp8", (1, 32), 32), QuantFormat("nvfp4", (1, 16), 32)],
                     parts)


def test_quantization_modes():
    assert not keeps_quantized("auto", "gpu") and not keeps_quantized("auto", "cpu")
    assert keeps_quantized("keep", "cpu") and not keeps_quantized("dequantize", "gpu")
    with pytest.raises(ConfigError, match="'kept' is unknown.*'keep'"):
        keeps_quantized("kept")


@pytest.fixture(scope="module")
def trained_quantized(tmp_path_factory):
    """The trained fixture (tests/fixtures/tiny_trained, hidden 64) quantized in each format
    from its float weights, FP8 in 32 x 32 blocks (several blocks per matrix, the MTP
    projections' row counts not all multiples of 32), mtp.fc included."""
    root = tmp_path_factory.mktemp("kept")
    out = {}
    for fmt in FORMATS:
        folder = str(root / fmt)
        shutil.copytree(fixture_path("tiny_trained"), folder)
        out[fmt] = quantize_folder(folder, fmt, quantize_mtp_fc=True, block=(32, 32))
    return out


def _by_name(module):
    return {param_name(p): n for p, n in nnx.iter_graph(module) if hasattr(n, "weight")}


@pytest.mark.parametrize("fmt", FORMATS)
def test_kept_checkpoint_holds_codes_with_the_dequantized_values(fmt, trained_quantized):
    """Every quantized projection (the MTP draft's and mtp.fc included) is held in its stored
    dtype; dequantized it equals the dequantize-at-load parameter (compressed-tensors: within
    one float32 ulp); the saved bytes are the dense bytes less the held arrays' bytes."""
    folder = trained_quantized[fmt]
    dense = load_model(folder, "float32", quantization="dequantize", merge_projections=False)
    kept = load_model(folder, "float32", quantization="keep", merge_projections=False)
    ref, module = _by_name(dense.module()), kept.module()
    projections = dict(kept_projections(module))
    assert {"mtp.fc", "mtp.layers.0.self_attn.q_proj", "layers.0.linear_attn.in_proj_qkv",
            "layers.3.mlp.down_proj"} <= set(projections)
    assert "layers.0.linear_attn.in_proj_a" not in projections  # stored unquantized
    held = 0
    for name, m in projections.items():
        code_dtype = jnp.uint8 if "nvfp4" in fmt else jnp.float8_e4m3fn
        assert m.weight[...].dtype == code_dtype, name
        w = dequantize(m.quant, m.weight[...], m.scale[...],
                       None if m.scale_2 is None else m.scale_2[...], m.dtype)
        assert _ulps(w, ref[name].weight[...]) <= (1 if fmt == "ct-nvfp4" else 0), name
        held += sum(int(a[...].nbytes) for a in (m.weight, m.scale, m.scale_2) if a is not None)
        assert stored_bytes(m.quant, m.out_features) == sum(
            int(a[...].nbytes) for a in (m.weight, m.scale, m.scale_2) if a is not None)
    dense_bytes = sum(m.out_features * m.in_features * 4 for m in projections.values())
    assert kept.weight_bytes_saved == saved_bytes(module) == dense_bytes - held > 0
    assert dense.weight_bytes_saved == 0


@pytest.mark.parametrize("fmt", ["fp8-block"])
def test_kept_model_decodes_and_drafts_like_the_dequantized_one(fmt, trained_quantized):
    """Motif prompts, greedy, MTP k = 3 and plain: the same tokens and accept counts kept as
    dequantized, drafts accepted (the trained head survives quantization), and the kept model's
    MTP output equal to its own plain decoding. Projections merge in quantized form where a
    group is held in one form (the attention q/k/v). (NVFP4 generation: the MoE test below.)"""
    folder = trained_quantized[fmt]
    prompts = motif_prompts(3, seed=5)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs, planned, saved = {}, {}, {}
    for mode in ("dequantize", "keep"):
        for k in (0, 3):
            llm = LLM(folder, dtype="float32", quantization=mode, max_running_requests=3,
                      max_model_len=96, enable_prefix_cache=False,
                      speculative_algorithm="mtp" if k else "none",
                      speculative_num_steps=k)
            got = llm.generate(prompts, params)
            outs[mode, k] = [(o.token_ids, o.num_accepted_tokens) for o in got]
            planned[mode, k] = llm.engine.plan.weights_bytes
            if mode == "keep":
                names = [n for n, _ in kept_projections(llm.model.module())]
                assert "layers.3.self_attn.qkv_proj" in names
                saved[k] = llm.model.weight_bytes_saved
    assert 0 < saved[0] < saved[3]  # the draft's projections too
    # The check before load reads the saving from the headers: never more than the real one
    # (FP8 scales counted per row: 4 bytes per 32 weights in these 32-column blocks, against
    # 3 saved per float32 weight, so within 5% of it).
    for k in (0, 3):
        estimate = folder_kept_bytes_saved(folder, 4, with_mtp=k > 0)
        assert saved[k] * 0.95 < estimate <= saved[k], (k, estimate, saved[k])
    assert all(planned["keep", k] == planned["dequantize", k] - saved[k] for k in (0, 3))
    assert outs["keep", 3] == outs["dequantize", 3]
    assert outs["keep", 0] == outs["dequantize", 0]
    assert [t for t, _ in outs["keep", 3]] == [t for t, _ in outs["keep", 0]]
    assert sum(a for _, a in outs["keep", 3]) > 10  # drafts accepted


def test_qwen4_exp_kept_nvfp4_forward_equals_dequantized(tmp_path):
    """qwen4_exp (QSA index projections, PLE projections, mtp.fc_embedding / fc_hidden
    quantized): kept, the target and draft logits equal the dequantized load's."""
    from mtp_jax.tools.random_checkpoint import write_random_checkpoint

    folder = write_random_checkpoint(fixture_path("tiny_qwen4_exp"), str(tmp_path / "q"),
                                     dtype="float32", quantize="modelopt-nvfp4",
                                     quantize_mtp_fc=True)
    # one parameter per tensor in both: a kept projection is not merged with plain ones, and
    # a merged GEMM sums in another order than the separate ones
    dense = load_model(folder, "float32", quantization="dequantize", merge_projections=False)
    kept = load_model(folder, "float32", quantization="keep", merge_projections=False)
    names = {n for n, _ in kept_projections(kept.module())}
    assert {"mtp.fc_embedding", "mtp.fc_hidden", "layers.0.linear_attn.in_proj_qkv"} <= names
    assert kept.weight_bytes_saved > 0
    ids = np.array([[5, 17, 42, 9, 3, 100]])
    (la, ha), (lb, hb) = dense.forward(ids), kept.forward(ids)
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    np.testing.assert_array_equal(np.asarray(dense.mtp_forward(ha, ids)[0]),
                                  np.asarray(kept.mtp_forward(hb, ids)[0]))
    merged = load_model(folder, "float32", quantization="keep")  # the default: merged groups
    np.testing.assert_allclose(np.asarray(merged.forward(ids)[0]), np.asarray(la),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,experts,mtp_experts", [("fp8-block", "fused", "per-expert"),
                                                     ("ct-nvfp4", "per-expert", "fused")])
def test_moe_experts_kept(fmt, experts, mtp_experts, tmp_path):
    """Routed experts, stacked and per expert (gate and up stacked in quantized form, their
    FP8 128-row blocks straddling the 32-row parts, so scales repeated per row): held in the
    stored dtype; the whole stack dequantized equals the dequantize-at-load experts; the model
    computes the same logits in the gather form (one row) and the block form (34 rows), up to
    float32 summation order, and (compressed-tensors NVFP4, whose division is within an ulp)
    generates the same tokens with MTP k = 2."""
    from mtp_jax.models.quantized import kept_experts
    from mtp_jax.tools.random_checkpoint import write_random_checkpoint

    folder = write_random_checkpoint(fixture_path("tiny_moe_fused"), str(tmp_path / "m"),
                                     dtype="float32", quantize=fmt, experts=experts,
                                     mtp_experts=mtp_experts)
    dense = load_model(folder, "float32", quantization="dequantize", merge_projections=False)
    kept = load_model(folder, "float32", quantization="keep", merge_projections=False)
    ref = {param_name(p): n for p, n in nnx.iter_graph(dense.module()) if hasattr(n, "stack")}
    stacks = dict(kept_experts(kept.module()))
    assert set(stacks) == set(ref) and "mtp.layers.0.mlp.experts" in stacks
    code_dtype = jnp.uint8 if "nvfp4" in fmt else jnp.float8_e4m3fn
    for name, m in stacks.items():
        for stack in ("gate_up_proj", "down_proj"):
            assert getattr(m, stack)[...].dtype == code_dtype
            assert _ulps(m.stack(stack)[...], ref[name].stack(stack)) <= (
                1 if fmt == "ct-nvfp4" else 0), (name, stack)
    ids = np.array([[5, 17, 42, 9, 3, 100, 7, 8, 9, 10, 11, 12] * 3])[:, :34]
    for t in (1, 34):
        (la, _), (lb, _) = dense.forward(ids[:, :t]), kept.forward(ids[:, :t])
        np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=1e-4, atol=1e-4)
    if fmt != "ct-nvfp4":
        return  # generation once, with the format whose values are not bit-equal
    prompts = [[5, 17, 42, 9], [3, 100, 7, 250, 11, 60]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = [[(o.token_ids, o.num_accepted_tokens) for o in LLM(
        folder, dtype="float32", quantization=mode, speculative_num_steps=2,
        max_running_requests=2, max_model_len=64, enable_prefix_cache=False).generate(
            prompts, params)] for mode in ("dequantize", "keep")]
    assert outs[0] == outs[1]


@pytest.mark.parametrize("kind", ["fp8", "nvfp4"])
def test_pallas_gemv_backend_takes_the_dequantizing_kernel(kind, monkeypatch):
    """A kept projection whose backend is ``pallas`` (``--gemv-backend pallas``) calls the
    Triton kernel that dequantizes as it reads (:func:`pallas_kernels.quant.quant_gemv`; the
    kernel itself: tests/kernels/test_quant_gemv.py) for calls of up to 8 rows, and XLA's
    dequantize + projection otherwise and with ``reduce`` (the GPU default)."""
    import jax

    from mtp_jax.models.layers import basic
    from mtp_jax.models.quantized import _random_parts
    from pallas_kernels.quant.gemv import quant_gemv_reference

    calls = []

    def spy(x, fmt, codes, scale, scale_2, *, out_dtype):
        calls.append(x.shape)
        return quant_gemv_reference(x, fmt, codes, scale, scale_2, out_dtype=out_dtype)

    monkeypatch.setattr(basic, "quant_gemv", spy)
    n, k = 512, 256
    fmt = QuantFormat(kind, (128, 128) if kind == "fp8" else (1, 16), k)
    m = basic.Linear(k, n, jnp.float32)
    basic.keep_quantized(m, fmt, *_random_parts(jax.random.key(0), kind, fmt, (), n))
    for backend, rows, kernel in (("pallas", 1, True), ("pallas", 8, True),
                                  ("pallas", 9, False), ("reduce", 1, False)):
        m.backend = backend
        calls.clear()
        x = jax.random.normal(jax.random.key(rows), (rows, 1, k), jnp.float32)
        y = m(x)
        assert bool(calls) == kernel, (backend, rows)
        want = x @ dequantize(fmt, m.weight[...], m.scale[...],
                              None if m.scale_2 is None else m.scale_2[...], jnp.float32).T
        np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
