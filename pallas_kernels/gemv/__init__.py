"""Few-row projections (decode GEMV): the Pallas kernel, its XLA reference and the dispatch."""

from pallas_kernels.gemv.api import BACKENDS, default_tiles, gemv
from pallas_kernels.gemv.few_rows import (GemvTiles, check_tiles, few_rows_matmul,
                                          few_rows_reference)

__all__ = ["BACKENDS", "GemvTiles", "check_tiles", "default_tiles", "few_rows_matmul",
           "few_rows_reference", "gemv"]
