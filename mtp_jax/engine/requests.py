"""Request types: ``RequestOutput`` and ``StreamOutput`` (what a caller gets back) and ``Request``,
the host-side per-request state of the scheduler. ``SamplingParams`` lives in
:mod:`mtp_jax.sampling.params` (re-exported here)."""

from __future__ import annotations

import dataclasses

from mtp_jax.sampling.params import SamplingParams
from mtp_jax.speculative.adaptive import RequestAcceptance

__all__ = ["ABORT", "Request", "RequestOutput", "SamplingParams", "StreamOutput",
           "TokenLogprob"]


ABORT = "abort"  # finish_reason of a request taken out of the engine before it finished


@dataclasses.dataclass
class TokenLogprob:
    """One output token's log-probability (``SamplingParams.logprobs``): ``token_id``, its
    ``logprob`` (float, natural log; ``-inf`` never for an emitted token) and ``top``, the
    ``logprobs`` most likely ``(token_id, logprob)`` pairs, most likely first, from the same
    distribution (:func:`mtp_jax.sampling.filtered_logprobs`: what a sampled request draws
    from; greedy requests: ``log_softmax`` of the target's logits). Ids a top-k / top-p filter
    drops have ``-inf``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


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
    ``sample_index``: which of the prompt's ``SamplingParams.n`` samples this is;
    ``logprobs``: one :class:`TokenLogprob` per output token when ``SamplingParams.logprobs``
    asked for them (else None).
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
    sample_index: int = 0
    logprobs: list[TokenLogprob] | None = None

    @property
    def accept_length(self) -> float | None:
        return None if not self.num_rounds else (
            (len(self.token_ids) - 1) / self.num_rounds if self.token_ids else 0.0)

    @property
    def acceptance_rate(self) -> float | None:
        return None if not self.num_draft_tokens else self.num_accepted_tokens / self.num_draft_tokens


@dataclasses.dataclass
class StreamOutput:
    """One streaming update of :meth:`LLM.generate_stream`: the output's ``index`` in the call
    (the prompt's index when every prompt has ``n = 1``; prompt-major with ``n > 1``, as
    :meth:`LLM.generate` orders its outputs), its ``sample_index``, the tokens it gained since
    the last update (with their :class:`TokenLogprob` in ``new_logprobs`` when asked for, and
    the text they add in ``new_text``: the deltas of a request concatenate to its final text,
    held back while they could start a stop string) and, when ``finished``, the full
    ``output``."""

    index: int
    request_id: str
    new_token_ids: list[int]
    finished: bool
    output: RequestOutput | None = None
    sample_index: int = 0
    new_logprobs: list[TokenLogprob] | None = None
    new_text: str = ""  # the text the new tokens add (LLM.generate_stream; "" without tokenizer)


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
    redraft: bool = False  # its first prefill chunk rewrites the draft row before the reuse
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_text_len: int | None = None  # text length to keep when a stop string matched
    num_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance: RequestAcceptance | None = None  # adaptive speculation's estimate
    sample_index: int = 0  # which of the prompt's SamplingParams.n samples
    first: "Request | None" = None  # sample 0 of the prompt, for samples 1..n-1 (else None)
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # per output token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
