"""GGUF block types kept packed (``quantization="keep"``): the device decoders of
:mod:`pallas_kernels.quant.ggml` equal the ``gguf`` package's numpy dequantization (Q8_0, Q4_K,
IQ3_XXS) and the Q2_0 reader, bit for bit; a qwen4exp GGUF target whose routed gate / up experts
are Q8_0 holds them packed, computes the logits of the dequantized load, and decodes the same
tokens with the same accepted drafts (the trained fixture, MTP k = 3)."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import quants
from gguf.constants import GGMLQuantizationType

from mtp_jax.models.loader import load_model
from mtp_jax.models.quantized import kept_experts
from mtp_jax.weights.q2_0 import dequantize_q2_0
from pallas_kernels.quant.ggml import GGML_BLOCKS, dequantize_rows
from tests.gguf.test_gguf_target import CKPT, mtp_runs
from tests.gguf.writer import write_pack, write_target


def _random_blocks(rng, ggml_type: str, rows: int, blocks: int) -> np.ndarray:
    """Random bytes of ``rows`` rows of ``blocks`` blocks, every fp16 scale finite (the first
    two bytes of a block, and ``dmin`` of Q4_K)."""
    nbytes = GGML_BLOCKS[ggml_type][1]
    raw = rng.integers(0, 256, (rows, blocks, nbytes), dtype=np.uint8)
    for start in ((0, 2) if ggml_type == "Q4_K" else (0,)):
        half = (rng.standard_normal((rows, blocks)) * 0.1).astype(np.float16)
        raw[..., start:start + 2] = half.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * nbytes)


@pytest.mark.parametrize("ggml_type", sorted(GGML_BLOCKS))
def test_device_decoders_equal_the_gguf_package(ggml_type):
    rng = np.random.default_rng(3)
    values = GGML_BLOCKS[ggml_type][0]
    raw = _random_blocks(rng, ggml_type, 5, 3)
    if ggml_type == "Q2_0":
        ref = dequantize_q2_0(raw, (5, 3 * values))
    else:
        ref = quants.dequantize(raw, GGMLQuantizationType[ggml_type]).reshape(5, 3 * values)
    got = np.asarray(dequantize_rows(ggml_type, jnp.asarray(raw), 3 * values))
    np.testing.assert_array_equal(got, ref)
    stacked = np.asarray(dequantize_rows(ggml_type, jnp.asarray(raw.reshape(5, 1, -1)),
                                         3 * values))  # leading axes (stacked experts)
    np.testing.assert_array_equal(stacked[:, 0], ref)


@pytest.fixture(scope="module")
def q8_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_kept")
    target = write_target(CKPT, str(d / "t.gguf"),
                          quantize={"ffn_gate_exps.weight": "Q8_0",
                                    "ffn_up_exps.weight": "Q8_0"})
    return target, write_pack(CKPT, str(d / "mtp.gguf"))


def test_q8_0_experts_kept_packed(q8_files):
    target, pack = q8_files
    dense = load_model(target, "float32", with_mtp=True, draft_path=pack,
                       quantization="dequantize")
    kept = load_model(target, "float32", with_mtp=True, draft_path=pack, quantization="keep")
    stacks = dict(kept_experts(kept.module()))
    assert len(stacks) == kept.cfg.num_hidden_layers  # every target layer (the pack is F32)
    for m in stacks.values():
        assert dict(m.quant)["gate_up_proj"].ggml_type == "Q8_0"
        assert m.gate_up_proj[...].dtype == jnp.uint8 and "down_proj" not in dict(m.quant)
    assert kept.weight_bytes_saved > 0
    ids = np.array([[5, 9, 1, 7, 7, 30, 2, 11]], np.int32)
    for t in (1, 8):  # the gather form (one row) and the block form
        (la, _), (lb, _) = dense.forward(ids[:, :t]), kept.forward(ids[:, :t])
        np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=0, atol=1e-5)
    _, out = mtp_runs({"dense": dense, "kept": kept})
    assert out["kept"] == out["dense"]
    assert sum(s[-1][1] for s in out["kept"][1].values()) > 0  # drafts were accepted


def test_random_packed_weights_for_the_bench():
    """``bench --quantization Q8_0``: every projection and expert stack whose input size is a
    whole number of 32-value blocks is held as random Q8_0 rows with finite scales; the
    model runs, and the experts' bytes ratio is Q8_0's 34 bytes per 32 float32 weights."""
    from mtp_jax.bench.floor import load_config
    from mtp_jax.models.quantized import (experts_bytes_ratio, kept_projections,
                                          with_random_kept)
    from tests.helpers.paths import fixture_path

    cfg = load_config(fixture_path("tiny_moe_fused") + "/config.json")
    model = with_random_kept(load_model(cfg=cfg, dtype="float32", dummy_weight=True), "Q8_0")
    module = model.module()
    projections = dict(kept_projections(module))
    assert projections and all(m.quant.ggml_type == "Q8_0" for m in projections.values())
    stacks = dict(kept_experts(module))
    assert {s for m in stacks.values() for s, _ in m.quant} == {"gate_up_proj", "down_proj"}
    assert experts_bytes_ratio(module) == pytest.approx(34 / (32 * 4))
    logits, _ = model.forward(np.array([[1, 2, 3, 4]], np.int32))
    assert np.isfinite(np.asarray(logits)).all()


def test_kept_saving_read_from_the_headers(q8_files):
    """What ``keep`` saves, predicted from the GGUF headers before any data is read (the memory
    check's and ``quantization="auto"``'s input), equals what the load then saves."""
    from mtp_jax.models.qwen4_exp.gguf_loader import gguf_kept_bytes_saved

    target, pack = q8_files
    kept = load_model(target, "float32", with_mtp=True, draft_path=pack, quantization="keep")
    predicted = gguf_kept_bytes_saved(target, itemsize=4, with_mtp=True, draft_path=pack)
    assert predicted == kept.weight_bytes_saved > 0
    assert gguf_kept_bytes_saved(target, itemsize=4, with_mtp=False) == predicted  # F32 pack


def test_auto_keeps_only_what_does_not_fit_dequantized(q8_files, monkeypatch):
    """``quantization="auto"`` dequantizes where the dequantized weights fit the memory budget,
    keeps the GGUF's blocks packed (with a warning) where only the kept ones fit, and where
    neither fits raises the memory check's error, all before any weight loads. The budget is
    faked at the memory check: the fit is decided by the bytes that keeping saves."""
    import warnings

    from mtp_jax import LLM, ConfigError, SamplingParams
    from mtp_jax.engine import load_plan
    from mtp_jax.models.qwen4_exp.gguf_loader import gguf_kept_bytes_saved

    target, pack = q8_files
    saving = gguf_kept_bytes_saved(target, itemsize=4, with_mtp=True, draft_path=pack)
    need = {"saved": 0}

    def check(cfg, engine_cfg, speculative, weights_saved=0):
        if weights_saved < need["saved"]:
            raise ConfigError(f"fake budget: {weights_saved} bytes saved < {need['saved']}")

    monkeypatch.setattr(load_plan, "check_memory_before_load", check)
    kw = dict(dtype="float32", speculative_draft_model_path=pack, max_model_len=64,
              max_running_requests=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert LLM(target, **kw).model.weight_bytes_saved == 0  # fits dequantized
    need["saved"] = saving  # only the kept weights fit
    with pytest.warns(UserWarning, match="keeping them packed"):
        llm = LLM(target, **kw)
    assert llm.model.weight_bytes_saved == saving
    out = llm.generate([[5, 9, 1, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    need["saved"] = saving + 1  # nothing fits: the check's own error, nothing loads
    with pytest.raises(ConfigError, match="fake budget"):
        LLM(target, **kw)
