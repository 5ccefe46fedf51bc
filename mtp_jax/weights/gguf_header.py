"""GGUF files: recognise them and read their architecture from the header.

Config-time checks read the header's ``general.architecture`` (through
:func:`mtp_jax.weights.gguf_reader.open_gguf`, which maps the file and parses only the
metadata and tensor records) to route a GGUF target or draft, or refuse it with a message that
names it.
"""

from __future__ import annotations

import glob
import os

from mtp_jax.config import ConfigError

# llama.cpp architecture names of the Qwen3.5 family -> HF model_type.
QWEN3_5_GGUF_ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}


def gguf_file(path: str) -> str | None:
    """The GGUF file ``path`` designates: ``path`` itself when it is a ``.gguf`` file, or the
    first ``*.gguf`` of a folder that holds no ``config.json``; else None."""
    if os.path.isfile(path):
        return path if path.lower().endswith(".gguf") or _has_gguf_magic(path) else None
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        files = sorted(glob.glob(os.path.join(path, "*.gguf")))
        return files[0] if files else None
    return None


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file; :class:`ConfigError` if the header is unreadable."""
    from mtp_jax.weights.gguf_reader import open_gguf
    from mtp_jax.weights.safetensors_files import CheckpointError

    try:
        arch = open_gguf(path).architecture
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(arch, str) or not arch:
        raise ConfigError(f"{path}: the GGUF header has no general.architecture; the file is "
                          "not a model GGUF or is corrupt.")
    return arch
