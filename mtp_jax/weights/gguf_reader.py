"""GGUF files as tensor records and metadata, read with the ``gguf`` package's ``GGUFReader``.

:func:`open_gguf` parses the header (metadata and tensor infos) without touching tensor data
(the file is memory-mapped). Tensors become :class:`GGUFTensor` records: numpy-order shape
(GGUF stores dims innermost first; the record reverses them, so a linear's shape is ``[out,
in]`` as in HF), the ggml type, the absolute byte offset and size. ``GGUFReader`` refuses a
file holding a type its enum lacks, so the reader here records tensor infos itself, for every
type ``gguf.constants.GGML_QUANT_SIZES`` knows plus ``Q2_0`` (type 42,
:mod:`mtp_jax.weights.q2_0`); any other type id is a :class:`CheckpointError` naming the tensor.

Metadata arrays (a tokenizer's ~250k tokens and ~500k merges) are read in one pass over the
mapped bytes rather than ``GGUFReader``'s one numpy view per element (26 s for a Qwen
vocabulary on a slow CPU, well under one here), and the last few parsed headers are reused while
their file is unchanged (path, size, mtime), so the config, checks, tokenizer and loader that
each open the file parse it once.

:func:`read_tensor` dequantizes one tensor to float32 (``gguf.quants.dequantize`` for ggml's
block types, :func:`~mtp_jax.weights.q2_0.dequantize_q2_0` for Q2_0); :func:`tensor_view`
maps an unquantized tensor without a copy (the PLE tables' disk backend).
"""

from __future__ import annotations

import dataclasses
import os
import struct

import ml_dtypes
import numpy as np

from mtp_jax.weights.q2_0 import Q2_0_BLOCK, Q2_0_BYTES, Q2_0_TYPE, dequantize_q2_0
from mtp_jax.weights.safetensors_files import CheckpointError

__all__ = ["GGUFTensor", "GGUFFile", "open_gguf", "read_tensor", "tensor_view", "type_name"]

# Unquantized ggml types -> numpy dtype of their elements.
_PLAIN = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 30: np.dtype(ml_dtypes.bfloat16),
          28: np.dtype("<f8")}
_INTS = {24: "I8", 25: "I16", 26: "I32", 27: "I64"}


def _sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES
    out = {int(t): v for t, v in GGML_QUANT_SIZES.items()}
    out[Q2_0_TYPE] = (Q2_0_BLOCK, Q2_0_BYTES)
    return out


def type_name(type_id: int) -> str:
    """ggml type name of ``type_id`` (``Q2_0`` for 42, ``type 99`` for an unknown id)."""
    if type_id == Q2_0_TYPE:
        return "Q2_0"
    from gguf.constants import GGMLQuantizationType
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: ``shape`` in numpy order (ggml dims reversed), ``type_id``
    the ggml type, ``offset`` / ``nbytes`` its absolute byte range in ``file``."""

    name: str
    file: str
    type_id: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type(self) -> str:
        return type_name(self.type_id)


@dataclasses.dataclass
class GGUFFile:
    """A parsed GGUF header: ``metadata`` (key -> Python value), ``tensors`` (name -> record)
    and ``data`` (the whole file memory-mapped read-only, uint8)."""

    path: str
    metadata: dict
    tensors: dict[str, GGUFTensor]
    data: np.ndarray

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


def _reader_class():
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        """``GGUFReader`` that records tensor infos of any type with a known block size."""

        def _build_tensors(self, start_offs, fields):  # noqa: D401 - overrides the package's
            sizes, records = _sizes(), []
            for field in fields:
                _, name_data, _, dims, raw_type, rel = field.parts
                name = bytes(name_data).decode("utf-8")
                type_id = int(raw_type[0])
                if type_id not in sizes:
                    raise CheckpointError(f"tensor {name!r} has ggml type id {type_id}, which "
                                          "mtp_jax cannot read (known: the gguf package's types "
                                          "and Q2_0 = 42); re-quantize it to a known type.")
                block, nbytes_block = sizes[type_id]
                shape = tuple(int(d) for d in reversed(dims.tolist()))
                n = int(np.prod(shape)) if shape else 1
                if shape and shape[-1] % block:
                    raise CheckpointError(f"tensor {name!r} ({type_name(type_id)}) has an inner "
                                          f"dimension {shape[-1]} that is not a multiple of its "
                                          f"block of {block} values; the file is corrupt.")
                records.append((name, type_id, shape, int(start_offs + rel[0]),
                                n // block * nbytes_block))
            self.tensor_records = records
            self.tensors = []

        def _build_fields(self, offs, count):  # noqa: D401 - overrides the package's
            """The package's field parsing, but arrays of strings or numbers in one pass
            (values kept in ``self.arrays``; their ``ReaderField`` has no parts)."""
            self.arrays = getattr(self, "arrays", {})
            for _ in range(int(count)):
                got = _fast_array(self, offs) if self.byte_order == "I" else None
                if got is None:
                    offs = super()._build_fields(offs, 1)
                    continue
                key, values, end, item_type = got
                self.arrays[key] = values
                self._push_field(_field(offs, key, item_type), skip_sum=True)
                offs = end
            return offs

    return _Reader


_U64 = struct.Struct("<Q")
_ARRAY, _STRING = 9, 8  # GGUF value types


def _field(offset: int, key: str, item_type: int):
    from gguf.constants import GGUFValueType
    from gguf.gguf_reader import ReaderField
    return ReaderField(offset, key, [], [], [GGUFValueType.ARRAY, GGUFValueType(item_type)])


def _strings(buf: memoryview, start: int, n: int) -> tuple[list[str], int]:
    """``n`` GGUF strings (u64 length, UTF-8 bytes) from byte ``start``: (values, end)."""
    out, off, unpack = [], start, _U64.unpack_from
    for _ in range(n):
        (length,) = unpack(buf, off)
        off += 8
        out.append(str(buf[off:off + length], "utf-8"))
        off += length
    return out, off


def _fast_array(r, offs: int):
    """``(key, values, end, item type)`` of the metadata field at ``offs`` when it is an
    array of strings or scalars (little-endian file), else None (the package parses it)."""
    buf = memoryview(r.data)
    (klen,) = _U64.unpack_from(buf, offs)
    vstart = offs + 8 + klen
    if struct.unpack_from("<I", buf, vstart)[0] != _ARRAY:
        return None
    key = str(buf[offs + 8:vstart], "utf-8")
    item_type = struct.unpack_from("<I", buf, vstart + 4)[0]
    (n,) = _U64.unpack_from(buf, vstart + 8)
    start = vstart + 16
    if item_type == _STRING:
        values, end = _strings(buf, start, n)
        return key, values, end, item_type
    from gguf.constants import GGUFValueType
    try:
        np_type = r.gguf_scalar_to_np.get(GGUFValueType(item_type))
    except ValueError:
        return None
    if np_type is None:
        return None
    arr = r._get(start, np_type, n)
    return key, arr.tolist(), start + int(arr.nbytes), item_type


def _parse(path: str) -> GGUFFile:
    try:
        r = _reader_class()(path, "r")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file to the user
        raise CheckpointError(f"{path}: cannot read the GGUF header ({type(e).__name__}: {e}); "
                              "the file is truncated or corrupt (an incomplete download?).") from None
    arrays = getattr(r, "arrays", {})
    meta = {k: arrays[k] if k in arrays else f.contents() for k, f in r.fields.items()
            if not k.startswith("GGUF.")}
    tensors = {}
    for name, type_id, shape, offset, nbytes in r.tensor_records:
        if offset + nbytes > r.data.size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {offset + nbytes} but "
                                  f"the file has {r.data.size} bytes (truncated download?).")
        tensors[name] = GGUFTensor(name, path, type_id, shape, offset, nbytes)
    return GGUFFile(path, meta, tensors, r.data)


_PARSED: dict = {}  # (real path, inode, size, mtime) -> GGUFFile; the last few headers
_KEEP = 4


def open_gguf(path: str) -> GGUFFile:
    """Parse ``path``'s header (or reuse its last parse while the file is unchanged);
    :class:`CheckpointError` for an unreadable file or a tensor of an unknown type, or one
    whose bytes run past the end of the file. The returned record is shared: do not modify
    it."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the GGUF file ({e}).") from None
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _PARSED:
        g = _parse(path)
        while len(_PARSED) >= _KEEP:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = g
    g = _PARSED[key]
    return g if g.path == path else dataclasses.replace(
        g, tensors={n: dataclasses.replace(t, file=path) for n, t in g.tensors.items()},
        path=path)


def tensor_view(g: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """An unquantized (F32 / F16 / BF16 / F64) tensor as a read-only view of the mapped file,
    ``t.shape`` in its stored dtype; no copy. ``CheckpointError`` for other types."""
    if t.type_id not in _PLAIN:
        raise CheckpointError(f"{t.name} is stored as {t.type}; only F32/F16/BF16/F64 tensors "
                              "can be mapped without dequantizing.")
    raw = g.data[t.offset:t.offset + t.nbytes]
    return raw.view(_PLAIN[t.type_id]).reshape(t.shape).view(np.ndarray)


def read_tensor(g: GGUFFile, t: GGUFTensor) -> np.ndarray:
    """Tensor ``t`` dequantized to float32, ``t.shape``: unquantized types converted, ggml block
    types through ``gguf.quants.dequantize``, Q2_0 through
    :func:`~mtp_jax.weights.q2_0.dequantize_q2_0`. Integer tensors are refused."""
    if t.type_id in _PLAIN:
        return tensor_view(g, t).astype(np.float32)
    if t.type_id in _INTS:
        raise CheckpointError(f"{t.name} is stored as {_INTS[t.type_id]}, an integer type; "
                              "a weight must be a float or a ggml block type.")
    raw = np.asarray(g.data[t.offset:t.offset + t.nbytes])
    if t.type_id == Q2_0_TYPE:
        return dequantize_q2_0(raw, t.shape)
    from gguf import quants
    from gguf.constants import GGMLQuantizationType
    qtype = GGMLQuantizationType(t.type_id)
    try:
        out = quants.dequantize(raw.reshape(quants.quant_shape_to_byte_shape(t.shape, qtype)),
                                qtype)
    except NotImplementedError:
        raise CheckpointError(f"{t.name} is stored as {t.type}, which the gguf package cannot "
                              "dequantize; re-quantize the file to a supported type.") from None
    return np.asarray(out, np.float32).reshape(t.shape)
