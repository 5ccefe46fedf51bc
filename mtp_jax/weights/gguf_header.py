"""GGUF files: recognise them, read their architecture from the header, and sort a GGUF
checkpoint folder into its target and its Strata MTP pack.

Config-time checks read the header's ``general.architecture`` (through
:func:`mtp_jax.weights.gguf_reader.open_gguf`, which maps the file and parses only the
metadata and tensor records) to route a GGUF target or draft, or refuse it with a message that
names it.

A GGUF checkpoint folder (``*.gguf`` files, no ``config.json``; what
``python -m mtp_jax.tools.random_checkpoint --format gguf`` writes) holds one target (an
architecture not ending in ``-mtp``) and at most one Strata MTP pack (``qwen4exp-mtp``): the
folder as the model path is its target, with its pack as the MTP draft when no draft path is
given; the folder as a draft path is its pack.
"""

from __future__ import annotations

import glob
import os

from mtp_jax.config import ConfigError

__all__ = ["QWEN3_5_GGUF_ARCHS", "PACK_SUFFIX", "gguf_file", "gguf_draft_file", "folder_pack",
           "gguf_folder", "gguf_architecture"]

# llama.cpp architecture names of the Qwen3.5 family -> HF model_type.
QWEN3_5_GGUF_ARCHS = {"qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}
PACK_SUFFIX = "-mtp"  # a Strata MTP pack's architecture ends so (qwen4exp-mtp)


def _gguf_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json"))


def gguf_folder(folder: str) -> tuple[list[str], list[str]]:
    """``(targets, packs)``: the ``*.gguf`` paths of ``folder``, sorted, split by header
    (a pack's ``general.architecture`` ends in ``-mtp``; a file whose header cannot be read
    counts as a target, so that loading it names the problem). Reads headers only."""
    targets, packs = [], []
    for f in sorted(glob.glob(os.path.join(folder, "*.gguf"))):
        try:
            is_pack = gguf_architecture(f).endswith(PACK_SUFFIX)
        except ConfigError:
            is_pack = False
        (packs if is_pack else targets).append(f)
    return targets, packs


def gguf_file(path: str) -> str | None:
    """The GGUF target ``path`` designates: ``path`` itself when it is a ``.gguf`` file (or
    starts with the GGUF magic); for a folder without ``config.json``, its one target GGUF
    (or, with none, its first pack, which the target checks then refuse by name); else None.

    Raises:
      ConfigError: a folder holding several target GGUFs (they are listed; the fix is to pass
        the file to load).
    """
    if os.path.isfile(path):
        return path if path.lower().endswith(".gguf") or _has_gguf_magic(path) else None
    if not _gguf_folder(path):
        return None
    targets, packs = gguf_folder(path)
    if len(targets) > 1:
        raise ConfigError(f"{path} holds {len(targets)} target GGUF files "
                          f"({', '.join(os.path.basename(t) for t in targets)}), so the folder "
                          "does not say which to load; pass the file's path as the model, e.g. "
                          f"{targets[0]}.")
    return (targets + packs)[0] if targets or packs else None


def folder_pack(path: str) -> str | None:
    """The Strata MTP pack of GGUF checkpoint folder ``path`` (its one ``*.gguf`` whose
    architecture ends in ``-mtp``): the draft when no draft path is given. None for a file,
    a folder with ``config.json`` or a folder without a pack.

    Raises:
      ConfigError: a folder holding several packs (they are listed; the fix is to pass one
        as ``speculative_draft_model_path``).
    """
    if not _gguf_folder(path):
        return None
    packs = gguf_folder(path)[1]
    if len(packs) > 1:
        raise ConfigError(f"{path} holds {len(packs)} Strata MTP packs "
                          f"({', '.join(os.path.basename(p) for p in packs)}), so the folder "
                          "does not say which drafts; pass one as --speculative-draft-model-path "
                          f"(speculative_draft_model_path=...), e.g. {packs[0]}.")
    return packs[0] if packs else None


def gguf_draft_file(path: str) -> str | None:
    """The GGUF a draft path designates: a file itself, a GGUF folder's one pack (or, without
    one, what :func:`gguf_file` finds there, which the draft checks then refuse by name);
    None when ``path`` holds no GGUF.

    Raises:
      ConfigError: a folder with several packs, or with no pack and several targets.
    """
    return folder_pack(path) or gguf_file(path)


def _has_gguf_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file.

    Raises:
      ConfigError: the header is unreadable or has no ``general.architecture``.
    """
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
