"""A GGUF checkpoint folder as the model path (mtp_jax/weights/gguf_header.py): its one target
(an architecture not ending in ``-mtp``) is the model, whatever the files' names sort as, and
its one Strata pack is the MTP draft when no draft path is given, as a safetensors folder's own
``mtp.*`` tensors are; the folder as a draft path is its pack. Several targets, or several packs
without a draft path, are refused before any tensor data is read, naming the files; the refusal
of a target without a draft names the packs beside it (or says there are none), never a
placeholder file.

Teeth (shown by hand, then restored): with ``gguf_file`` taking a folder's first ``*.gguf`` as
before, test_folder_is_its_target_with_its_pack fails (the pack, sorted first, is taken as the
target and refused); without the folder's pack as the default draft, it fails with "carries no
MTP draft"."""

import os
import shutil

import numpy as np
import pytest
from flax import nnx

from mtp_jax import LLM
from mtp_jax.config import ConfigError
from mtp_jax.models.checks import read_model_config
from mtp_jax.models.loader import load_model
from mtp_jax.weights.gguf_header import folder_pack, gguf_draft_file, gguf_file
from tests.gguf.test_gguf_refusals import gguf_spy  # noqa: F401 - a fixture
from tests.gguf.writer import write_pack, write_target
from tests.helpers.paths import fixture_path
from tests.helpers.refusals import weight_spy  # noqa: F401 - a fixture

CKPT = fixture_path("tiny_qwen4_exp")


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """One target and one pack, written once; each test's folder holds copies of them."""
    d = tmp_path_factory.mktemp("gguf_made")
    return dict(target=write_target(CKPT, str(d / "t.gguf")),
                pack=write_pack(CKPT, str(d / "p.gguf")))


def _folder(root, made, **files):
    """``root`` holding ``files`` (name -> "target" | "pack"), copies of ``made``'s."""
    os.makedirs(root, exist_ok=True)
    for name, kind in files.items():
        shutil.copy(made[kind], os.path.join(root, name))
    return str(root)


def _flat(m):
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(m.params)}


def test_folder_is_its_target_with_its_pack(made, tmp_path):
    d = _folder(tmp_path / "g", made, **{"a-mtp.gguf": "pack", "z.gguf": "target"})
    assert gguf_file(d) == f"{d}/z.gguf" and folder_pack(d) == f"{d}/a-mtp.gguf"
    assert gguf_draft_file(d) == f"{d}/a-mtp.gguf"
    assert read_model_config(d, mtp=True).mtp_num_hidden_layers == 1
    assert read_model_config(d, mtp=False).mtp_num_hidden_layers == 0
    got = load_model(d, "float32")
    want = load_model(made["target"], "float32", draft_path=made["pack"])
    assert got.has_mtp and want.has_mtp
    a, b = _flat(got), _flat(want)
    assert set(a) == set(b) and any(k.startswith("mtp") for k in a)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    # the folder as a draft path is its pack
    cfg = read_model_config(made["target"], mtp=True, draft_path=d)
    assert cfg.mtp_num_hidden_layers == 1
    assert not load_model(d, "float32", with_mtp=False).has_mtp


@pytest.mark.parametrize("files, kwargs, pattern", [
    ({"t1.gguf": "target", "t2.gguf": "target", "p.gguf": "pack"}, {},
     r"g holds 2 target GGUF files \(t1\.gguf, t2\.gguf\), so the folder does not say which to "
     r"load; pass the file's path as the model, e.g\. \S*/g/t1\.gguf\."),
    ({"t1.gguf": "target", "t2.gguf": "target"}, dict(speculative_algorithm="none"),
     r"holds 2 target GGUF files \(t1\.gguf, t2\.gguf\)"),
    ({"t.gguf": "target", "p1.gguf": "pack", "p2.gguf": "pack"}, {},
     r"g holds 2 Strata MTP packs \(p1\.gguf, p2\.gguf\), so the folder does not say which "
     r"drafts; pass one as --speculative-draft-model-path .*e\.g\. \S*/g/p1\.gguf\."),
    ({"t.gguf": "target"}, {},
     r"t\.gguf is a Flash-Next GGUF target, which carries no MTP draft .*--speculative-draft-"
     r"model-path PACK\.gguf \(.*; \S*/g holds none\), or run without speculation"),
])
def test_folder_refusals_name_the_files(made, tmp_path, gguf_spy, files, kwargs,  # noqa: F811
                                        pattern):
    d = _folder(tmp_path / "g", made, **files)
    with pytest.raises(ConfigError, match=pattern) as e:
        LLM(d, dtype="float32", **kwargs)
    assert "mtp-q2_0" not in str(e.value)
    assert gguf_spy.data == [], f"tensor data was read: {gguf_spy.data}"


def test_several_packs_with_a_draft_path(made, tmp_path):
    d = _folder(tmp_path / "g", made, **{"t.gguf": "target", "p1.gguf": "pack",
                                         "p2.gguf": "pack"})
    cfg = read_model_config(d, mtp=True, draft_path=f"{d}/p2.gguf")
    assert cfg.mtp_num_hidden_layers == 1
    assert read_model_config(d, mtp=False).mtp_num_hidden_layers == 0


def test_target_file_refusal_names_the_pack_beside_it(made, tmp_path, gguf_spy):  # noqa: F811
    d = _folder(tmp_path / "g", made, **{"model.gguf": "target", "mtp.gguf": "pack"})
    with pytest.raises(ConfigError, match=rf"--speculative-draft-model-path {d}/mtp\.gguf "
                                          r"\(speculative_draft_model_path=\.\.\.; the Strata "
                                          r"pack beside the target\)"):
        LLM(f"{d}/model.gguf", dtype="float32")
    assert gguf_spy.data == []


def test_model_line_names_the_target_and_its_pack(made, tmp_path):
    """The CLI's ``[model]`` line names a GGUF run's target file and the pack it drafts with
    (the folder's, or the draft path's); nothing for speculation off or a safetensors
    folder."""
    from argparse import Namespace
    from types import SimpleNamespace

    from mtp_jax.cli_report import gguf_note

    d = _folder(tmp_path / "g", made, **{"a-mtp.gguf": "pack", "z.gguf": "target"})
    on, off = (SimpleNamespace(speculative=SimpleNamespace(enabled=e)) for e in (True, False))
    args = Namespace(model=d, speculative_draft_model_path=None)
    assert gguf_note(args, on) == f"; GGUF target z.gguf, draft: Strata pack {d}/a-mtp.gguf"
    assert gguf_note(args, off) == "; GGUF target z.gguf"
    args = Namespace(model=made["target"], speculative_draft_model_path=made["pack"])
    assert gguf_note(args, on).endswith(f"draft: Strata pack {made['pack']}")
    assert gguf_note(Namespace(model=CKPT, speculative_draft_model_path=None), on) == ""
