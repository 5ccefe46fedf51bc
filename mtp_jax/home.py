"""mtp_jax's folder in the user's home, for files built once and reused (the default model,
the converted Qwen tokenizer, the XLA compilation cache)."""

from __future__ import annotations

import os

__all__ = ["cache_root"]


def cache_root() -> str:
    """Folder for files built once and reused: ``$MTP_JAX_CACHE`` or ``~/.cache/mtp_jax``.

    Not created here; writers create it when they first need it.
    """
    root = os.environ.get("MTP_JAX_CACHE")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    return os.path.join(os.path.expanduser("~"), ".cache", "mtp_jax")
