"""Few-row projections (decode GEMV): XLA's multiply-reduce form, the Pallas kernel, its XLA
reference and the dispatch."""

from pallas_kernels.gemv.api import BACKENDS, default_tiles, gemv
from pallas_kernels.gemv.few_rows import (GemvTiles, check_tiles, few_rows_matmul,
                                          few_rows_reference)
from pallas_kernels.gemv.reduce_form import reduce_applies, reduce_matmul

__all__ = ["BACKENDS", "GemvTiles", "check_tiles", "default_tiles", "few_rows_matmul",
           "few_rows_reference", "gemv", "reduce_applies", "reduce_matmul"]
