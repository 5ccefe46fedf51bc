"""One HTTP call's requests in flight: submitted to the engine thread, their events awaited on
the handler's event loop (fed through ``loop.call_soon_threadsafe``), and aborted when the call
ends before they finish (a client gone, a stream closed early, an error)."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable

from mtp_jax.engine.requests import Request
from mtp_jax.serve.errors import APIError
from mtp_jax.serve.worker import EngineWorker, Event, Job

__all__ = ["Call"]

POLL_SECONDS = 0.5  # how often a call with no news looks whether its client left


class Call:
    """The requests of one HTTP call (one per choice). Use as ``async with``: leaving it
    aborts what has not finished."""

    def __init__(self, worker: EngineWorker, requests: list[Request],
                 disconnected: Callable[[], Awaitable[bool]] | None = None):
        loop = asyncio.get_running_loop()
        self.worker, self.disconnected = worker, disconnected
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        post = lambda ev: loop.call_soon_threadsafe(self.queue.put_nowait, ev)  # noqa: E731
        self.jobs = [Job(r, i, post) for i, r in enumerate(requests)]
        self.unfinished = set(range(len(requests)))
        self._early: list[Event] = []  # events that came before every request was accepted

    async def __aenter__(self) -> "Call":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Abort the requests that have not finished (nothing when all have)."""
        if self.unfinished:
            self.worker.abort([self.jobs[i] for i in sorted(self.unfinished)])
            self.unfinished = set()

    async def start(self) -> None:
        """Submit the requests and wait until the engine took each; an ``error`` event (a
        request the engine refused) raises its :class:`APIError` after the others were
        aborted."""
        self.worker.submit(self.jobs)
        waiting = set(self.unfinished)
        while waiting:
            ev = await self._next()
            if ev.kind == "accepted":
                waiting.discard(ev.index)
            elif ev.kind == "error":
                self.unfinished.discard(ev.index)
                self.close()
                raise APIError(ev.status, ev.message)
            else:
                self._early.append(ev)

    async def events(self) -> AsyncIterator[Event]:
        """The ``tokens`` events until every request finished; an ``error`` event (an engine
        failure) raises its :class:`APIError` (the others are aborted on leaving)."""
        while self._early:
            ev = self._early.pop(0)
            self._mark(ev)
            yield ev
        while self.unfinished:
            ev = await self._next()
            if ev.kind == "error":
                self.unfinished.discard(ev.index)
                raise APIError(ev.status, ev.message, code="engine_error")
            self._mark(ev)
            yield ev

    def _mark(self, ev: Event) -> None:
        if ev.finished:
            self.unfinished.discard(ev.index)

    async def _next(self) -> Event:
        """The next event; every :data:`POLL_SECONDS` without one, look whether the client
        left (then ``asyncio.CancelledError``, and the call aborts on leaving)."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), POLL_SECONDS)
            except asyncio.TimeoutError:
                if self.disconnected is not None and await self.disconnected():
                    raise asyncio.CancelledError("the client disconnected") from None
