"""Quantized projections kept on the device (FP8 with block scales, NVFP4): their forms and
their dequantization (:mod:`pallas_kernels.quant.formats`), and the few-row projection that
dequantizes inside a Pallas kernel (:mod:`pallas_kernels.quant.gemv`)."""

from pallas_kernels.quant.formats import (KINDS, NVFP4_GROUP, KeptArray, QuantFormat,
                                          check_parts, concat_parts, decode_e2m1, dequantize,
                                          stored_bytes)
from pallas_kernels.quant.gemv import QuantGemvTiles, quant_gemv, quant_gemv_applies

__all__ = ["KINDS", "KeptArray", "NVFP4_GROUP", "QuantFormat", "QuantGemvTiles",
           "check_parts", "concat_parts", "decode_e2m1", "dequantize", "quant_gemv",
           "quant_gemv_applies", "stored_bytes"]
