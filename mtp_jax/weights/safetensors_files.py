"""The safetensors format of a checkpoint folder: headers, files and raw tensor bytes.

The format itself is parsed here: an 8-byte little-endian header length, a JSON header (``name
-> {dtype, shape, data_offsets}`` plus an optional ``__metadata__``), then the raw little-endian
data. Tensor bytes are reached through a read-only ``mmap`` of each file (:class:`_Files`), so
nothing is read until a tensor is asked for, and a truncated or corrupt file fails with a
message naming it. The mapping of stored names to the model's canonical names, and the checks
against a config, are in :mod:`mtp_jax.weights.safetensors_reader`.
"""

from __future__ import annotations

import glob
import json
import math
import mmap
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["CheckpointError", "TensorInfo", "read_header", "checkpoint_files",
           "list_tensor_names", "read_stored", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors format itself sets

# Stored dtypes this reader converts (little-endian, as the format prescribes).
_FLOAT_DTYPES: dict[str, np.dtype] = {
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
}
# Byte sizes of other known dtypes, used only to validate headers.
_OTHER_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
                   "I16": 2, "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "C64": 8}
# Stored dtypes that quantized formats read as they are (codes and scales).
_STORED_DTYPES: dict[str, np.dtype] = {**_FLOAT_DTYPES, "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
                                       "U8": np.dtype("u1"), "I64": np.dtype("<i8")}

class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file(s) and tensor(s)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry. ``start``/``end`` are absolute byte offsets in ``file``.

    ``quant``: for a logical entry made by :func:`mtp_jax.weights.quant_tensors.group_quantized`
    (a quantized weight and its scales; ``dtype`` is then ``F32``, ``shape`` the dequantized
    one), the object whose ``read(files)`` dequantizes it; None for a stored tensor."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int
    quant: Any = None


# --------------------------------------------------------------------------------------------
# Files and headers
# --------------------------------------------------------------------------------------------

def _no_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise CheckpointError(f"duplicate key {k!r}")
        out[k] = v
    return out


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate the header of one ``.safetensors`` file (no tensor data is read).

    Raises :class:`CheckpointError` naming the file if it is short, truncated, or its header is
    not valid safetensors JSON.
    """
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: {why}. The file is truncated or corrupt (an incomplete "
                               "download?); fetch it again.")

    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"only {size} bytes long, too short for a safetensors header")
            hlen = int.from_bytes(head, "little")
            if hlen > size - 8:
                raise bad(f"header length field says {hlen} bytes but only {size - 8} bytes "
                          "follow it")
            if hlen > _MAX_HEADER_BYTES:
                raise bad(f"header length {hlen} exceeds the format's {_MAX_HEADER_BYTES}-byte "
                          "limit")
            raw = f.read(hlen)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except CheckpointError as e:
        raise bad(f"header JSON has a {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")

    data_start = 8 + hlen
    data_len = size - data_start
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(meta, dict):
            raise bad(f"header entry {name!r} is not an object")
        dtype, shape, offs = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if not isinstance(dtype, str):
            raise bad(f"tensor {name!r} has no dtype string")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                           for d in shape)):
            raise bad(f"tensor {name!r} has invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise bad(f"tensor {name!r} has invalid data_offsets {offs!r}")
        if offs[1] > data_len:
            raise bad(f"tensor {name!r} ends at data byte {offs[1]} but the data section holds "
                      f"only {data_len} bytes")
        itemsize = (_FLOAT_DTYPES[dtype].itemsize if dtype in _FLOAT_DTYPES
                    else _OTHER_ITEMSIZE.get(dtype))
        if itemsize is not None and offs[1] - offs[0] != math.prod(shape) * itemsize:
            raise bad(f"tensor {name!r} ({dtype}, shape {shape}) needs "
                      f"{math.prod(shape) * itemsize} bytes but its data_offsets span "
                      f"{offs[1] - offs[0]}")
        out[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + offs[0],
                               data_start + offs[1])
    return out


def _read_index(folder: str) -> dict[str, str] | None:
    """``weight_map`` of the folder's index file, or None when there is none."""
    path = os.path.join(folder, INDEX_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot parse {path}: {e}. Fetch the index file again.") from e
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in wm.items()):
        raise CheckpointError(f"{path} has no valid 'weight_map' (tensor name -> shard file).")
    return wm


def checkpoint_files(folder: str) -> tuple[list[str], dict[str, str] | None]:
    """The folder's safetensors files (names relative to ``folder``) and its index weight_map.

    Order of preference: ``model.safetensors.index.json`` (the shards it names, whether or not
    they exist on disk), a single ``model.safetensors``, every ``*.safetensors``. Raises
    :class:`CheckpointError` when the folder holds none.
    """
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint path {folder!r} is not a folder.")
    wm = _read_index(folder)
    if wm is not None:
        return sorted(set(wm.values())), wm
    if os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        return [SINGLE_FILE], None
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{folder} holds no {INDEX_FILE}, no {SINGLE_FILE} and no "
                              "*.safetensors files; pass a folder with the checkpoint's weights.")
    return files, None


def list_tensor_names(folder: str) -> dict[str, str]:
    """Disk tensor name -> file name (relative to ``folder``), reading only metadata.

    With an index file this is its ``weight_map`` (no shard is opened, so it works on a
    partially downloaded folder); otherwise the headers of the safetensors files are read (if two
    files hold one name, the first file in sorted order is reported).
    """
    files, wm = checkpoint_files(folder)
    if wm is not None:
        return dict(wm)
    out: dict[str, str] = {}
    for fn in files:
        for name in read_header(os.path.join(folder, fn)):
            out.setdefault(name, fn)
    return out


# --------------------------------------------------------------------------------------------
# Messages
# --------------------------------------------------------------------------------------------

# ---- tensor bytes ----------------------------------------------------------------------------

def _read_raw(mm: mmap.mmap, t: TensorInfo) -> np.ndarray:
    """A read-only view of one stored tensor in its stored dtype (no copy)."""
    dt = _STORED_DTYPES[t.dtype]
    return np.frombuffer(mm, dtype=dt, count=math.prod(t.shape), offset=t.start).reshape(t.shape)


class _Files:
    """Lazily opened read-only maps of the checkpoint files; close() releases them."""

    def __init__(self):
        self._open: dict[str, tuple[Any, mmap.mmap | None]] = {}

    def get(self, path: str) -> mmap.mmap | None:
        if path not in self._open:
            f = open(path, "rb")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(
                f.fileno()).st_size else None
            self._open[path] = (f, mm)
        return self._open[path][1]

    def close(self, path: str | None = None) -> None:
        """Release one file's map (``path``) or all of them."""
        for p in ([path] if path is not None else list(self._open)):
            if p not in self._open:
                continue
            f, mm = self._open.pop(p)
            if mm is not None:
                try:
                    mm.close()
                except BufferError:  # a view is still alive somewhere; GC releases the map
                    pass
            f.close()


def read_stored(files: _Files, t: TensorInfo) -> np.ndarray:
    """One stored tensor in its stored dtype (float, F8_E4M3 as ``ml_dtypes.float8_e4m3fn``,
    U8, I64): a read-only view of the file's map."""
    if math.prod(t.shape) == 0:
        return np.zeros(t.shape, _STORED_DTYPES[t.dtype])
    return _read_raw(files.get(t.file), t)


def _read(files: _Files, t: TensorInfo) -> np.ndarray:
    """A tensor's values: stored floats as they are, a quantized logical entry dequantized
    (float32)."""
    if t.quant is not None:
        return t.quant.read(files)
    return read_stored(files, t)
