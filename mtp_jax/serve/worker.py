"""The engine thread: the one thread that touches the engine. It takes commands from a queue
(add requests, abort them, run a cache operation), runs admit -> step -> emit, and posts each
request's events to its caller through the caller's ``post`` (thread-safe; the HTTP handlers
pass ``loop.call_soon_threadsafe`` onto an asyncio queue).

Events (:class:`Event`): ``accepted`` once the engine took the request, ``tokens`` after each
step that gave it tokens (the last one ``finished``, with the output), ``error`` when it was
refused (status 400) or lost to an engine failure (status 500). An engine failure aborts the
requests the engine held (``Engine.step`` leaves it empty and usable); the thread goes on
serving. Samples 1..n-1 of a prompt (``n > 1``) join the engine once sample 0's prompt is
prefilled, to share its prefix-cache pages (:mod:`mtp_jax.engine.samples`). A cache operation that needs an idle engine (a resize) holds new requests back until
the running ones finish, runs, then lets them in."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from mtp_jax.cache_admin import cache_status
from mtp_jax.engine.requests import Request, RequestOutput, TokenLogprob
from mtp_jax.engine.samples import waits_for_first
from mtp_jax.prompts import request_output

__all__ = ["Event", "Job", "EngineWorker"]

log = logging.getLogger("mtp_jax.serve")


@dataclasses.dataclass
class Event:
    """What a job's caller receives: ``kind`` ``accepted`` | ``tokens`` | ``error``
    (``logprobs``: the new tokens' log-probabilities when the request asked for them)."""

    kind: str
    index: int
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    output: RequestOutput | None = None
    status: int = 0
    message: str = ""
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass(eq=False)
class Job:
    """One engine request of an HTTP call: ``index`` (its choice) and ``post`` (the caller's
    thread-safe event sink)."""

    req: Request
    index: int
    post: Callable[[Event], None]
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    last: float | None = None  # when its last tokens were posted


class EngineWorker:
    """Owns ``llm.engine`` on a thread of its own (:meth:`start`, :meth:`stop`); ``metrics``:
    a :class:`~mtp_jax.serve.metrics.ServerMetrics` or None."""

    def __init__(self, llm, metrics=None):
        self.llm, self.engine, self.metrics = llm, llm.engine, metrics
        self._inbox: queue.Queue = queue.Queue()
        self._jobs: dict[Request, Job] = {}  # in the engine
        self._held: list[Job] = []  # waiting for an idle-engine operation to run
        self._samples: list[Job] = []  # accepted samples waiting for sample 0's prompt
        self._idle_ops: list[tuple[Callable, concurrent.futures.Future]] = []
        self._thread = threading.Thread(target=self._run, name="mtp_jax-engine", daemon=True)
        self.failures = 0  # engine steps that raised

    # ---- the callers' side (any thread) ------------------------------------------------------
    def start(self) -> None:
        self.engine.make_ready()
        self._thread.start()

    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Abort what runs and end the thread."""
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join()

    def submit(self, jobs: list[Job]) -> None:
        """Queue ``jobs`` for the engine (each gets ``accepted`` or ``error`` first)."""
        self._inbox.put(("add", jobs))

    def abort(self, jobs: list[Job]) -> None:
        """Abort ``jobs`` (those still running post a last ``tokens`` event, finish_reason
        ``abort``); their slots, pages and snapshots go back."""
        self._inbox.put(("abort", jobs))

    def call(self, fn: Callable, idle: bool = False) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread; ``idle``: once no request runs (new ones are
        held back meanwhile). Returns its future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut, idle))
        return fut

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            busy = (self.engine.has_work() or (self._idle_ops and not self.engine.has_work())
                    or any(not waits_for_first(j.req, self.engine.prefix)
                           for j in self._samples))
            try:
                cmd = self._inbox.get_nowait() if busy else self._inbox.get()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if cmd[0] == "stop":
                    self._abort(list(self._jobs.values()) + self._held + self._samples)
                    return
                self._handle(cmd)
                try:
                    cmd = self._inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if self._idle_ops and not self.engine.has_work():
                self._run_idle_ops()
            self._admit_samples()
            if self.engine.has_work():
                self._step()
            self._refresh_gauges()

    def _handle(self, cmd) -> None:
        if cmd[0] == "add":
            for job in cmd[1]:
                if self._idle_ops:
                    self._held.append(job)
                else:
                    self._add(job)
        elif cmd[0] == "abort":
            self._abort(cmd[1])
        elif cmd[0] == "call":
            _, fn, fut, idle = cmd
            if idle:
                self._idle_ops.append((fn, fut))
            else:
                _settle(fut, fn)

    def _add(self, job: Job) -> None:
        if waits_for_first(job.req, self.engine.prefix):
            self._samples.append(job)
            job.post(Event("accepted", job.index))
            return
        self._enter(job)
        if job.req in self._jobs:
            job.post(Event("accepted", job.index))

    def _admit_samples(self) -> None:
        """Samples whose sample 0 has its prompt prefilled (or ended) join the engine."""
        ready = [j for j in self._samples if not waits_for_first(j.req, self.engine.prefix)]
        self._samples = [j for j in self._samples if j not in ready]
        for job in ready:
            self._enter(job)

    def _enter(self, job: Job) -> None:
        """``job``'s request into the engine (an ``error`` event when it is refused)."""
        try:
            self.engine.add_request(job.req)
        except (MemoryError, ValueError) as e:
            job.post(Event("error", job.index, status=400, message=str(e)))
            return
        self._jobs[job.req] = job

    def _abort(self, jobs: list[Job]) -> None:
        gone = set(jobs)
        self._held = [j for j in self._held if j not in gone]
        self._samples = [j for j in self._samples if j not in gone]
        inside = [j for j in jobs if self._jobs.get(j.req) is j]
        self.engine.abort([j.req for j in inside])
        for j in inside:
            self._finish(j, [])

    def _run_idle_ops(self) -> None:
        ops, self._idle_ops = self._idle_ops, []
        for fn, fut in ops:
            _settle(fut, fn)
        held, self._held = self._held, []
        for job in held:
            self._add(job)

    def _step(self) -> None:
        try:
            new = self.engine.step()
        except Exception as err:  # the engine aborted all it held and is usable again
            self.failures += 1
            log.exception("engine step failed; its %d requests were aborted", len(self._jobs))
            jobs, self._jobs = list(self._jobs.values()), {}
            for job in jobs:
                job.post(Event("error", job.index, status=500,
                                message=f"the engine failed while serving this request and "
                                        f"aborted it: {err!r}"))  # counted where it is sent
            return
        for req, toks in new.items():
            job = self._jobs.get(req)
            if job is None:
                continue
            if req.finished:
                self._finish(job, toks)
            else:
                self._post_tokens(job, toks)

    def _post_tokens(self, job: Job, toks: list[int], **extra) -> None:
        now = time.perf_counter()
        if self.metrics is not None and (toks or job.last is None):
            self.metrics.on_tokens(len(toks), None if job.last is None else now - job.last,
                                   now - job.arrived if job.last is None and toks else None)
        if toks:
            job.last = now
        req, lps = job.req, None
        if req.params.logprobs is not None:
            lps = req.logprobs[len(req.output_ids) - len(toks):len(req.output_ids)]
        job.post(Event("tokens", job.index, token_ids=list(toks), logprobs=lps, **extra))

    def _finish(self, job: Job, toks: list[int]) -> None:
        del self._jobs[job.req]
        out = request_output(job.req, self.llm.tokenizer)
        self._post_tokens(job, toks, finished=True, output=out)
        if self.metrics is not None:
            self.metrics.on_finish(out, time.perf_counter() - job.arrived)

    def _refresh_gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.on_status(cache_status(self.engine), len(self._held))


def _settle(fut: concurrent.futures.Future, fn: Callable) -> None:
    """Run ``fn`` into ``fut`` (its result or its exception)."""
    if not fut.set_running_or_notify_cancel():
        return
    try:
        fut.set_result(fn())
    except BaseException as e:  # reported to the caller, the thread goes on
        fut.set_exception(e)
