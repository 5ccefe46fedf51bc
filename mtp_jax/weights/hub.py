"""Hugging Face repo ids as checkpoint sources.

A draft path that does not exist locally but has the form of a repo id (``name`` or
``org/name``) passes the config-time checks; it is downloaded (``huggingface_hub``) at load,
before the target's weights are read, and a failed download is a :class:`CheckpointError`
naming the repo and the fix. Paths such as ``./x``, ``a/b/c``, ``/abs`` or ``~/x`` are local
paths, never repo ids.
"""

from __future__ import annotations

import re

from mtp_jax.weights.safetensors_files import CheckpointError

_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?"
_REPO_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
_FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin", ".pt")


def looks_like_repo_id(path: str) -> bool:
    """``name`` or ``org/name`` (letters, digits, ``-_.``; no ``..``, no file suffix)."""
    return (isinstance(path, str) and bool(_REPO_ID.match(path)) and ".." not in path
            and not path.lower().endswith(_FILE_SUFFIXES))


def _snapshot_download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    return snapshot_download(repo_id=repo_id, allow_patterns=["*.json", "*.safetensors"])


def download_repo(repo_id: str, what: str = "speculative_draft_model_path") -> str:
    """Download ``repo_id`` (config, index and safetensors files); returns the local folder."""
    try:
        return _snapshot_download(repo_id)
    except ImportError as e:
        raise CheckpointError(f"{what} {repo_id!r} is not a local folder, so it was taken as a "
                              "Hugging Face repo id, but huggingface_hub is not installed "
                              "(pip install huggingface_hub), or pass a local folder.") from e
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: all end here
        raise CheckpointError(
            f"{what} {repo_id!r} is not a local folder, so it was taken as a Hugging Face repo "
            f"id, but downloading it failed ({type(e).__name__}: {e}). If this machine has no "
            "network, download the repo elsewhere and pass the local folder; check the spelling "
            "of the repo id and that you have access to it.") from None
