"""Checkpoint reading: canonical names (``names``) and the safetensors reader."""

from mtp_jax.weights.safetensors_reader import (CheckpointError, list_tensor_names,
                                                load_tensors)

__all__ = ["CheckpointError", "list_tensor_names", "load_tensors"]
