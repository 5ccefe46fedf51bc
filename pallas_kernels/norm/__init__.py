from pallas_kernels.norm.add_rms import (BACKENDS, add_rms_norm, add_rms_norm_reference,
                                         chunk_of, rms_norm_reference)

__all__ = ["BACKENDS", "add_rms_norm", "add_rms_norm_reference", "chunk_of",
           "rms_norm_reference"]
