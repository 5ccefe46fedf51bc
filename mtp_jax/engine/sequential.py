"""A plain-decoding engine for model families that the batched engine does not serve yet
(qwen4_exp): one request at a time, through the family's cached ``extend`` API.

It keeps the :class:`mtp_jax.engine.engine.Engine` surface that ``LLM`` uses (``add_request``,
``has_work``, ``step``, ``flush_cache``) and the same stop rules, so ``LLM.generate``,
``generate_stream`` and the CLI work unchanged. No speculation, no batching, no prefix cache.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from mtp_jax.engine.requests import Request
from mtp_jax.sampling import SALT_SAMPLE, SamplingTensors, sample


@dataclasses.dataclass
class _Stats:
    rounds: int = 0


class SequentialEngine:
    prefix = None

    def __init__(self, model, max_model_len: int, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = min(max_model_len, model.cfg.max_position_embeddings)
        self.eos_ids = set(model.cfg.eos_token_ids) | set(
            getattr(tokenizer, "eos_token_ids", None) or ())
        self.waiting: deque[Request] = deque()
        self._cache = None
        self.stats = _Stats()

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def flush_cache(self) -> None:
        pass

    def _next_token(self, req: Request, logits) -> int:
        p = req.params
        st = SamplingTensors.from_params([(p.temperature, p.top_k, p.top_p, req.seed)])
        step = np.asarray([len(req.output_ids)], np.int32)
        return int(np.asarray(sample(np.asarray(logits)[:, -1], st, step, salt=SALT_SAMPLE))[0])

    def step(self) -> dict[Request, list[int]]:
        """Prefill the head request, or decode one token of it."""
        from mtp_jax.engine.engine import append_tokens

        req = self.waiting[0]
        if self._cache is None:
            self._cache = self.model.new_cache(1, self.max_model_len + 1)
            logits = self.model.extend(self._cache, np.asarray([req.prompt_ids]))
            req.position = len(req.prompt_ids)
        else:
            logits = self.model.extend(self._cache, np.asarray([[req.output_ids[-1]]]))
            req.position += 1
            req.num_rounds += 1
        self.stats.rounds += 1
        before = len(req.output_ids)
        append_tokens(req, [self._next_token(req, logits)], self.eos_ids, self.tokenizer,
                      self.max_model_len)
        if req.finished:
            self.waiting.popleft()
            self._cache = None
        return {req: req.output_ids[before:]}
