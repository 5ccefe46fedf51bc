"""The GGUF rules at config time (mtp_jax/models/gguf_checks.py): each refusal fires before any
tensor data is read (safetensors or GGUF), names the file and gives advice that works.
The Qwen3.5-family GGUF cases are in tests/checks/test_config_checks.py."""

import gguf
import numpy as np
import pytest

from mtp_jax import LLM
from mtp_jax.config import ConfigError
from mtp_jax.models import checks
from mtp_jax.models.loader import load_model
from mtp_jax.models.qwen4_exp import gguf_loader
from tests.gguf.writer import write_pack, write_target
from tests.helpers.paths import fixture_path
from tests.helpers.refusals import weight_spy  # noqa: F401 - a fixture

CKPT = fixture_path("tiny_qwen4_exp")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_rules")
    return dict(target=write_target(CKPT, str(d / "t.gguf")),
                nextn=write_target(CKPT, str(d / "n.gguf"), nextn=True),
                pack=write_pack(CKPT, str(d / "mtp.gguf")),
                not_pack=write_pack(CKPT, str(d / "x.gguf"), arch="qwen4exp"),
                dir=str(d))


@pytest.fixture
def gguf_spy(monkeypatch, weight_spy):  # noqa: F811
    """``weight_spy`` plus every GGUF tensor read (data) by the qwen4exp loader."""
    real_read, real_ple = gguf_loader.read_tensor, gguf_loader._ple

    def spy_read(g, t):
        weight_spy.data.append(t.name)
        return real_read(g, t)

    def spy_ple(*a):
        weight_spy.data.append("per_layer_token_embd")
        return real_ple(*a)

    monkeypatch.setattr(gguf_loader, "read_tensor", spy_read)
    monkeypatch.setattr(gguf_loader, "_ple", spy_ple)
    return weight_spy


def _wrong_pack(d):
    """A pack whose mtp.fc_hidden is [H, 2H]: shapes that do not fit the target."""
    w = gguf.GGUFWriter(f"{d}/wrong.gguf", "qwen4exp-mtp")
    w.add_tensor("mtp.fc_hidden.weight", np.zeros((32, 64), np.float32))
    w.add_tensor("mtp.layers.0.mlp.gate.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return f"{d}/wrong.gguf"


def _unknown_key(d):
    path = f"{d}/unknown.gguf"
    write_target(CKPT, path)
    r = gguf.GGUFReader(path)
    w = gguf.GGUFWriter(f"{d}/u2.gguf", "qwen4exp")
    w.add_float32("qwen4exp.rope.scaling.factor", 4.0)
    for k, f in r.fields.items():
        if k.startswith("qwen4exp.") and f.types[0] != gguf.GGUFValueType.ARRAY:
            v = f.contents()
            (w.add_uint32 if isinstance(v, int) else w.add_float32)(k, v)
    w.add_tensor("token_embd.weight", np.zeros((256, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return f"{d}/u2.gguf"


CASES = [
    ("target_without_draft", lambda f: dict(model=f["target"]),
     r"t\.gguf is a Flash-Next GGUF target, which carries no MTP draft .*nextn blocks are never "
     r"read as a draft\): pass a Strata MTP pack, --speculative-draft-model-path (one of )?/"
     r"\S*/mtp\.gguf.*the Strata pack beside the target\), or run without speculation "
     r"\(--speculative-algorithm none\)"),
    ("target_with_folder_draft", lambda f: dict(model=f["target"],
                                                speculative_draft_model_path=CKPT),
     r"is a GGUF target, which reads its MTP draft from a Strata MTP pack .*is not a GGUF file"),
    ("draft_without_mtp", lambda f: dict(model=f["target"],
                                         speculative_draft_model_path=f["nextn"]),
     r"n\.gguf' \(qwen4exp\) holds no mtp\.\* tensors, so it cannot supply the MTP draft "
     r"\(llama\.cpp's nextn blocks are never read as a draft\); pass a Strata MTP pack"),
    ("draft_not_a_pack", lambda f: dict(model=f["target"],
                                        speculative_draft_model_path=f["not_pack"]),
     r"is a GGUF of architecture 'qwen4exp', not a Strata MTP pack \('qwen4exp-mtp'\)"),
    ("pack_wrong_shapes", lambda f: dict(model=f["target"],
                                         speculative_draft_model_path=_wrong_pack(f["dir"])),
     r"(?s)wrong\.gguf' does not fit this target .*mtp\.fc_hidden\.weight has shape \[32, 64\] "
     r"\(F32\), the target needs \[32, 32\].*tensor\(s\) missing: mtp\.fc_embedding\.weight"),
    ("pack_for_safetensors_target", lambda f: dict(speculative_draft_model_path=f["pack"]),
     r"mtp\.gguf' is a GGUF \(qwen4exp-mtp\); a Strata MTP pack drafts for a Flash-Next GGUF "
     r"target only, .*Omit the path"),
    ("pack_as_target", lambda f: dict(model=f["pack"]),
     r"mtp\.gguf is a Strata MTP pack \(a draft\), not a target"),
    ("unknown_metadata", lambda f: dict(model=_unknown_key(f["dir"]),
                                        speculative_algorithm="none"),
     r"qwen4exp metadata mtp_jax does not know: \['qwen4exp\.rope\.scaling\.factor'\]"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_tensor_data(case, files, gguf_spy):
    name, build, pattern = case
    kwargs = build(files)
    model = kwargs.pop("model", CKPT)
    with pytest.raises(ConfigError, match=pattern):
        LLM(model, dtype="float32", **kwargs)
    assert gguf_spy.data == [], f"{name}: tensor data was read: {gguf_spy.data}"
    assert all(p.endswith(".gguf") for p in gguf_spy.opened), gguf_spy.opened


def test_load_model_applies_the_rules(files, gguf_spy):
    with pytest.raises(ConfigError, match="pass a Strata MTP pack"):
        load_model(files["target"], "float32")
    with pytest.raises(ConfigError, match="holds no mtp"):
        load_model(files["target"], "float32", draft_path=files["nextn"])
    assert gguf_spy.data == []


def test_the_advice_works(files):
    """'run without speculation' loads the target; 'pass a Strata MTP pack' gives its config
    the pack's MTP layer (the engine runs of test_gguf_target.py load it)."""
    m = load_model(files["target"], "float32", with_mtp=False)
    assert not m.has_mtp and m.cfg.num_hidden_layers == 5
    cfg = checks.read_model_config(files["target"], mtp=True, draft_path=files["pack"])
    assert cfg.mtp_num_hidden_layers == 1
