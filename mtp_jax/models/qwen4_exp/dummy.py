"""Random weights for qwen4_exp (``dummy_weight=True``, the bench's ``--config`` rows).

The dense tensors are drawn as every family's (:func:`mtp_jax.models.params.random_arrays`).
The PLE n-gram tables of a real shape hold about 100 GB, so they are not drawn: a
:class:`SyntheticTable` answers a lookup of row ``i`` with row ``i mod BASE_ROWS`` of one small
random table, at the cost of a host gather like the ``memory`` backend's (not a disk read:
the bench's lookups are not the ``disk`` backend's). With ``ple_backend="device"`` the small
table goes to the accelerator and the programs read row ``i mod BASE_ROWS`` of it there
(:meth:`SyntheticTable.device_rows`). The hash constants are the config's.
"""

from __future__ import annotations

import numpy as np

from mtp_jax.models.loaded import DTYPES, NP_DTYPES
from mtp_jax.models.params import random_arrays
from mtp_jax.models.qwen4_exp.config import (head_offsets, head_vocab_sizes, layer_multipliers,
                                             ngram_table_rows)
from mtp_jax.models.qwen4_exp.loaded import PLEHost

__all__ = ["BASE_ROWS", "SyntheticTable", "read_random"]

BASE_ROWS = 4096


class SyntheticTable:
    """A stand-in n-gram table of ``rows`` rows of ``dim`` values (``out_dtype``): row ``i``
    is row ``i mod BASE_ROWS`` of a random ``N(0, 1)`` table drawn once from ``seed``."""

    backend = "synthetic"

    def __init__(self, rows: int, dim: int, out_dtype, seed: int = 0):
        self.rows, self.dim, self.out_dtype = rows, dim, np.dtype(out_dtype)
        rng = np.random.default_rng(seed)
        self._base = rng.standard_normal((min(rows, BASE_ROWS), dim)).astype(self.out_dtype)

    @property
    def nbytes(self) -> int:
        return self._base.nbytes

    def device_rows(self) -> np.ndarray:
        """The small table ``[min(rows, BASE_ROWS), dim]``: a device lookup of row ``i`` reads
        its row ``i mod`` that count (:class:`~mtp_jax.models.qwen4_exp.ple_device.PLEDevice`)."""
        return self._base

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """``ids [...]`` int64 row ids -> rows ``[..., dim]``; IndexError outside the table."""
        ids = np.asarray(ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise IndexError(f"n-gram row id outside the table of {self.rows} rows")
        return self._base[ids % self._base.shape[0]]


def read_random(path, cfg, expected: dict[str, tuple], *, dtype: str, with_mtp: bool,
                ple_backend: str = "disk", seed: int = 0):
    """:func:`~mtp_jax.models.qwen4_exp.loader.read_checkpoint`'s result without a checkpoint
    (``path``, ``with_mtp`` and ``ple_backend`` are not read): random dense ``arrays`` of
    ``expected`` (name -> shape) and a :class:`PLEHost` with a :class:`SyntheticTable` per PLE
    layer. Returns ``(arrays, ple)``."""
    del path, with_mtp, ple_backend
    arrays = random_arrays({n: (s, DTYPES[dtype]) for n, s in expected.items()}, seed)
    ple = []
    for j, layer in enumerate(cfg.ple_layers):
        sizes = head_vocab_sizes(cfg, j)
        table = SyntheticTable(ngram_table_rows(cfg, j), cfg.ngram_head_dim, NP_DTYPES[dtype],
                               seed + 1 + j)
        ple.append(PLEHost(layer, table, layer_multipliers(cfg, j), sizes, head_offsets(sizes)))
    return arrays, ple
