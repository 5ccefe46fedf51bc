"""Helpers of the refusal tests: a spy that records weight-file access, checkpoint copies to
corrupt, and tiny GGUF / raw safetensors writers."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import types

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from mtp_jax.weights import safetensors_files as st
from tests.helpers.paths import fixture_path

MOE = fixture_path("tiny_moe_fused")
DENSE = fixture_path("tiny_dense")
WEIGHT_SUFFIXES = (".safetensors", ".gguf")


@pytest.fixture
def weight_spy(monkeypatch):
    """Records every ``open`` of a ``*.safetensors`` / ``*.gguf`` file (``opened``) and every
    tensor-data access of the reader (``data``: its mmap and raw-read functions)."""
    rec = types.SimpleNamespace(opened=[], data=[])
    real_open = builtins.open

    def spy_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).endswith(WEIGHT_SUFFIXES):
            rec.opened.append(os.fspath(file))
        return real_open(file, *a, **k)

    real_get, real_raw = st._Files.get, st._read_raw

    def spy_get(self, path):
        rec.data.append(path)
        return real_get(self, path)

    def spy_raw(mm, t):
        rec.data.append(t.name)
        return real_raw(mm, t)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(st._Files, "get", spy_get)
    monkeypatch.setattr(st, "_read_raw", spy_raw)
    return rec


def copy_ckpt(src: str, dst) -> str:
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        os.chmod(os.path.join(dst, f), 0o644)
    return str(dst)


def edit_config(folder, **changes) -> None:
    path = os.path.join(folder, "config.json")
    cfg = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(path, "w"))


def config_only(src: str, dst, **changes) -> str:
    """A folder holding only ``src``'s config.json (edited): no weights at all."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    edit_config(dst, **changes)
    return str(dst)


def split_moe(root) -> tuple[str, str]:
    """tiny_moe_fused split into a target folder (no mtp.*) and a draft folder (mtp.* only,
    with the same config.json)."""
    tensors = load_file(os.path.join(MOE, "model.safetensors"))
    target, draft = os.path.join(root, "target"), os.path.join(root, "draft")
    for d, keep in ((target, lambda k: not k.startswith("mtp.")),
                    (draft, lambda k: k.startswith("mtp."))):
        os.makedirs(d)
        shutil.copy(os.path.join(MOE, "config.json"), os.path.join(d, "config.json"))
        save_file({k: v for k, v in tensors.items() if keep(k)},
                  os.path.join(d, "model.safetensors"))
    return target, draft


def write_gguf(path, arch: str) -> str:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def write_raw_safetensors(path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file of arbitrary stored dtypes (``name -> (dtype, shape, bytes)``)."""
    header, blobs, off = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
