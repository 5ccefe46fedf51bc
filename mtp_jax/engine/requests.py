"""User-facing request types: ``SamplingParams`` and ``RequestOutput``, and the host-side
per-request state of the scheduler."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

from mtp_jax.sampling import MAX_TEMPERATURE


ABORT = "abort"  # finish_reason of a request taken out of the engine before it finished


@dataclasses.dataclass
class SamplingParams:
    """Sampling and stopping settings of one request (vLLM's names for the fields it has; one
    sample per request: vLLM's ``n``, ``best_of`` and penalties are not supported, so repeat a
    prompt for several samples).

    temperature: in [0, 3.4e38] (float32's range), 0 = greedy. top_k: -1 (or 0) = off, else
    >= 1 (a top_k at or above the vocabulary size keeps every id). top_p: in (0, 1].
    max_tokens: >= 1 output tokens. seed: int or None (then the engine's seed and the request's
    index). stop: strings that end the output (excluded from the text); stop_token_ids: extra
    ids that end it (included; ids outside the checkpoint's vocabulary are refused by
    ``LLM.generate``); ignore_eos: do not stop at the checkpoint's EOS ids.
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

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first out-of-range value (also called by
        ``LLM.generate``, so parameters changed after construction are checked again)."""
        def is_int(v) -> bool:
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, numbers.Real) and not isinstance(v, bool)

        if not is_num(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature!r} must be a number in [0, "
                             f"{MAX_TEMPERATURE:.3g}] (0 means greedy; float32's largest "
                             "value bounds it).")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p!r} must be in (0, 1]; 1 turns it off.")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k {self.top_k!r} must be an int: -1 or 0 (off) or >= 1.")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens!r} must be an int >= 1.")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise ValueError(f"seed {self.seed!r} must be an int in [0, 2**32) or None.")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple, type(None))):
            raise ValueError(f"stop {self.stop!r} must be a string or a list of strings.")
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop {self.stop!r} must hold non-empty strings.")
        ids = list(self.stop_token_ids or [])
        if any(not is_int(t) or t < 0 for t in ids):
            raise ValueError(f"stop_token_ids {self.stop_token_ids!r} must hold ints >= 0.")
        self.stop_token_ids = [int(t) for t in ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class RequestOutput:
    """Result of one request.

    token_ids: output token ids (prompt excluded); text: their detokenized text ("" without a
    tokenizer); finish_reason: ``"stop"`` (EOS, stop id or stop string), ``"length"``
    (max_tokens or max_model_len), ``"error"`` (``error`` holds the message) or ``"abort"``
    (:data:`ABORT`: ``Engine.abort``, or an error raised while it ran).
    Speculative metrics: ``num_rounds`` verify rounds (decode steps when off),
    ``accept_length`` = committed tokens per round (mean; None before the first round),
    ``acceptance_rate`` = accepted drafts / proposed drafts (None when no draft was proposed:
    speculation off, or a request that ended within its first round or two).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache

    @property
    def accept_length(self) -> float | None:
        return None if not self.num_rounds else (
            (len(self.token_ids) - 1) / self.num_rounds if self.token_ids else 0.0)

    @property
    def acceptance_rate(self) -> float | None:
        return None if not self.num_draft_tokens else self.num_accepted_tokens / self.num_draft_tokens


@dataclasses.dataclass
class StreamOutput:
    """One streaming update of :meth:`LLM.generate_stream`: the prompt's ``index`` in the call,
    the tokens it gained since the last update, and, when ``finished``, the full ``output``."""

    index: int
    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None


@dataclasses.dataclass(eq=False)  # identity semantics: requests key dicts
class Request:
    """Scheduler state of a running request (host side)."""

    request_id: str
    index: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    slot: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    position: int = 0  # tokens in the target KV; the pending token sits at this position
    prefilled: int = 0  # prompt tokens prefilled so far (chunked prefill)
    reserve: int = 0  # pages guaranteed to this request (its final committed length)
    prefix_nodes: list = dataclasses.field(default_factory=list)  # radix nodes referenced
    tree_pages: set = dataclasses.field(default_factory=set)  # pages owned by the prefix cache
    snapshots: dict = dataclasses.field(default_factory=dict)  # end position -> snapshot id
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_text_len: int | None = None  # text length to keep when a stop string matched
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
