"""``python -m mtp_jax.tools.random_checkpoint --format gguf`` (mtp_jax.tools.random_gguf):
a qwen4exp GGUF target and a Strata MTP pack, checked through mtp_jax's GGUF reader.

* From the trained tiny fixture's values (``values_from``, F32): the GGUF target + pack load
  to the safetensors checkpoint's parameters and logits, and ``LLM`` decodes the same greedy
  tokens with MTP (k = 3, drafts accepted) and without.
* Random blocks in each of Q8_0 / Q4_K / IQ3_XXS / Q2_0 (a config whose rows are whole 256-value
  blocks): finite logits, the packed (``keep``) load equal to the dequantized one, the types
  the summary reports are the stored ones, and a row that is not whole blocks falls back.
* The CLI: --format gguf writes both files; options of the other format are refused by name.

Teeth (shown by hand, then restored): with gguf_layout._tile returning its input,
test_values_from_a_checkpoint fails on the GDN parameters of layers 0, 1, 3 (linear_attn
in_proj_qkv / z / a / b, A_log, dt_bias, conv1d, out_proj); with the ``norm`` kind not adding 1,
it fails by 1.0 on every hc / q / k / ple norm.
"""

import json

import numpy as np
import pytest
from flax import nnx

from mtp_jax import LLM, SamplingParams
from mtp_jax.models.loader import load_model
from mtp_jax.tools import random_checkpoint
from mtp_jax.tools.random_gguf import write_random_gguf
from mtp_jax.weights.gguf_reader import open_gguf, type_name
from tests.fixtures.make_qwen4_trained_fixture import fixture_prompts
from tests.helpers.paths import fixture_path

TRAINED = fixture_path("tiny_qwen4_trained")


@pytest.fixture(scope="module")
def from_trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gguf_trained"))
    write_random_gguf(TRAINED, out, expert_type="F32", dense_type="F32", values_from=TRAINED)
    return out


def _flat(m) -> dict:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(m.params)}


def test_values_from_a_checkpoint(from_trained):
    ref = load_model(TRAINED, "float32", with_mtp=True)
    gg = load_model(f"{from_trained}/model.gguf", "float32", with_mtp=True,
                    draft_path=f"{from_trained}/mtp.gguf")
    fa, fb = _flat(ref), _flat(gg)
    assert set(fa) == set(fb)
    bad = {k: float(np.abs(fa[k] - fb[k]).max()) for k in fa
           if not np.allclose(fa[k], fb[k], rtol=0, atol=2e-7)}
    assert not bad, bad  # +1 norms and -exp(A_log) round trips: an ulp or two
    ids = np.array([[5, 9, 1, 7, 7, 30, 2, 11]], np.int32)
    (la, ha), (lb, hb) = ref.forward(ids), gg.forward(ids)
    np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=0, atol=2e-5)


def test_llm_mtp_on_and_off_same_tokens(from_trained):
    prompts = [p for p in fixture_prompts(256) if len(p) <= 12][:2]  # text the head learnt
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for k in (3, 0):
        llm = LLM(f"{from_trained}/model.gguf", dtype="float32", max_running_requests=2,
                  max_model_len=64, speculative_algorithm="mtp" if k else "none",
                  speculative_num_steps=k or 3, speculative_adaptive=False,
                  speculative_draft_model_path=f"{from_trained}/mtp.gguf" if k else None)
        outs[k] = llm.generate(prompts, params)
    assert [o.token_ids for o in outs[3]] == [o.token_ids for o in outs[0]]
    assert all(len(o.token_ids) == 10 for o in outs[3])
    assert max(o.accept_length for o in outs[3]) > 1.0  # the trained head's drafts land


def _wide_config() -> dict:
    """The trained fixture's shape with rows of whole 256-value blocks (hidden and expert
    widths 256), 4 layers, 4 experts."""
    raw = json.load(open(f"{TRAINED}/config.json"))
    t = raw["text_config"]
    t.update(hidden_size=256, moe_intermediate_size=256, shared_expert_intermediate_size=64,
             ple_embed_dim=64, num_experts=4, num_hidden_layers=4, layer_types=t["layer_types"][:4])
    return raw


@pytest.mark.parametrize("expert_type,dense_type", [("Q8_0", "BF16"), ("Q4_K", "Q8_0"),
                                                    ("IQ3_XXS", "Q4_K"), ("Q2_0", "F16")])
def test_random_blocks_load_packed_and_dequantized(tmp_path, expert_type, dense_type):
    out = str(tmp_path)
    target, pack = write_random_gguf(_wide_config(), out, expert_type=expert_type,
                                     dense_type=dense_type, seed=1)
    stored = {n: type_name(t.type_id) for n, t in open_gguf(target["path"]).tensors.items()}
    assert stored["blk.0.ffn_gate_exps.weight"] == stored["blk.3.ffn_down_exps.weight"] \
        == expert_type
    assert stored["blk.0.attn_qkv.weight"] == dense_type and stored["blk.0.ssm_a"] == "F32"
    if dense_type.startswith("Q"):  # rows of 8 (hc_lowrank) hold no block: F32, reported
        assert stored["blk.0.hc_attn_up.weight"] == "F32"
        assert target["fallback"]["blk.0.hc_attn_up.weight"].startswith("F32 (rows of 8")
    else:
        assert stored["blk.0.hc_attn_up.weight"] == dense_type
    counted = {t: n for t, (n, _) in target["types"].items()}
    assert counted == {t: list(stored.values()).count(t) for t in set(stored.values())}
    pack_types = {n: type_name(t.type_id) for n, t in open_gguf(pack["path"]).tensors.items()}
    assert pack_types["mtp.layers.0.mlp.experts.gate_up_proj"] == expert_type
    kw = dict(with_mtp=True, draft_path=pack["path"])
    dense = load_model(target["path"], "float32", quantization="dequantize", **kw)
    kept = load_model(target["path"], "float32", quantization="keep", **kw)
    assert kept.weight_bytes_saved > 0
    ids = np.array([[5, 9, 1, 7, 7, 30, 2, 11]], np.int32)
    for t in (1, 8):  # the experts' gather form (one row) and the block form
        (la, ha), (lb, hb) = dense.forward(ids[:, :t]), kept.forward(ids[:, :t])
        assert np.isfinite(np.asarray(la)).all()
        np.testing.assert_allclose(np.asarray(lb), np.asarray(la), rtol=0, atol=1e-5)
    da, _ = dense.mtp_forward(ha, np.roll(ids, -1, axis=1)[:, :8])
    assert np.isfinite(np.asarray(da)).all()


def test_cli_writes_both_files(tmp_path, capsys):
    out = tmp_path / "g"
    rc = random_checkpoint.main(["--config", fixture_path("tiny_qwen4_exp"), "--out", str(out),
                                 "--format", "gguf", "--gguf-expert-type", "BF16"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "model.gguf" in printed and "mtp.gguf" in printed
    assert open_gguf(str(out / "model.gguf")).architecture == "qwen4exp"
    pack = open_gguf(str(out / "mtp.gguf"))
    assert pack.architecture == "qwen4exp-mtp"
    assert pack.metadata["strata.mtp.expert_format"] == "bf16"
    rc = random_checkpoint.main(["--config", fixture_path("tiny_qwen4_exp"), "--out",
                                 str(tmp_path / "n"), "--format", "gguf", "--no-mtp"])
    assert rc == 0 and not (tmp_path / "n" / "mtp.gguf").exists()


@pytest.mark.parametrize("argv,message", [
    (["--format", "gguf", "--dtype", "float32"], "--dtype does not apply to --format gguf"),
    (["--format", "gguf", "--quantize", "fp8-block", "--experts", "per-expert"],
     "--experts, --quantize do not apply to --format gguf"),
    (["--gguf-expert-type", "Q4_K"], "--gguf-expert-type does not apply to --format "
                                     "safetensors; add --format gguf"),
])
def test_cli_refuses_options_of_the_other_format(tmp_path, capsys, argv, message):
    rc = random_checkpoint.main(["--config", fixture_path("tiny_qwen4_exp"), "--out",
                                 str(tmp_path / "x"), *argv])
    assert rc == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="values_from stores real values"):
        write_random_gguf(TRAINED, str(tmp_path), expert_type="Q4_K", values_from=TRAINED)
    raw = json.load(open(f"{TRAINED}/config.json"))
    raw["text_config"]["output_gate_type"] = "silu"
    with pytest.raises(ValueError, match="output_gate_type 'silu'"):
        write_random_gguf(raw, str(tmp_path))
    with pytest.raises(ValueError, match="vocab_size is 256"):
        write_random_gguf(TRAINED, str(tmp_path), tokenizer=True)


def test_a_target_without_qsa_layers_has_no_pack(tmp_path):
    """Two GDN layers: the GGUF stores compress ratio 0 everywhere, so the tool writes no pack
    for it, and the reader refuses a pack (a QSA layer) for such a target by name."""
    raw = json.load(open(f"{TRAINED}/config.json"))
    t = raw["text_config"]
    t.update(num_hidden_layers=2, layer_types=t["layer_types"][:2])
    with pytest.raises(ValueError, match="no QSA .*--no-mtp"):
        write_random_gguf(raw, str(tmp_path / "a"))
    (target,) = write_random_gguf(raw, str(tmp_path / "a"), include_mtp=False)
    _, pack = write_random_gguf(TRAINED, str(tmp_path / "b"))
    with pytest.raises(ValueError, match="no QSA .*--speculative-algorithm none"):
        LLM(target["path"], speculative_draft_model_path=pack["path"])
