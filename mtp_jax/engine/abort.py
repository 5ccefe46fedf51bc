"""Aborting requests, and recovering the engine from an error raised inside a step.

:class:`AbortMixin` is a part of :class:`mtp_jax.engine.engine.Engine`: ``abort`` takes requests
out (``finish_reason`` ``"abort"``, everything they hold given back), ``_recover`` leaves the
engine empty and usable after an exception in ``step()``, and ``_pools_guard`` does the same
for the pools after one in ``resize_cache`` or ``warmup`` (docs/design.md, "Host side")."""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Iterable

import jax

from mtp_jax.cache.radix import RadixCache
from mtp_jax.engine.pools import make_pools
from mtp_jax.engine.requests import ABORT, Request
from mtp_jax.models.loader import DTYPES


def _pools_usable(pools) -> bool:
    """Whether every pool array can still be read: a program that failed may have consumed its
    donated input pools, or left its output pools holding the error (waits for the device)."""
    try:
        jax.block_until_ready(pools)
    except Exception:
        return False
    return True


class AbortMixin:
    """Abort and error recovery; uses the engine's queues (``waiting``, ``prefilling``,
    ``decoding``), ``_inflight``, ``_release``, free lists (``slots``, ``pages``,
    ``snapshot_ids``), ``prefix``, ``pools``, ``model``, ``cfg``, ``page_size``, ``k`` and
    ``proposer_kind``."""

    abort_count = 0  # requests aborted so far (a caller's cue to look for them)

    def _discard_inflight(self) -> None:
        """Drop the round in flight, if any, unread; give back the snapshot ids it was given.
        The device may still be running it: later programs take the pools it returned, so they
        run after it, and the pages it writes may be handed out again."""
        f, self._inflight = self._inflight, None
        if f is not None and self.snapshot_ids is not None:
            self.snapshot_ids.give_back(f.snap_id[f.snap_row >= 0].tolist())

    def _requests(self) -> list[Request]:
        """Every request the engine holds, once each: queued, prefilling, decoding (finished
        ones not yet released too) and in the round in flight."""
        rows = self._inflight.rows if self._inflight is not None else []
        return list(dict.fromkeys([*self.waiting, *self.prefilling, *self.decoding, *rows]))

    def abort(self, requests: Iterable[Request] | None = None) -> list[Request]:
        """Abort ``requests`` (default: every request the engine holds); returns those that were
        unfinished, now with ``finish_reason`` ``"abort"``. Requests not in the engine are left
        as they are. Each leaves the queues and gives back its slot, KV pages, prefix-cache
        references and snapshot ids (nothing of it is inserted into the prefix cache). A round
        in flight that computes only finished or aborted requests is dropped unread; one that
        still computes another request runs on, and the aborted rows in it are ignored when it
        is read and released then (as rows past a stop are)."""
        held = self._requests()
        if requests is not None:
            inside = set(held)
            held = [r for r in dict.fromkeys(requests) if r in inside]
        return self._abort(held)

    def make_ready(self) -> list[Request]:
        """Abort every request the engine still holds and, if its pools cannot be read (an
        error whose recovery was itself interrupted, e.g. by a second Ctrl-C), make them anew
        with fresh free lists. For the start of a call that owns the whole engine (``LLM``);
        returns the requests that were unfinished. Waits for the device."""
        held = self._requests()
        aborted = self._abort(held) if held else []
        self._discard_inflight()
        if self.pools is None or not _pools_usable(self.pools):
            self._renew_pools()
            self._reset_free_lists()
        return aborted

    def _abort(self, reqs: list[Request]) -> list[Request]:
        """:meth:`abort` of ``reqs`` (requests the engine holds)."""
        aborted = [r for r in reqs if not r.finished]
        for r in aborted:
            r.finish_reason = ABORT
        self.abort_count += len(aborted)
        gone = set(reqs)
        self.waiting = deque(r for r in self.waiting if r not in gone)
        self.prefilling = [r for r in self.prefilling if r not in gone]
        if self._inflight is not None and all(r.finished for r in self._inflight.rows):
            self._discard_inflight()
        busy = set(self._inflight.rows) if self._inflight is not None else set()
        for r in reqs:
            if r not in busy:
                self._release(r)
        self.decoding = [r for r in self.decoding if r not in gone or r in busy]
        return aborted

    def _recover(self, err: BaseException) -> None:
        """After ``err`` was raised inside :meth:`step`: abort every request the engine holds
        (a step keeps each request in one of its queues at every moment), which drops the
        round in flight; make new pools if the failure left them unreadable (the prefix cache, whose
        KV was in them, starts empty); and, the engine now holding no request, set the free
        lists to every id the prefix cache does not own (a step that failed half-way may have
        taken ids that no request records). If that fails too, ``err`` gets a note saying so."""
        try:
            self._abort(self._requests())
            self._discard_inflight()
            if not _pools_usable(self.pools):
                self._renew_pools()
            self._reset_free_lists()
        except Exception as e:
            err.add_note(f"The engine could not recover from this error ({e!r}); make a new "
                         "one.")

    @contextlib.contextmanager
    def _pools_guard(self):
        """On an exception in the block, if it left the pools unusable (consumed by a failed
        program, or half replaced: a field set to ``None``), abort every request, make new
        pools of the sizes the free lists give (:meth:`_renew_pools`) and reset the free
        lists; the exception goes on (with a note if that fails too)."""
        shape = jax.tree_util.tree_structure(self.pools)
        try:
            yield
        except BaseException as err:
            try:
                if (self.pools is None or jax.tree_util.tree_structure(self.pools) != shape
                        or not _pools_usable(self.pools)):
                    self._abort(self._requests())
                    self._discard_inflight()
                    self._renew_pools()
                    self._reset_free_lists()
            except Exception as e:
                err.add_note(f"The engine could not restore its pools after this error "
                             f"({e!r}); make a new one.")
            raise

    def _renew_pools(self) -> None:
        """Zeroed pools of the current sizes, and an empty prefix cache (its stats kept)."""
        self.pools = None  # the old buffers go first
        n_snap = self.snapshot_ids.size - 1 if self.snapshot_ids is not None else 0
        self.pools = make_pools(self.model.cfg, num_pages=self.pages.size,
                                page_size=self.page_size, slots=self.slots.size, k=self.k,
                                mtp=self.proposer_kind == "mtp",
                                dtype=DTYPES[self.model.dtype], num_snapshots=n_snap)
        if self.prefix is not None:
            stats = self.prefix.stats
            self.prefix = RadixCache(self.page_size, self.cfg.snapshot_interval_pages)
            self.prefix.stats = stats

    def _reset_free_lists(self) -> None:
        """With no request in the engine: every slot free, every page and snapshot id free but
        those the prefix cache holds, and no prefix-cache node referenced."""
        pages, snapshots = self.prefix.owned() if self.prefix is not None else ([], [])
        if self.prefix is not None:
            self.prefix.drop_references()
        self.slots.reset()
        self.pages.reset(pages)
        if self.snapshot_ids is not None:
            self.snapshot_ids.reset(snapshots)
