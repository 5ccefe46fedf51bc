"""Reduced draft vocabulary: the MTP draft scores only a hot subset of N token ids.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via
Frequency-Ranked Speculative Sampling") and SGLang's ``speculative_token_map``: the draft's LM
head multiplies its hidden by N rows instead of all V (on Qwen3.6 V = 248,320, and the head is
most of the draft's weight bytes), so each draft step reads ~V/N times fewer head bytes.

Output stays exact: the target's verify logits are full-vocab and the accept step is unchanged.
Greedy rows emit the target's argmax whatever was drafted; sampled rows use rejection sampling
with the distribution ``q`` the draft really sampled from (zero outside the hot set), which keeps
the output distributed exactly as the target's. A draft can only be right when the next token is
hot, so the accept length may drop a little on real text while each round costs less.

The hot set (:func:`hot_token_ids`):

* ``token_map_path`` alone: every id of the file, in its order (the draft's argmax ties go to the
  earlier entry);
* ``draft_vocab_size`` N alone: the N lowest token ids. A heuristic: byte-level BPE assigns ids
  in merge order, so low ids are the frequent merges; a map counted on real traffic is better;
* both: the first N ids of the map.

Token map files: ``.npy`` (a 1-D integer array), ``.json`` (a list of ints) or text (one id per
line; blank lines ignored). SGLang's ``.pt`` maps need torch: convert them once with
``numpy.save("map.npy", torch.load("map.pt").numpy())``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mtp_jax.config import ConfigError

__all__ = ["SIZE_FLAG", "MAP_FLAG", "read_token_map", "hot_token_ids"]

SIZE_FLAG = "speculative_draft_vocab_size (--speculative-draft-vocab-size)"
MAP_FLAG = "speculative_token_map (--speculative-token-map)"


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def read_token_map(path) -> np.ndarray:
    """Read a token map file: ``.npy`` 1-D integer array, ``.json`` list of ints, or text with
    one id per line. Returns ``[M] int64`` in file order (unchecked against a vocabulary).

    Raises:
      ConfigError: the path is not a string, the file is missing or unreadable, a ``.pt`` file,
        empty, or holds something other than integers (naming the line or entry).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{MAP_FLAG} {path!r} is not a path; pass a .npy, .json or text file "
                          "of token ids.")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{MAP_FLAG} {path!r} is not a file; pass an existing .npy, .json or "
                          "text file of token ids (one per line).")
    ext = os.path.splitext(path)[1].lower()
    if ext in (".pt", ".pth", ".bin"):
        raise ConfigError(f"{MAP_FLAG} {path!r} is a torch file, which mtp_jax does not read; "
                          "convert it once with numpy.save('map.npy', "
                          "torch.load('map.pt').numpy()) and pass the .npy.")
    try:
        if ext == ".npy":
            arr = np.load(path, allow_pickle=False)
            if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                raise ConfigError(f"{MAP_FLAG} {path!r} holds a {arr.dtype} array of shape "
                                  f"{arr.shape}; it must be a 1-D integer array of token ids.")
            ids = arr.astype(np.int64)
        elif ext == ".json":
            with open(path) as f:
                raw = json.load(f)
            if not isinstance(raw, list):
                raise ConfigError(f"{MAP_FLAG} {path!r} holds a JSON {type(raw).__name__}; it "
                                  "must be a list of token ids.")
            bad = [(i, v) for i, v in enumerate(raw) if not _is_int(v)]
            if bad:
                raise ConfigError(f"{MAP_FLAG} {path!r}: entry {bad[0][0]} is {bad[0][1]!r}, not "
                                  "an integer token id.")
            ids = np.asarray(raw, np.int64)
        else:
            vals = []
            with open(path) as f:
                for n, line in enumerate(f, 1):
                    s = line.strip()
                    if not s:
                        continue
                    try:
                        vals.append(int(s))
                    except ValueError:
                        raise ConfigError(f"{MAP_FLAG} {path}:{n}: {s[:40]!r} is not an "
                                          "integer token id (a text map holds one id per "
                                          "line).") from None
            ids = np.asarray(vals, np.int64)
    except (OSError, ValueError) as e:  # unreadable file, bad .npy/.json
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"cannot read {MAP_FLAG} {path!r}: {e}") from None
    if ids.size == 0:
        raise ConfigError(f"{MAP_FLAG} {path!r} holds no token ids; pass a map of the hot ids.")
    return ids


def hot_token_ids(algorithm: str, draft_vocab_size, token_map_path,
                  vocab_size: int | None = None) -> np.ndarray | None:
    """The draft's hot token ids, ``[N] int32`` in the order the draft head scores them, or
    ``None`` when neither setting is given (the full vocabulary).

    Args:
      algorithm: the speculative algorithm; only ``"mtp"`` has a draft head to restrict.
      draft_vocab_size: N, or ``None``.
      token_map_path: a token map file (see :func:`read_token_map`), or ``None``.
      vocab_size: the model's V; ``None`` skips the checks that need it (``N <= V``, ids in
        ``[0, V)``), as :func:`mtp_jax.checks.check_settings` does before the config is read.
    Raises:
      ConfigError: a setting with another algorithm, N not an int in ``1..V``, a map shorter
        than N, an id outside ``[0, V)`` or repeated; the message names the flag and the fix.
    """
    n, path = draft_vocab_size, token_map_path
    if n is None and path is None:
        return None
    given = SIZE_FLAG if n is not None else MAP_FLAG
    if algorithm != "mtp":
        raise ConfigError(f"{given} was given but speculative_algorithm is {algorithm!r}; a "
                          "reduced draft vocabulary only applies to the MTP draft. Drop it or "
                          "use --speculative-algorithm mtp.")
    if n is not None:
        top = "" if vocab_size is None else f"..{vocab_size} (the vocabulary size)"
        if not _is_int(n) or n < 1 or (vocab_size is not None and n > vocab_size):
            raise ConfigError(f"{SIZE_FLAG} {n!r} is outside 1{top or '..V'}; pick the number "
                              "of hot token ids the draft scores (e.g. 32768), or omit it for "
                              "the full vocabulary.")
        n = int(n)
    if path is None:
        return np.arange(n, dtype=np.int32)
    ids = read_token_map(path)
    if n is not None:
        if ids.size < n:
            raise ConfigError(f"{MAP_FLAG} {os.fspath(path)!r} holds {ids.size} ids but {SIZE_FLAG}"
                              f" is {n}; pass a size <= {ids.size}, or omit it to use the whole "
                              "map.")
        ids = ids[:n]
    where = f"{MAP_FLAG} {os.fspath(path)!r}"
    outside = (ids < 0) | (ids >= vocab_size if vocab_size is not None else False)
    if outside.any():
        bad = int(ids[np.argmax(outside)])
        raise ConfigError(f"{where} holds token id {bad}, outside the vocabulary "
                          f"[0, {vocab_size if vocab_size is not None else 'V'}); use a map made "
                          "with this model's tokenizer.")
    uniq, counts = np.unique(ids, return_counts=True)
    if uniq.size != ids.size:
        raise ConfigError(f"{where} repeats token id {int(uniq[counts > 1][0])}; each hot id must "
                          "appear once (deduplicate the map, keeping the first occurrence).")
    return ids.astype(np.int32)
