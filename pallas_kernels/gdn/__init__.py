from pallas_kernels.gdn.reference import gdn_chunked_reference, gdn_recurrent_reference

__all__ = ["gdn_chunked_reference", "gdn_recurrent_reference"]
