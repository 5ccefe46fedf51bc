"""Training data for the MTP head: token sequences from a JSONL file or from the engine itself,
a deterministic eval split, and fixed-shape batches for a jitted step.

JSONL: one object per line, with one of
``{"token_ids": [1, 2, 3]}``, ``{"text": "..."}``, ``{"prompt": "..."}`` or
``{"prompt": [{"role": "user", "content": "..."}, ...]}`` (rendered with the checkpoint's chat
template; a generation prompt is added unless the last message is the assistant's). Other keys
(sampling fields of a ``--prompts-file``) are ignored; blank lines are skipped.

Batches: every sequence is cut into windows of ``seq_len`` tokens (a tail shorter than
:data:`MIN_WINDOW` is dropped: an MTP row needs the hidden of token t, token t+1 and the label
t+2). A train stream shuffles the windows once per epoch (a permutation seeded by
``(seed, epoch)``) and runs forever, a batch taking its rows from the next epoch when one ends;
an eval stream is one pass in order, its last batch padded with empty rows (length 0).
"""

from __future__ import annotations

import json
import numbers
from typing import Iterator, NamedTuple

import numpy as np

from mtp_jax.config import ConfigError
from mtp_jax.sampling import SamplingParams

__all__ = ["MIN_WINDOW", "read_jsonl", "split_eval", "Batch", "Batches", "self_generate"]

MIN_WINDOW = 3
_KEYS = ("token_ids", "text", "prompt")


def _line_ids(obj, tokenizer, where: str) -> list[int]:
    """The token ids of one parsed JSONL object (``where``: ``"FILE line N"``)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object like {{\"text\": \"...\"}}, got "
                          f"a {type(obj).__name__}.")
    keys = [k for k in _KEYS if k in obj]
    if len(keys) != 1:
        found = f"both {' and '.join(keys)}" if keys else f"keys {sorted(obj)}"
        raise ConfigError(f"{where}: has {found}; each line needs exactly one of "
                          f"{', '.join(_KEYS)}.")
    key, value = keys[0], obj[keys[0]]
    if key == "token_ids":
        if (not isinstance(value, list)
                or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                           for t in value)):
            raise ConfigError(f"{where}: token_ids must be a list of ints, got {value!r:.80}.")
        return [int(t) for t in value]
    if isinstance(value, list) and key == "prompt":
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                   for m in value) or not value:
            raise ConfigError(f"{where}: a chat prompt is a non-empty list of "
                              "{\"role\": ..., \"content\": ...} messages.")
    elif not isinstance(value, str):
        raise ConfigError(f"{where}: {key} must be a string"
                          f"{' or a list of chat messages' if key == 'prompt' else ''}, got "
                          f"a {type(value).__name__}.")
    if tokenizer is None:
        raise ConfigError(f"{where}: {key} needs a tokenizer, and the checkpoint has no "
                          "tokenizer files; write lines as {\"token_ids\": [...]}, or use a "
                          "checkpoint folder with tokenizer.json.")
    if isinstance(value, list):
        try:
            value = tokenizer.apply_chat_template(
                value, add_generation_prompt=value[-1]["role"] != "assistant")
        except ValueError as e:  # TemplateError, or no template
            raise ConfigError(f"{where}: the chat template cannot render these messages: "
                              f"{e}") from None
    return tokenizer.encode(value)


def read_jsonl(path: str, tokenizer=None, vocab_size: int | None = None) -> list[list[int]]:
    """The token-id sequences of a JSONL file, one per non-blank line.

    ``tokenizer``: a :class:`mtp_jax.tokenizer.Tokenizer` (or None: only ``token_ids`` lines);
    ``vocab_size``: ids must be in ``[0, vocab_size)`` (None: not checked).
    Raises :class:`ConfigError` naming the file, the line and the fix: unreadable file, bad
    JSON, no (or several) of the keys, text without a tokenizer, an empty sequence, ids outside
    the vocabulary, a file with no sequence.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the data file {path!r}: {e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e}); write one JSON object per "
                              "line.") from None
        ids = _line_ids(obj, tokenizer, where)
        if not ids:
            raise ConfigError(f"{where}: the sequence is empty; drop the line or give it "
                              "tokens.")
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"{where}: token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {vocab_size}); use ids of this checkpoint's tokenizer.")
        out.append(ids)
    if not out:
        raise ConfigError(f"the data file {path!r} holds no sequence (every line is blank).")
    return out


def split_eval(seqs: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """``(train, eval)``: ``round(len * eval_fraction)`` sequences, at least one when
    ``eval_fraction > 0`` and there are two or more, at most all but one, picked by a
    permutation seeded by ``seed``; each part keeps the input order. Raises
    :class:`ConfigError` for a fraction outside ``[0, 1)``."""
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"eval fraction {eval_fraction!r} must be in [0, 1); 0 turns the "
                          "eval split off.")
    n = len(seqs)
    k = round(n * eval_fraction)
    k = min(max(k, 1), n - 1) if eval_fraction > 0 and n >= 2 else 0
    picked = set(np.random.default_rng(seed).permutation(n)[:k].tolist())
    return ([s for i, s in enumerate(seqs) if i not in picked],
            [s for i, s in enumerate(seqs) if i in picked])


class Batch(NamedTuple):
    """``ids [B, T] int32`` (zeros past each row's length) and ``lengths [B] int32`` (real
    tokens of each row; 0 for a padding row)."""

    ids: np.ndarray
    lengths: np.ndarray


class Batches:
    """Fixed-shape batches of windows of token sequences (see the module docstring).

    ``train=True``: iterating yields batches forever, continuing from :meth:`state`;
    ``train=False``: each iteration is one pass over the windows in order.
    Raises :class:`ConfigError` for sizes below 1 or ``seq_len`` below :data:`MIN_WINDOW`, and
    when no sequence yields a window.
    """

    def __init__(self, seqs: list, batch_size: int, seq_len: int, *, seed: int = 0,
                 train: bool = True):
        if batch_size < 1 or seq_len < MIN_WINDOW:
            raise ConfigError(f"batch size {batch_size} must be >= 1 and sequence length "
                              f"{seq_len} >= {MIN_WINDOW}.")
        starts, lengths, flat, offset = [], [], [], 0
        for s in seqs:
            s = np.asarray(s, np.int32)
            for w in range(0, len(s), seq_len):
                if len(s) - w >= MIN_WINDOW:
                    starts.append(offset + w)
                    lengths.append(min(seq_len, len(s) - w))
            flat.append(s)
            offset += len(s)
        if not starts:
            raise ConfigError(f"none of the {len(seqs)} sequences has {MIN_WINDOW} tokens or "
                              "more; give longer sequences.")
        self.batch_size, self.seq_len, self.seed, self.train = batch_size, seq_len, seed, train
        self._tokens = np.concatenate(flat)
        self._starts = np.asarray(starts, np.int64)
        self._lengths = np.asarray(lengths, np.int32)
        self._epoch, self._position = 0, 0
        self._cached: tuple[int, np.ndarray] | None = None

    @property
    def num_windows(self) -> int:
        return len(self._starts)

    def _order(self, epoch: int) -> np.ndarray:
        """Window indices of one epoch: in order (eval), or shuffled by ``(seed, epoch)``."""
        if not self.train:
            return np.arange(self.num_windows)
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._cached = (epoch, rng.permutation(self.num_windows))
        return self._cached[1]

    def _batch(self, rows: list[int]) -> Batch:
        ids = np.zeros((self.batch_size, self.seq_len), np.int32)
        lengths = np.zeros(self.batch_size, np.int32)
        for r, w in enumerate(rows):
            n = self._lengths[w]
            ids[r, :n] = self._tokens[self._starts[w]:self._starts[w] + n]
            lengths[r] = n
        return Batch(ids, lengths)

    def next_batch(self) -> Batch:
        """The next train batch; advances :meth:`state`."""
        rows: list[int] = []
        while len(rows) < self.batch_size:
            if self._position == self.num_windows:
                self._epoch, self._position = self._epoch + 1, 0
            take = self._order(self._epoch)[self._position:
                                            self._position + self.batch_size - len(rows)]
            rows += take.tolist()
            self._position += len(take)
        return self._batch(rows)

    def __iter__(self) -> Iterator[Batch]:
        if self.train:
            while True:
                yield self.next_batch()
        order = self._order(0).tolist()
        for i in range(0, len(order), self.batch_size):
            yield self._batch(order[i:i + self.batch_size])

    def __len__(self) -> int:
        """Batches in one pass (an eval stream's length; a train epoch's, rounded up)."""
        return -(-self.num_windows // self.batch_size)

    def state(self) -> dict:
        """``{"epoch", "position", "num_windows"}`` (JSON-able): where the train stream is."""
        return {"epoch": self._epoch, "position": self._position,
                "num_windows": self.num_windows}

    def restore(self, state: dict) -> None:
        """Continue from a :meth:`state` of a stream over the same windows. Raises
        :class:`ConfigError` when the data changed (another window count) or the state is
        malformed."""
        try:
            epoch, position, n = (int(state[k]) for k in ("epoch", "position", "num_windows"))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"data state {state!r} is malformed; expected epoch, position "
                              "and num_windows (ints).") from None
        if n != self.num_windows:
            raise ConfigError(f"the saved data state is for {n} windows, this data has "
                              f"{self.num_windows}: the data (or seq_len) changed since the "
                              "checkpoint; resume with the same data, or start a new run.")
        if epoch < 0 or not 0 <= position <= n:
            raise ConfigError(f"data state {state!r} is out of range (0 <= position <= {n}).")
        self._epoch, self._position = epoch, position


def self_generate(llm, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                  seed: int) -> list[list[int]]:
    """Each prompt followed by the engine's own continuation (at most ``max_new_tokens``
    tokens, sampled at ``temperature``, 0 = greedy), from one ``llm.generate`` call
    (:class:`mtp_jax.LLM`); prompt i samples with seed ``seed + i``. Raises
    :class:`ConfigError` naming the first prompt the engine refused, ``ValueError`` for bad
    sampling values."""
    if not prompts:
        return []
    params = [SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                             seed=(seed + i) % 2**32) for i in range(len(prompts))]
    outs = llm.generate([list(p) for p in prompts], params)
    for i, o in enumerate(outs):
        if o.finish_reason == "error":
            raise ConfigError(f"prompt {i} ({len(prompts[i])} tokens) was refused by the "
                              f"engine: {o.error}")
    return [list(p) + list(o.token_ids) for p, o in zip(prompts, outs)]
