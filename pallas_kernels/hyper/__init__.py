"""The hyper-connection mix of qwen4_exp (Qwen3.8-Flash-Next): the XLA reference and two
Pallas (Triton) kernels for calls of a few rows."""
from pallas_kernels.hyper.mix import (MAX_ROWS, HyperTiles, default_tiles, hyper_mix,
                                      supports, unsupported)
from pallas_kernels.hyper.reference import (hyper_mix_reference, inject_reference,
                                            stream_rsqrt)

__all__ = ["MAX_ROWS", "HyperTiles", "default_tiles", "hyper_mix", "hyper_mix_reference",
           "inject_reference", "stream_rsqrt", "supports", "unsupported"]
