"""Developer tools: the real Qwen vocabulary as an HF ``tokenizer.json`` (``qwen_vocab``) and
random-weight checkpoints of any Qwen3.5-family shape (``random_checkpoint``)."""

from __future__ import annotations

import os


def cache_root() -> str:
    """Folder for files built once and reused: ``$MTP_JAX_CACHE`` or ``~/.cache/mtp_jax``.

    Not created here; writers create it when they first need it.
    """
    root = os.environ.get("MTP_JAX_CACHE")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    return os.path.join(os.path.expanduser("~"), ".cache", "mtp_jax")
