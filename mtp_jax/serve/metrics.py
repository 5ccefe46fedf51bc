"""The server's Prometheus metrics (``/metrics``, text format, through ``prometheus_client``
with a registry of the server's own, so several servers in one process keep apart).

The engine thread records tokens and finished requests as it emits them and refreshes the
gauges (queue depth, running requests, KV pages, prefix-cache hit rate) after each step."""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ACCEPT_LEN = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9)
_RATE = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


class ServerMetrics:
    """Counters, histograms and gauges of one server (names prefixed ``mtp_jax_``)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("mtp_jax_requests", "Finished requests, by finish_reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("mtp_jax_request_errors", "Requests refused or failed, by HTTP "
                              "status (a stream's error after its first bytes included)",
                              ["status"], registry=r)
        self.prompt_tokens = Counter("mtp_jax_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=r)
        self.generation_tokens = Counter("mtp_jax_generation_tokens", "Tokens generated",
                                         registry=r)
        self.draft_tokens = Counter("mtp_jax_spec_draft_tokens", "Draft tokens proposed",
                                    registry=r)
        self.accepted_tokens = Counter("mtp_jax_spec_accepted_tokens", "Draft tokens "
                                       "accepted", registry=r)
        self.ttft = Histogram("mtp_jax_time_to_first_token_seconds", "Seconds from a "
                              "request's arrival to its first token", buckets=_TTFT, registry=r)
        self.itl = Histogram("mtp_jax_inter_token_latency_seconds", "Seconds between a "
                             "request's tokens (a round's tokens share its interval)",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram("mtp_jax_request_latency_seconds", "Seconds from arrival to the "
                             "last token", buckets=_TTFT, registry=r)
        self.accept_length = Histogram("mtp_jax_spec_accept_length", "Committed tokens per "
                                       "verify round, per request", buckets=_ACCEPT_LEN,
                                       registry=r)
        self.acceptance_rate = Histogram("mtp_jax_spec_acceptance_rate", "Accepted / proposed "
                                         "drafts, per request", buckets=_RATE, registry=r)
        self.queue_depth = Gauge("mtp_jax_queue_depth", "Requests waiting for a slot",
                                 registry=r)
        self.running = Gauge("mtp_jax_running_requests", "Requests holding a slot",
                             registry=r)
        self.kv_pages_in_use = Gauge("mtp_jax_kv_pages_in_use", "KV pages held (requests and "
                                     "prefix cache)", registry=r)
        self.kv_pages_total = Gauge("mtp_jax_kv_pages_total", "KV pages in the pool",
                                    registry=r)
        self.prefix_hit_rate = Gauge("mtp_jax_prefix_cache_hit_rate", "Prompt tokens reused "
                                     "from the prefix cache / prompt tokens", registry=r)

    def count_error(self, status: int) -> None:
        """One request refused or failed with HTTP ``status``."""
        self.errors.labels(str(status)).inc()

    def on_tokens(self, n: int, since_last: float | None, ttft: float | None) -> None:
        """``n`` tokens delivered to one request: its first (``ttft`` seconds after arrival)
        or ``since_last`` seconds after its previous delivery."""
        self.generation_tokens.inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)
        elif since_last is not None and n:
            for _ in range(n):
                self.itl.observe(since_last / n)

    def on_finish(self, output, seconds: float) -> None:
        """A request finished (any reason) ``seconds`` after its arrival."""
        self.requests.labels(output.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.e2e.observe(seconds)
        self.draft_tokens.inc(output.num_draft_tokens)
        self.accepted_tokens.inc(output.num_accepted_tokens)
        if output.accept_length is not None:
            self.accept_length.observe(output.accept_length)
        if output.acceptance_rate is not None:
            self.acceptance_rate.observe(output.acceptance_rate)

    def on_status(self, status: dict, held: int) -> None:
        """Gauges from :func:`mtp_jax.cache_admin.cache_status` (``held``: requests the
        server holds back from the engine, e.g. during a resize)."""
        self.queue_depth.set(status["waiting_requests"] + held)
        self.running.set(status["running_requests"])
        self.kv_pages_in_use.set(status["kv_pages_in_use"])
        self.kv_pages_total.set(status["kv_pages_total"])
        prefix = status["prefix_cache"]
        self.prefix_hit_rate.set(prefix["hit_rate"] if prefix else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
