from pallas_kernels.gdn.api import BACKENDS, gdn_commit, gdn_decode, gdn_verify
from pallas_kernels.gdn.reference import (gdn_chunked_reference, gdn_chunked_states,
                                          gdn_decode_reference, gdn_recurrent_reference)

__all__ = ["BACKENDS", "gdn_chunked_reference", "gdn_chunked_states", "gdn_commit", "gdn_decode",
           "gdn_decode_reference", "gdn_recurrent_reference", "gdn_verify"]
