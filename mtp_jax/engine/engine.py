"""The serving loop: admission, prefill, rounds, and per-token stop handling on the host.

One ``Engine`` owns a loaded model, its pools and its compiled programs. ``run(requests)``
keeps up to ``max_running_requests`` in flight: requests join (prefill) as slots free up and leave
as they finish, and every running request advances one speculative round per iteration in one
program call over a power-of-two batch bucket.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from mtp_jax.cache.allocator import FreeList, pages_needed
from mtp_jax.config import ConfigError, EngineConfig, SpecConfig
from mtp_jax.engine.batch import PrefillBatch, RoundBatch
from mtp_jax.engine.pools import Pools, make_pools
from mtp_jax.engine.programs import compile_programs
from mtp_jax.engine.requests import Request
from mtp_jax.models.loader import DTYPES, LoadedModel
from mtp_jax.sampling import SamplingTensors
from mtp_jax.spec.external import Proposer, propose

MIN_PREFILL_BUCKET = 16


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclasses.dataclass
class EngineStats:
    """Totals over the engine's life: seconds, tokens, rounds, compiled program count."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    prefill_seconds: float = 0.0
    round_seconds: float = 0.0
    rounds: int = 0


class Engine:
    def __init__(self, model: LoadedModel, engine_cfg: EngineConfig, spec: SpecConfig,
                 proposer: Proposer | None = None, tokenizer=None):
        engine_cfg.validate()
        spec.validate(model.cfg)
        if spec.algorithm == "mtp" and not model.has_mtp:
            raise ConfigError("speculative_algorithm='mtp' needs the mtp.* draft, which was not "
                              "loaded.")
        if spec.algorithm == "external" and proposer is None:
            raise ConfigError("speculative_algorithm='external' needs a proposer callable "
                              "(request_id, token_ids_so_far, k) -> k token ids.")
        self.model, self.cfg, self.spec = model, engine_cfg, spec
        self.proposer, self.tokenizer = proposer, tokenizer
        self.k = spec.k
        self.proposer_kind = spec.algorithm
        mc = model.cfg
        self.max_model_len = min(engine_cfg.max_model_len, mc.max_position_embeddings)
        # Pages must also cover the verify window (k+1) and the chained drafts (k-1) past the end.
        self.max_pages_per_req = pages_needed(self.max_model_len + 2 * self.k + 2,
                                              engine_cfg.page_size)
        num_pages = engine_cfg.num_pages or 1 + engine_cfg.max_running_requests * self.max_pages_per_req
        slots = engine_cfg.max_running_requests + 1
        self.pools: Pools = make_pools(mc, num_pages=num_pages, page_size=engine_cfg.page_size,
                                       slots=slots, k=self.k, mtp=self.proposer_kind == "mtp",
                                       dtype=DTYPES[model.dtype])
        self.pages = FreeList(num_pages, "KV pages")
        self.slots = FreeList(slots, "request slots")
        self._prefill, self._round = compile_programs()
        self.stats = EngineStats()
        self.eos_ids = set(mc.eos_token_ids) | set(getattr(tokenizer, "eos_token_ids", None) or ())

    # ---- host-side helpers -----------------------------------------------------------------
    def _table(self, reqs: list[Request | None]) -> np.ndarray:
        t = np.zeros((len(reqs), self.max_pages_per_req), np.int32)
        for i, r in enumerate(reqs):
            if r is not None:
                t[i, :len(r.pages)] = r.pages
        return t

    def _ensure_pages(self, req: Request, num_tokens: int) -> None:
        need = min(pages_needed(num_tokens, self.cfg.page_size), self.max_pages_per_req)
        if need > len(req.pages):
            req.pages += self.pages.take(need - len(req.pages))

    def _release(self, req: Request) -> None:
        self.pages.give_back(req.pages)
        self.slots.give_back([req.slot])
        req.pages, req.slot = [], 0

    def _sampling(self, reqs: list[Request | None]) -> SamplingTensors:
        rows = [(r.params.temperature, r.params.top_k, r.params.top_p, r.seed)
                for r in reqs if r is not None]
        st = SamplingTensors.from_params(rows, pad_to=len(reqs))
        # from_params pads at the end; padding rows are always at the end of a bucket here.
        return st

    def _append(self, req: Request, tokens: Iterable[int]) -> int:
        """Append committed tokens one by one, applying stops; returns how many were kept."""
        kept = 0
        p = req.params
        for tok in tokens:
            req.output_ids.append(int(tok))
            kept += 1
            if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
                req.finish_reason = "stop"
            elif p.stop and self.tokenizer is not None and self._stop_string(req):
                req.finish_reason = "stop"
            elif len(req.output_ids) >= p.max_tokens:
                req.finish_reason = "length"
            elif len(req.prompt_ids) + len(req.output_ids) >= self.max_model_len:
                req.finish_reason = "length"
            if req.finished:
                break
        return kept

    def _stop_string(self, req: Request) -> bool:
        text = self.tokenizer.decode(req.output_ids)
        hits = [text.find(s) for s in req.params.stop if s in text]
        if hits:
            req.stop_text_len = min(hits)
            return True
        return False

    # ---- programs ----------------------------------------------------------------------------
    def _run_prefill(self, req: Request) -> None:
        n = len(req.prompt_ids)
        t = max(MIN_PREFILL_BUCKET, next_pow2(n))
        ids = np.zeros((1, t), np.int32)
        ids[0, :n] = req.prompt_ids
        batch = PrefillBatch(input_ids=jnp.asarray(ids), length=jnp.asarray([n], jnp.int32),
                             slot=jnp.asarray([req.slot], jnp.int32),
                             page_table=jnp.asarray(self._table([req])),
                             sampling=self._sampling([req]),
                             step=jnp.zeros((1,), jnp.int32))
        t0 = time.perf_counter()
        first, self.pools = self._prefill(self.model.graphdef, self.model.params, self.pools,
                                          batch, k=self.k, mtp=self.proposer_kind == "mtp")
        first = int(np.asarray(first)[0])
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prompt_tokens += n
        req.position = n
        self._append(req, [first])

    def _run_round(self, running: list[Request]) -> None:
        b = min(next_pow2(len(running)), next_pow2(self.cfg.max_running_requests))
        rows: list[Request | None] = list(running) + [None] * (b - len(running))
        for r in running:
            self._ensure_pages(r, r.position + 2 * self.k + 2)
        tokens = np.zeros((b, self.k + 1), np.int32)
        if self.proposer_kind == "external":
            for i, r in enumerate(running):
                ids = r.prompt_ids + r.output_ids
                tokens[i, 0] = r.output_ids[-1]
                tokens[i, 1:] = propose(self.proposer, r.request_id, ids, self.k,
                                        self.model.cfg.vocab_size)
        batch = RoundBatch(
            slot=jnp.asarray([r.slot if r else 0 for r in rows], jnp.int32),
            live=jnp.asarray([r is not None for r in rows]),
            position=jnp.asarray([r.position if r else 0 for r in rows], jnp.int32),
            page_table=jnp.asarray(self._table(rows)),
            sampling=self._sampling(rows),
            step=jnp.asarray([len(r.output_ids) if r else 0 for r in rows], jnp.int32),
            tokens=jnp.asarray(tokens))
        t0 = time.perf_counter()
        out, self.pools = self._round(self.model.graphdef, self.model.params, self.pools, batch,
                                      k=self.k, proposer=self.proposer_kind)
        emitted, accepted = jax.device_get((out.emitted, out.num_accepted))
        self.stats.round_seconds += time.perf_counter() - t0
        self.stats.rounds += 1
        for i, r in enumerate(running):
            n = int(accepted[i])
            r.num_rounds += 1
            r.num_draft_tokens += self.k
            r.num_accepted_tokens += n
            r.position += n + 1
            self._append(r, emitted[i, :n + 1].tolist())

    # ---- loop ------------------------------------------------------------------------------
    def run(self, requests: list[Request], on_round: Callable[[list[Request]], None] | None = None):
        """Serve ``requests`` to completion (each gets ``finish_reason`` set)."""
        waiting, running = deque(requests), []
        while waiting or running:
            while waiting and len(running) < self.cfg.max_running_requests:
                req = waiting.popleft()
                req.slot = self.slots.take()[0]
                self._ensure_pages(req, len(req.prompt_ids) + 2 * self.k + 2)
                self._run_prefill(req)
                (self._release(req) if req.finished else running.append(req))
            if running:
                self._run_round(running)
                for r in [r for r in running if r.finished]:
                    self._release(r)
                running = [r for r in running if not r.finished]
            if on_round is not None:
                on_round(requests)
        self.stats.output_tokens += sum(len(r.output_ids) for r in requests)
        return requests

    def compiled_program_count(self) -> int:
        return self._prefill._cache_size() + self._round._cache_size()
