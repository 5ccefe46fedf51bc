"""A plain-decoding engine for model families that the batched engine does not serve yet
(qwen4_exp): one request at a time, through the family's split step API
(``start_step`` / ``lookup`` / ``finish_step`` of
:class:`~mtp_jax.models.qwen4_exp.loader.LoadedQwen4Exp`).

It keeps the :class:`mtp_jax.engine.engine.Engine` surface that ``LLM`` uses (``add_request``,
``has_work``, ``step``, ``abort``, ``make_ready``, ``flush_cache``, ``warmup_for``) and the same
stop rules, so ``LLM.generate``, ``generate_stream`` and the CLI work unchanged. No speculation,
no batching, no prefix cache. A family is served here when its registry entry says
``serving="sequential"`` (:func:`mtp_jax.engine.serving.make_engine`).

The PLE rows a step needs are hashed from its input token, the token the previous step sampled,
so their host lookup cannot start before that token is on the host. One ``step()`` call::

    join lookup(x) ─► tail program(x's rows) + sampling on the device: token y
      ─► head program of the next step, fed y on the device (no host round trip)
      ─► read y to the host ─► submit lookup(y) to the worker thread
      ─► stop checks of y, return to LLM (streaming, its bookkeeping)
    next call: join lookup(y) ─► tail program(y's rows) ─► ...

What overlaps lookup(y): (1) on the host, y's stop checks and detokenizing and whatever the
caller does until the next ``step()``; (2) on the device, the head program fed y (embedding and
the layers before the first PLE layer: layer 0 only, 1 of 48, in the released checkpoint,
whose ``ple_layer_ids`` is ``[2]``, one-indexed). The tail (every layer from the first PLE layer on, mixer, ``lm_head``,
sampling) takes the rows as an input and waits for the join; a lookup never overlaps the step
that samples its token. The prompt's lookup runs on the main thread while the device runs the
prompt's head program.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.config import ConfigError
from mtp_jax.engine.requests import ABORT, Request
from mtp_jax.engine.stops import append_tokens
from mtp_jax.sampling import SALT_SAMPLE, SamplingParams, SamplingTensors, sample


@dataclasses.dataclass
class _Stats:
    rounds: int = 0


@dataclasses.dataclass
class _Run:
    """The request being decoded: its cache, the next step's head (dispatched) and lookup
    (in flight on the worker thread)."""

    req: Request
    cache: object
    pending: object = None
    lookup: Future | None = None


def _sample_last(logits, params: SamplingTensors, step):
    return sample(logits[:, -1], params, step, salt=SALT_SAMPLE)[:, None]


def _greedy_last(logits):
    return jnp.argmax(logits[:, -1:], axis=-1).astype(jnp.int32)  # sample()'s greedy rows


_SAMPLE = jax.jit(_sample_last)
_GREEDY = jax.jit(_greedy_last)  # all-greedy requests skip compiling the sampler


def cache_len(prompt_len: int, max_tokens: int, max_model_len: int, page: int = 16) -> int:
    """Tokens of a request's decode cache: ``prompt_len + max_tokens + 1`` in pages of ``page``,
    the page count rounded up to a power of two (>= 4; few compiled shapes), at most
    ``max_model_len + 1`` tokens' pages. The XLA QSA reference reads the whole page table each
    step, so a cache sized to the request keeps short requests cheap."""
    cap = -(-(max_model_len + 1) // page)
    need = -(-(prompt_len + max_tokens + 1) // page)
    return min(1 << max(2, (need - 1).bit_length()), cap) * page


class SequentialEngine:
    """Plain decoding of one request at a time on a family's split step API (see the module
    docstring); ``max_model_len`` tokens per request at most (capped by the model's)."""

    prefix = None  # no prefix cache
    draft_vocab_size = None  # no draft

    def __init__(self, model, max_model_len: int, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.max_model_len = min(max_model_len, model.cfg.max_position_embeddings)
        self.eos_ids = set(model.cfg.eos_token_ids) | set(
            getattr(tokenizer, "eos_token_ids", None) or ())
        self.waiting: deque[Request] = deque()
        self._run: _Run | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ple-lookup")
        self.stats = _Stats()

    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def flush_cache(self) -> None:
        """No prefix cache: nothing to drop."""

    def resize_cache(self, *, num_pages: int | None = None,
                     max_running_requests: int | None = None) -> None:
        """Refused: this engine sizes a cache per request and holds no pools
        (``ConfigError``)."""
        raise ConfigError(f"resize_cache: {self.model.cfg.model_type} runs on the sequential "
                          "engine (plain decoding, one request at a time), which makes a cache per "
                          "request and has no pools to resize; drop the call.")

    def warmup_for(self, requests: list[Request]) -> float:
        """Compile what generating ``requests`` calls: one greedy two-token request of the
        first prompt (the step programs' shapes follow the prompt length and cache size).
        Returns seconds."""
        t0 = time.perf_counter()
        if requests:
            r = requests[0]
            self.add_request(Request(request_id="warmup", index=-1, prompt=None,
                                     prompt_ids=list(r.prompt_ids),
                                     params=SamplingParams(temperature=0, max_tokens=2),
                                     seed=0))
            while self.has_work():
                self.step()
        return time.perf_counter() - t0

    def abort(self, requests=None) -> list[Request]:
        """Take ``requests`` (default: all) out of the queue, the one being decoded with its
        next step and PLE lookup dropped; returns those that were unfinished, now with
        ``finish_reason`` ``"abort"``. Requests not in the queue are left as they are."""
        asked = None if requests is None else set(requests)
        gone = [r for r in self.waiting if asked is None or r in asked]
        self.waiting = deque(r for r in self.waiting if r not in gone)
        if self._run is not None and self._run.req in gone:
            self._run = None
        aborted = [r for r in gone if not r.finished]
        for r in aborted:
            r.finish_reason = ABORT
        self.abort_count += len(aborted)
        return aborted

    abort_count = 0  # requests aborted so far (as Engine's)

    def make_ready(self) -> list[Request]:
        """Abort every request left in the engine (:meth:`abort`); as ``Engine.make_ready``."""
        return self.abort()

    def _sample(self, req: Request, logits) -> jax.Array:
        """Device token ``[1, 1]`` int32 from the last row of ``logits [1, T, V]``."""
        p = req.params
        if p.greedy:
            return _GREEDY(logits)
        st = SamplingTensors.from_params([(p.temperature, p.top_k, p.top_p, req.seed)],
                                         host=True)
        return _SAMPLE(logits, st, np.asarray([len(req.output_ids)], np.int32))

    def _may_continue(self, req: Request) -> bool:
        """Whether the request can take another step after the token being sampled now
        (EOS and stop strings are not known yet; lengths are)."""
        n = len(req.output_ids) + 1
        return n < req.params.max_tokens and len(req.prompt_ids) + n < self.max_model_len

    def step(self) -> dict[Request, list[int]]:
        """Prefill the head request, or decode one token of it. On an exception every request
        is aborted (:meth:`abort`) and the exception re-raised."""
        try:
            return self._step()
        except BaseException:
            self.abort()
            raise

    def _step(self) -> dict[Request, list[int]]:
        req, m = self.waiting[0], self.model
        run = self._run
        if run is None or run.req is not req:
            run = _Run(req, m.new_cache(1, cache_len(len(req.prompt_ids), req.params.max_tokens,
                                                      self.max_model_len)))
            ids = np.asarray([req.prompt_ids])
            pending = m.start_step(run.cache, ids)  # device: head over the prompt ...
            rows, ctx = m.lookup(run.cache.ngram_context, ids)  # ... host: its PLE rows
            req.position = len(req.prompt_ids)
        else:
            rows, ctx = run.lookup.result()
            pending = run.pending
            req.position += 1
            req.num_rounds += 1
        logits = m.finish_step(run.cache, pending, rows, ctx, last_only=True)
        tok_dev = self._sample(req, logits)
        run.pending = run.lookup = None
        if self._may_continue(req):
            run.pending = m.start_step(run.cache, tok_dev)
        tok = int(np.asarray(tok_dev)[0, 0])
        if run.pending is not None:
            run.lookup = self._pool.submit(m.lookup, run.cache.ngram_context,
                                           np.asarray([[tok]], np.int64))
        self.stats.rounds += 1
        before = len(req.output_ids)
        append_tokens(req, [tok], self.eos_ids, self.tokenizer, self.max_model_len)
        if req.finished:
            self.waiting.popleft()
            self._run = None
        else:
            self._run = run
        return {req: req.output_ids[before:]}
