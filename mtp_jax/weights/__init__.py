"""Checkpoint reading: canonical names (``names``), the safetensors format
(``safetensors_files``) and reader (``safetensors_reader``), draft-folder checks, GGUF headers
and Hugging Face downloads. Readers hand canonical arrays to the model code."""

from mtp_jax.weights.safetensors_files import CheckpointError, list_tensor_names
from mtp_jax.weights.safetensors_reader import load_tensors

__all__ = ["CheckpointError", "list_tensor_names", "load_tensors"]
