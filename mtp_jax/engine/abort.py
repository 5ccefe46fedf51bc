"""Aborting requests, and leaving an engine usable after an error (docs/design.md, "Host side").

Functions over a :class:`~mtp_jax.engine.scheduler.Scheduler` and the parts it was given (its
page book, prefix store and device state):

* :func:`abort` takes requests out (``finish_reason`` ``"abort"``, everything they hold given
  back);
* :func:`recover` leaves the engine empty and usable after an exception in a step;
* :func:`make_ready` aborts whatever an interrupted clean-up left and renews unreadable pools;
* :func:`pools_guard` does the same for the pools after an exception in a resize or a warm-up.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterable

import jax

from mtp_jax.engine.device import pools_usable
from mtp_jax.engine.requests import ABORT, Request
from mtp_jax.engine.scheduler import Scheduler

__all__ = ["abort", "recover", "make_ready", "pools_guard"]


def discard_inflight(sched: Scheduler) -> None:
    """Drop the call in flight, if any, unread; give back the snapshot ids it was given. The
    device may still be running it: later programs take the pools it returned, so they run
    after it, and the pages it writes may be handed out again."""
    f, sched.inflight = sched.inflight, None
    if f is not None and sched.prefix is not None:
        sched.prefix.give_back_snapshots(f.snap_id[f.snap_at >= 0].tolist())


def abort(sched: Scheduler, requests: Iterable[Request] | None = None) -> list[Request]:
    """Abort ``requests`` (default: every request ``sched`` holds); returns those that were
    unfinished, now with ``finish_reason`` ``"abort"``. Requests not held are left as they
    are. Each leaves the queues and gives back its slot, KV pages, prefix-cache references and
    snapshot ids (nothing of it is inserted into the prefix cache). A call in flight that
    computes only finished or aborted requests is dropped unread; one that still computes
    another request runs on, and the aborted rows in it are ignored when it is read and
    released then (as rows past a stop are)."""
    held = sched.held()
    if requests is not None:
        inside = set(held)
        held = [r for r in dict.fromkeys(requests) if r in inside]
    return _abort(sched, held)


def _abort(sched: Scheduler, reqs: list[Request]) -> list[Request]:
    """:func:`abort` of ``reqs`` (requests ``sched`` holds)."""
    aborted = [r for r in reqs if not r.finished]
    for r in aborted:
        r.finish_reason = ABORT
    sched.abort_count += len(aborted)
    gone = set(reqs)
    sched.waiting = deque(r for r in sched.waiting if r not in gone)
    sched.prefilling = [r for r in sched.prefilling if r not in gone]
    if sched.inflight is not None and all(r.finished for r in sched.inflight.rows):
        discard_inflight(sched)
    busy = set(sched.inflight.rows) if sched.inflight is not None else set()
    for r in reqs:
        if r not in busy:
            sched.release(r)
    sched.decoding = [r for r in sched.decoding if r not in gone or r in busy]
    return aborted


def make_ready(sched: Scheduler) -> list[Request]:
    """Abort every request ``sched`` still holds and, if the pools cannot be read (an error
    whose recovery was itself interrupted, e.g. by a second Ctrl-C), make them anew with fresh
    free lists. For the start of a call that owns the whole engine (``LLM``); returns the
    requests that were unfinished. Waits for the device."""
    held = sched.held()
    aborted = _abort(sched, held) if held else []
    discard_inflight(sched)
    if not pools_usable(sched.device.pools):
        renew_pools(sched)
        reset_free_lists(sched)
    return aborted


def recover(sched: Scheduler, err: BaseException) -> None:
    """After ``err`` was raised inside a step: abort every request ``sched`` holds (each is in
    one of its queues at every moment), which drops the call in flight; make new pools if the
    failure left them unreadable (the prefix cache, whose KV was in them, starts empty); and,
    no request being held now, set the free lists to every id the prefix cache does not own
    (a step that failed half-way may have taken ids that no request records). If that fails
    too, ``err`` gets a note saying so."""
    try:
        _abort(sched, sched.held())
        discard_inflight(sched)
        if not pools_usable(sched.device.pools):
            renew_pools(sched)
        reset_free_lists(sched)
    except Exception as e:
        err.add_note(f"The engine could not recover from this error ({e!r}); make a new one.")


@contextlib.contextmanager
def pools_guard(sched: Scheduler):
    """On an exception in the block, if it left the pools unusable (consumed by a failed
    program, or half replaced: a field set to ``None``), abort every request, make new pools
    of the sizes the free lists give (:func:`renew_pools`) and reset the free lists; the
    exception goes on (with a note if that fails too)."""
    shape = jax.tree_util.tree_structure(sched.device.pools)
    try:
        yield
    except BaseException as err:
        try:
            pools = sched.device.pools
            if (pools is None or jax.tree_util.tree_structure(pools) != shape
                    or not pools_usable(pools)):
                _abort(sched, sched.held())
                discard_inflight(sched)
                renew_pools(sched)
                reset_free_lists(sched)
        except Exception as e:
            err.add_note(f"The engine could not restore its pools after this error ({e!r}); "
                         "make a new one.")
        raise


def renew_pools(sched: Scheduler) -> None:
    """Zeroed pools of the sizes the free lists give, and an empty prefix cache (its stats
    kept)."""
    snaps = sched.prefix.snapshot_ids if sched.prefix is not None else None
    n_snap = snaps.size - 1 if snaps is not None else 0
    sched.device.renew(sched.book.pages.size, sched.book.slots.size, n_snap)
    if sched.prefix is not None:
        sched.prefix.clear()


def reset_free_lists(sched: Scheduler) -> None:
    """With no request held: every slot free, every page and snapshot id free but those the
    prefix cache holds, and no prefix-cache node referenced."""
    owned = sched.prefix.reset_references() if sched.prefix is not None else []
    sched.book.reset(owned)
