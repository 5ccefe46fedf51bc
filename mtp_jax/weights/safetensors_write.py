"""Writing a safetensors file readable as any other file the user writes.

``safetensors.numpy.save_file`` creates its file with mode 0600 (owner only), whatever the
umask; a checkpoint written by mtp_jax's tools (random checkpoints, exported drafts, quantized
copies, the built-in model) is meant to be shared and served like a downloaded one, so
:func:`save_file` gives it the mode a plain ``open(path, "w")`` would (0666 less the umask).
"""

from __future__ import annotations

import os

from safetensors.numpy import save_file as _save_file

__all__ = ["save_file"]


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """``safetensors.numpy.save_file(tensors, path, metadata)``, then the file's mode set to
    0666 less the process umask. Raises what ``save_file`` and ``os.chmod`` raise."""
    _save_file(tensors, path, metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
