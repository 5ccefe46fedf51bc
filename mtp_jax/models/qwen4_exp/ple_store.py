"""Host-side PLE n-gram tables: where the rows a step needs are read from.

The real tables hold ~51B parameters (~100 GB bf16), so by default they never go to the
accelerator. The backends give bitwise-identical rows (same stored bytes, same conversion):

* ``memory``: the shards are copied once into one host array; a lookup is a numpy gather.
* ``disk`` (default): the shard tensors are memory-mapped straight from the checkpoint's
  safetensors files; a lookup touches only the pages of the rows it reads.
* ``device``: on the host as ``disk`` (memory-mapped, for the host lookups of the research API);
  :meth:`NgramTable.device_rows` gives the whole table, which the loader copies to the
  accelerator, where the programs look their rows up with no host callback
  (:mod:`~mtp_jax.models.qwen4_exp.ple_device`). Needs the tables to fit: ``rows *
  ple_embed_dim / ((ngram_size - 1) * heads_per_ngram)`` values of the model dtype per PLE layer.

A table is the concatenation (dim 0) of its ``split_ngram_parts`` stored shards
``...ngram_embedding.shard_{j}.weight`` in shard order (or one unsharded ``...weight``).
"""

from __future__ import annotations

import math

import numpy as np

from mtp_jax.weights.safetensors_files import _FLOAT_DTYPES, TensorInfo

PLE_BACKENDS = ("disk", "memory", "device")
# What LLM / the CLI take: the three above, or "auto" (the default: ple_device.choose_backend).
PLE_CHOICES = ("auto",) + PLE_BACKENDS
_FEW_ROWS = 256  # up to this many rows a lookup copies row by row (less numpy per call)


def _memmap(t: TensorInfo) -> np.ndarray:
    """The stored tensor mapped read-only, as a plain ndarray view (indexing a
    ``np.memmap`` makes a memmap object per call, a cost a round's lookup pays per part)."""
    return np.memmap(t.file, dtype=_FLOAT_DTYPES[t.dtype], mode="r", offset=t.start,
                     shape=tuple(t.shape)).view(np.ndarray)


class NgramTable:
    """One PLE layer's n-gram table over its stored shards."""

    def __init__(self, shards: list[TensorInfo], backend: str, out_dtype):
        if backend not in PLE_BACKENDS:
            raise ValueError(f"ple_backend {backend!r} is unknown; use one of "
                             f"{', '.join(PLE_BACKENDS)} (disk: memory-mapped checkpoint files, "
                             "memory: tables copied into host RAM, device: tables copied to "
                             "the accelerator, looked up inside the programs).")
        self.backend, self.out_dtype = backend, np.dtype(out_dtype)
        self.dim = shards[0].shape[1]
        sizes = [t.shape[0] for t in shards]
        self.starts = np.cumsum([0] + sizes)[:-1]
        self.rows = int(sum(sizes))
        maps = [_memmap(t) for t in shards]
        if backend == "memory":
            self._parts = [np.concatenate([np.asarray(m) for m in maps], axis=0)]
            self._starts = np.zeros(1, np.int64)
        else:
            self._parts, self._starts = maps, self.starts

    @property
    def parts(self) -> tuple[list[np.ndarray], np.ndarray]:
        """The stored arrays a lookup reads (``[rows_j, dim]`` each, the stored dtype) and the
        first row id of each (int64): one array for ``memory``, the shards otherwise."""
        return self._parts, np.asarray(self._starts, np.int64)

    @property
    def nbytes(self) -> int:
        return sum(p.size * p.dtype.itemsize for p in self._parts)

    def device_rows(self) -> np.ndarray:
        """The whole table ``[rows, dim]`` in ``out_dtype`` (a host copy, made per call: the
        ``device`` backend's loader copies it to the accelerator once). Row ``i`` equals
        ``lookup([i])`` bit for bit (the same stored bytes, the same numpy cast)."""
        if len(self._parts) == 1:
            return np.asarray(self._parts[0]).astype(self.out_dtype)
        out = np.empty((self.rows, self.dim), self.out_dtype)
        for s, p in zip(self._starts.tolist(), self._parts):
            out[s:s + p.shape[0]] = p
        return out

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """``ids [...]`` int64 row ids -> rows ``[..., dim]`` in ``out_dtype``."""
        ids = np.asarray(ids, np.int64)
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"n-gram row id outside the table of {self.rows} rows")
        out = np.empty((flat.size, self.dim), self.out_dtype)
        if len(self._parts) == 1:
            out[:] = self._parts[0][flat]
            return out.reshape(*ids.shape, self.dim)
        which = np.searchsorted(self._starts, flat, side="right") - 1
        local = flat - self._starts[which]
        if flat.size <= _FEW_ROWS:  # a round's few rows: one row copy each
            for i, (j, r) in enumerate(zip(which.tolist(), local.tolist())):
                out[i] = self._parts[j][r]
        else:  # a prompt's many rows: one gather per part
            for j in np.unique(which).tolist():
                sel = which == j
                out[sel] = self._parts[j][local[sel]]
        return out.reshape(*ids.shape, self.dim)


def concat_rows_per_token(rows: np.ndarray) -> np.ndarray:
    """``[B, T, heads, d]`` -> ``[B, T, heads*d]`` (the PLE module's input)."""
    return rows.reshape(*rows.shape[:-2], math.prod(rows.shape[-2:]))
