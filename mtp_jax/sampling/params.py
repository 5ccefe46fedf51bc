"""``SamplingParams``, the one validation of sampling values, and the one definition of greedy.

Every place that takes sampling values checks them here: :class:`SamplingParams` (a request's
settings) and :meth:`mtp_jax.sampling.SamplingTensors.from_params` (a batch's device rows) call
the same ``check_*`` functions, so a bad value gets the same message wherever it enters.

Greedy is ``temperature <= 0`` (:func:`is_greedy`; the checks refuse negative values, so a
valid request is greedy exactly when its temperature is 0). Python floats, numpy arrays and
traced JAX arrays all go through that one function.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import numpy as np

__all__ = ["MAX_LOGPROBS", "MAX_TEMPERATURE", "SamplingParams", "is_greedy", "check_temperature", "check_top_k",
           "check_top_p", "check_min_p", "check_penalty", "check_seed", "MAX_PENALTY"]

MAX_TEMPERATURE = float(np.finfo(np.float32).max)  # larger temperatures overflow float32
MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's top_logprobs bound)
MAX_PENALTY = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI's and vLLM's range)


def is_greedy(temperature):
    """Whether rows of ``temperature`` (a number, or an array of any shape: numpy or JAX,
    traced too) are greedy: argmax, no random draw. Returns a bool or a bool array."""
    return temperature <= 0


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_temperature(t) -> None:
    """Raise ``ValueError`` unless ``t`` is a number in ``[0, MAX_TEMPERATURE]``."""
    if not _is_num(t) or not 0 <= t <= MAX_TEMPERATURE:
        raise ValueError(f"temperature {t!r} must be a number in [0, {MAX_TEMPERATURE:.3g}] "
                         "(0 means greedy; float32's largest value bounds it).")


def check_top_p(p) -> None:
    """Raise ``ValueError`` unless ``p`` is a number in ``(0, 1]``."""
    if not _is_num(p) or not 0 < p <= 1:
        raise ValueError(f"top_p {p!r} must be in (0, 1]; 1 turns it off.")


def check_min_p(p) -> None:
    """Raise ``ValueError`` unless ``p`` is a number in ``[0, 1]``."""
    if not _is_num(p) or not 0 <= p <= 1:
        raise ValueError(f"min_p {p!r} must be a number in [0, 1]; 0 turns it off.")


def check_penalty(name: str, v) -> None:
    """Raise ``ValueError`` unless ``v`` (the field ``name``) is a number in ``[-2, 2]``."""
    if not _is_num(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
        raise ValueError(f"{name} {v!r} must be a number in [-{MAX_PENALTY:g}, "
                         f"{MAX_PENALTY:g}]; 0 turns it off.")


def check_top_k(k) -> None:
    """Raise ``ValueError`` unless ``k`` is an int >= -1 (-1 and 0 turn top-k off)."""
    if not _is_int(k) or k < -1:
        raise ValueError(f"top_k {k!r} must be an int: -1 or 0 (off) or >= 1.")


def check_seed(s) -> None:
    """Raise ``ValueError`` unless ``s`` is an int in ``[0, 2**32)``."""
    if not _is_int(s) or not 0 <= s < 2**32:
        raise ValueError(f"seed {s!r} must be an int in [0, 2**32) or None.")


@dataclasses.dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (vLLM's names for the fields it has;
    vLLM's ``best_of`` and ``repetition_penalty`` are not supported).

    temperature: in [0, 3.4e38] (float32's range), 0 = greedy. top_k: -1 (or 0) = off, else
    >= 1 (a top_k at or above the vocabulary size keeps every id). top_p: in (0, 1].
    min_p: in [0, 1], 0 = off: keeps the ids whose probability is at least ``min_p`` times
    the most likely one's (:mod:`mtp_jax.sampling.filtering`).
    presence_penalty, frequency_penalty: in [-2, 2], 0 = off: before temperature and the
    filters, every id's logit is lowered by ``frequency_penalty * c + presence_penalty * (c >
    0)``, ``c`` the times the id is in the output so far (not the prompt), as OpenAI and vLLM
    define them (:mod:`mtp_jax.sampling.penalties`); greedy requests take the argmax of the
    penalised logits.
    max_tokens: >= 1 output tokens. seed: int or None (then the engine's seed and the request's
    index). stop: strings that end the output (excluded from the text); stop_token_ids: extra
    ids that end it (included; ids outside the checkpoint's vocabulary are refused by
    ``LLM.generate``); ignore_eos: do not stop at the checkpoint's EOS ids.
    n: samples of the prompt (>= 1), each a request of its own with its own seed (``seed + i``
    for sample i when ``seed`` is given) and output (``RequestOutput.sample_index``).
    logprobs: None (none), or the number of top alternatives (0..:data:`MAX_LOGPROBS`) to
    return with each output token's log-probability (``RequestOutput.logprobs``), from the
    distribution the token is sampled from (:func:`mtp_jax.sampling.filtered_logprobs`:
    after the penalties, temperature, top-k, top-p and min-p; greedy requests get the
    ``log_softmax`` of the model's logits after the penalties).
    Raises ``ValueError`` at construction for out-of-range values.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None
    min_p: float = 0.0  # these last, so that positional arguments keep their meaning
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first out-of-range value (also called by
        ``LLM.generate``, so parameters changed after construction are checked again)."""
        check_temperature(self.temperature)
        check_top_p(self.top_p)
        check_top_k(self.top_k)
        check_min_p(self.min_p)
        check_penalty("presence_penalty", self.presence_penalty)
        check_penalty("frequency_penalty", self.frequency_penalty)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens!r} must be an int >= 1 (the most "
                             "tokens to generate, e.g. 128).")
        if self.seed is not None:
            check_seed(self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"stop {self.stop!r} must be a string or a list of strings.")
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop {self.stop!r} must hold non-empty strings.")
        ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids {self.stop_token_ids!r} must hold ints >= 0.")
        self.stop_token_ids = [int(t) for t in ids]
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n {self.n!r} must be an int >= 1 (samples of the prompt).")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs {self.logprobs!r} must be None or an int in "
                             f"[0, {MAX_LOGPROBS}] (top alternatives per token).")

    @property
    def penalizes(self) -> bool:
        """Whether a presence or frequency penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        """Argmax decoding (:func:`is_greedy`: temperature 0)."""
        return bool(is_greedy(self.temperature))
