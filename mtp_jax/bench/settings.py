"""What every row of the engine benchmark shares (:class:`Settings`, checked before any
weight is drawn) and the benchmark's requests (:func:`requests`: random prompts, deterministic
in their first index)."""

from __future__ import annotations

import dataclasses

import numpy as np

from mtp_jax.cache.allocator import pages_needed
from mtp_jax.config import EngineConfig, SpeculativeConfig
from mtp_jax.engine.rounds import AUTO_SCHEDULER_STEPS
from mtp_jax.engine.requests import Request
from mtp_jax.sampling import SamplingParams, is_greedy


# Prompts up to WHOLE_PROMPT_MAX tokens are prefilled in one call (the prefill-throughput rows);
# longer ones in LONG_PROMPT_CHUNK-token calls, the engine's default chunked_prefill_size: an
# 8192-token chunk at 32K of context ran out of memory beside the 27B's weights on an H100
# (docs/benchmarks.md, session 37).
WHOLE_PROMPT_MAX = 8192
LONG_PROMPT_CHUNK = 2048


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every row shares. ``max_k``: the largest k of the run (all engines of a batch get
    the same page-table width, so k = 0 and k > 0 compute over identical tables)."""

    prompt_len: int = 1024
    chunk: int | None = None  # prompt tokens per prefill call; None: see chunk_size
    decode_tokens: int = 1024
    warmup_rounds: int = 3
    page_size: int = 16
    hbm_tbps: float = 4.2
    accept_lengths: tuple[float, ...] = (2.5, 3.0, 3.5)
    prefill_reps: int = 3
    max_k: int = 3
    engine_warmup: bool = False
    draft_vocab_size: int | None = None  # k > 0 rows: the MTP draft scores the N lowest ids
    draft_head_dtype: str | None = None  # k > 0 rows: "int8": the draft's LM head in int8
    draft_layer_dtype: str | None = None  # k > 0 rows: "int8": the draft's projections in int8
    # Rounds per program call (EngineConfig.num_scheduler_steps), one row per value; 0: the
    # engine's automatic choice (the default). k > 0: the forced-draft row always runs one
    # round per call (its drafts are written on the device between rounds); each other value
    # adds a row with the drafts as drafted.
    num_scheduler_steps: tuple[int, ...] = (0,)
    # The prefix cache on (the engine's default): prefills end on snapshot boundaries and
    # rounds that reach one save the GDN state, as every user's do.
    prefix_cache: bool = True
    # Sampled rows when temperature > 0 (every request samples with these, seeded); 0: greedy
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    @property
    def chunk_size(self) -> int:
        """Prompt tokens per prefill call: ``chunk``, else the whole prompt up to
        :data:`WHOLE_PROMPT_MAX` tokens and :data:`LONG_PROMPT_CHUNK` above."""
        if self.chunk:
            return self.chunk
        return self.prompt_len if self.prompt_len <= WHOLE_PROMPT_MAX else LONG_PROMPT_CHUNK

    @property
    def sampled(self) -> bool:
        return not is_greedy(self.temperature)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The requests' parameters: greedy, or sampled with this temperature, top_p, top_k
        (``ignore_eos``: every request decodes ``max_tokens``)."""
        return SamplingParams(temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, max_tokens=max_tokens, ignore_eos=True)

    def validate(self) -> None:
        """Raises ``ValueError`` naming the flag (``--prompt-len``, ``--k``, ``--top-p``, ...)
        whose value cannot run, and what it must be."""
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"--chunked-prefill-size {self.chunk} must be >= 1 (prompt tokens "
                             "per prefill call), or omitted.")
        for name in ("prompt_len", "decode_tokens", "warmup_rounds", "prefill_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)} must be "
                                 ">= 1.")
        if not 0 <= self.max_k <= 8:
            raise ValueError(f"--k {self.max_k} must be in 0..8.")
        if not self.num_scheduler_steps:
            raise ValueError("--num-scheduler-steps needs at least one value.")
        for n in self.num_scheduler_steps:
            EngineConfig(num_scheduler_steps=n or None).validate()
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size {self.draft_vocab_size} must be >= 1 (hot "
                             "token ids of the draft's LM head), or omitted for the full "
                             "vocabulary.")
        SpeculativeConfig(draft_head_dtype=self.draft_head_dtype,
                          draft_layer_dtype=self.draft_layer_dtype).validate()
        try:
            self.sampling_params(1).validate()
        except ValueError as e:  # "top_p 0.0 must be ..." -> "--top-p 0.0 must be ..."
            field, _, rest = str(e).partition(" ")
            if field in ("temperature", "top_p", "top_k"):
                raise ValueError(f"--{field.replace('_', '-')} {rest}") from None
            raise

    @property
    def reference_len(self) -> int:
        """Plain-decoding tokens a forced run may need: the prefill's token, warm-up rounds
        of up to max_k + 1 tokens, the timed tokens, the last round's overshoot, the round
        dispatched ahead (overlap) and the drafts of the last round run, plus one round of
        slack for rows of a batch that end the timed phase a round after the others."""
        k = self.max_k
        return 1 + self.warmup_rounds * (k + 1) + self.decode_tokens + 3 * (k + 1) + k

    @property
    def max_model_len(self) -> int:
        """Room for the reference plus slack, minus 2 max_k + 1 so that every k gets the same
        page-table width (``pages_needed(max_model_len + 2k + 1)`` for k <= max_k)."""
        k, ps = self.max_k, self.page_size
        most = max(n or AUTO_SCHEDULER_STEPS for n in self.num_scheduler_steps)
        slack = 4 * k + 8 + 8 * most  # multi-round overshoot
        pages = pages_needed(self.prompt_len + self.reference_len + slack, ps)
        return pages * ps - (2 * k + 1)


def requests(batch: int, prompt_len: int, max_tokens: int, vocab: int, start: int,
             params: SamplingParams | None = None):
    """``batch`` requests with random prompts, deterministic in ``start`` (the first request's
    index): greedy (``ignore_eos``) unless ``params`` is given; request i's seed is
    ``start + i``."""
    rng = np.random.default_rng(start)
    if params is None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [Request(request_id=str(start + i), index=start + i, prompt=None,
                    prompt_ids=rng.integers(10, vocab - 10, prompt_len).tolist(), params=params,
                    seed=start + i) for i in range(batch)]
