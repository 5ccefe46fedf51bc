"""Q2_0 (ggml type 42) against a float64 re-derivation written here from the format text
(../shared/FORMATS.md: 64 values in 18 bytes, an fp16 scale d then 16 bytes of 2-bit codes,
four per byte, low bits first, value = (code - 1) * d), never only against mtp_jax's encoder;
and a Strata pack with Q2_0 / Q8_0 experts loads to those values (Q8_0: gguf.quants).

Teeth (shown by hand, then restored): with the decoder's shifts reversed to [6, 4, 2, 0]
(high bits first) test_decoder_matches_the_format_text and test_pack_experts fail.
"""

import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mtp_jax.models.qwen4_exp.random_checkpoint import write_random_qwen4_exp
from mtp_jax.models.qwen4_exp.strata_pack import pack_tensors
from mtp_jax.weights.gguf_reader import open_gguf, read_tensor
from mtp_jax.weights.q2_0 import dequantize_q2_0, quantize_q2_0
from tests.gguf.writer import write_pack, write_target
from tests.helpers.paths import fixture_path


def reference_q2_0(raw: bytes, n_values: int) -> np.ndarray:
    """Float64 values of Q2_0 bytes, one value at a time, from the format text."""
    out = np.empty(n_values, np.float64)
    for b in range(n_values // 64):
        block = raw[18 * b:18 * (b + 1)]
        d = struct.unpack("<e", block[:2])[0]
        for j in range(64):
            code = (block[2 + j // 4] >> (2 * (j % 4))) & 0b11
            out[64 * b + j] = (code - 1) * d
    return out


def test_hand_block():
    d = struct.pack("<e", 0.5)
    codes = bytes([0b11100100] + [0b01010101] * 15)  # values 0..3: codes 0, 1, 2, 3
    got = dequantize_q2_0(np.frombuffer(d + codes, np.uint8), (64,))
    assert got[:4].tolist() == [-0.5, 0.0, 0.5, 1.0] and not got[4:].any()


def test_decoder_matches_the_format_text():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (12, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(rng.uniform(-2, 2, 12).astype("<f2").tobytes(),
                                  np.uint8).reshape(12, 2)
    got = dequantize_q2_0(blocks, (3, 256))
    want = reference_q2_0(blocks.tobytes(), 12 * 64).reshape(3, 256)
    np.testing.assert_array_equal(got.astype(np.float64), want)


def test_encoder_round_trip_within_a_step():
    """Levels -d, 0, d, 2d with d = max|x| / 2: values below -d clip, so the error is at most
    one step d (half a step above -d)."""
    x = np.random.default_rng(1).standard_normal((4, 128)).astype(np.float32)
    q = quantize_q2_0(x)
    y = reference_q2_0(q.tobytes(), x.size).reshape(x.shape)
    d = np.abs(x.reshape(-1, 64)).max(1) / 2
    err = np.abs(x.reshape(-1, 64) - y.reshape(-1, 64)).max(1)
    assert q.shape == (4, 36) and np.all(err <= d * 1.001 + 1e-3)
    inner = np.abs(x.reshape(-1, 64)) <= d[:, None]  # within [-d, d]: half a step
    assert np.all(np.abs(x.reshape(-1, 64) - y.reshape(-1, 64))[inner] <= 0.5 * np.repeat(
        d[:, None], 64, 1)[inner] * 1.001 + 1e-3)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A random qwen4_exp checkpoint whose expert widths are multiples of 64 (Q2_0 blocks)."""
    import json

    raw = json.load(open(fixture_path("tiny_qwen4_exp") + "/config.json"))
    raw["text_config"].update(hidden_size=64, ple_embed_dim=64, moe_intermediate_size=64,
                              num_experts=4, shared_expert_intermediate_size=16)
    d = tmp_path_factory.mktemp("wide")
    write_random_qwen4_exp(raw, str(d / "st"), dtype="float32", seed=3)
    return str(d / "st"), d


def test_pack_experts(wide):
    folder, d = wide
    pre = "mtp.layers.0.mlp.experts."
    st = write_pack(folder, str(d / "f32.gguf"))
    src = {n: read_tensor(open_gguf(st), t) for n, t in pack_tensors(open_gguf(st)).items()}
    gu = quantize_q2_0(src[pre + "gate_up_proj"])
    down = gguf.quants.quantize(src[pre + "down_proj"], T.Q8_0)
    pack = write_pack(folder, str(d / "q.gguf"), experts={
        pre + "gate_up_proj": (gu.view(np.int8), src[pre + "gate_up_proj"].shape, 42),
        pre + "down_proj": (down, src[pre + "down_proj"].shape, T.Q8_0)})
    target = write_target(folder, str(d / "t.gguf"))
    from mtp_jax.models.loader import load_model
    m = load_model(target, "float32", draft_path=pack)
    params = {".".join(map(str, p)): np.asarray(v[...])
              for p, v in __import__("flax").nnx.to_flat_state(m.params)}
    want_gu = reference_q2_0(gu.tobytes(), gu.size // 18 * 64).reshape(4, 128, 64)
    np.testing.assert_array_equal(params[pre + "gate_up_proj"], want_gu.astype(np.float32))
    want_down = gguf.quants.dequantize(down, T.Q8_0)
    np.testing.assert_array_equal(params[pre + "down_proj"], want_down)
