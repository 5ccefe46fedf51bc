"""GGUF files as tensor records and metadata, read with the ``gguf`` package's ``GGUFReader``.

:func:`open_gguf` parses the header (metadata and tensor infos) without touching tensor data
(the file is memory-mapped). Tensors become :class:`GGUFTensor` records: numpy-order shape
(GGUF stores dims innermost first; the record reverses them, so a linear's shape is ``[out,
in]`` as in HF), the ggml type, the absolute byte offset and size. ``GGUFReader`` refuses a
file holding a type its enum lacks, so the reader here records tensor infos itself, for every
type ``gguf.constants.GGML_QUANT_SIZES`` knows plus ``Q2_0`` (type 42,
:mod:`mtp_jax.weights.q2_0`); any other type id is a :class:`CheckpointError` naming the tensor.

:func:`read_tensor` dequantizes one tensor to float32 (``gguf.quants.dequantize`` for ggml's
block types, :func:`~mtp_jax.weights.q2_0.dequantize_q2_0` for Q2_0); :func:`tensor_view`
maps an unquantized tensor without a copy (the PLE tables' disk backend).
"""

from __future__ import annotations

import dataclasses

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

    return _Reader


def _value(field):
    value = field.contents()
    return value


def open_gguf(path: str) -> GGUFFile:
    """Parse ``path``'s header; :class:`CheckpointError` for an unreadable file or a tensor
    of an unknown type, or one whose bytes run past the end of the file."""
    try:
        r = _reader_class()(path, "r")
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any parse failure is a corrupt file to the user
        raise CheckpointError(f"{path}: cannot read the GGUF header ({type(e).__name__}: {e}); "
                              "the file is truncated or corrupt (an incomplete download?).") from None
    meta = {k: _value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for name, type_id, shape, offset, nbytes in r.tensor_records:
        if offset + nbytes > r.data.size:
            raise CheckpointError(f"{path}: tensor {name!r} ends at byte {offset + nbytes} but "
                                  f"the file has {r.data.size} bytes (truncated download?).")
        tensors[name] = GGUFTensor(name, path, type_id, shape, offset, nbytes)
    return GGUFFile(path, meta, tensors, r.data)


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
