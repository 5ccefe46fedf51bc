"""Quantized projections kept on the device (FP8 with block scales, NVFP4): their forms and
their dequantization (:mod:`pallas_kernels.quant.formats`)."""

from pallas_kernels.quant.formats import (KINDS, NVFP4_GROUP, QuantFormat, check_parts,
                                          concat_parts, decode_e2m1, dequantize, stored_bytes)

__all__ = ["KINDS", "NVFP4_GROUP", "QuantFormat", "check_parts", "concat_parts", "decode_e2m1",
           "dequantize", "stored_bytes"]
