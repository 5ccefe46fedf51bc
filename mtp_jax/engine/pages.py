"""Page and slot accounting of one engine (host side).

:class:`PageBook` hands out KV pages and request slots and keeps each admitted request's
guarantee: a request is admitted only when the free pages (plus those the prefix cache could
evict) minus what the requests already admitted are still owed cover its final length
(``reserve``), so a running request never lacks a page for a token it must commit. Beyond that
guarantee a request takes pages for its verify window and draft chain when they are spare, and
gives back what lies past its committed length after each round.

Page 0 and slot 0 are the trash page and slot that padding rows write to; they are never handed
out.
"""

from __future__ import annotations

import numpy as np

from mtp_jax.cache.allocator import FreeList, pages_needed
from mtp_jax.engine.prefix import PrefixStore
from mtp_jax.engine.requests import Request

__all__ = ["PageBook"]


class PageBook:
    """KV pages (``pages``), request slots (``slots``) and the guarantees of the requests that
    hold a slot.

    Args: ``num_pages`` and ``num_slots`` (trash ids included), ``page_size`` tokens per page,
    ``max_pages_per_req`` (the width of a page table row), ``prefix``: the prefix cache whose
    unreferenced pages may be evicted when the free list runs short (None: no cache)."""

    def __init__(self, num_pages: int, num_slots: int, page_size: int, max_pages_per_req: int,
                 prefix: PrefixStore | None):
        self.page_size, self.max_pages_per_req = page_size, max_pages_per_req
        self.prefix = prefix
        self.pages = FreeList(num_pages, "KV pages")
        self.slots = FreeList(num_slots, "request slots")
        self._holders: dict[Request, None] = {}  # requests holding a slot, in admission order

    @property
    def max_requests(self) -> int:
        """Requests that can hold a slot at once (``max_running_requests``)."""
        return self.slots.size - 1

    def pages_for(self, num_tokens: int) -> int:
        return pages_needed(num_tokens, self.page_size)

    def available(self) -> int:
        """Free pages plus pages the prefix cache could evict."""
        return self.pages.num_free + (self.prefix.evictable_pages() if self.prefix else 0)

    def owed(self) -> int:
        """Pages still guaranteed to admitted requests beyond what they hold."""
        return sum(max(0, r.reserve - len(r.pages)) for r in self._holders)

    def can_admit(self, req: Request) -> bool:
        """A slot is free and the spare pages cover ``req.reserve``."""
        return self.slots.num_free > 0 and self.available() - self.owed() >= req.reserve

    def admit(self, req: Request) -> None:
        """Give ``req`` a slot and hold its guarantee (``req.reserve`` pages)."""
        req.slot = self.slots.take()[0]
        self._holders[req] = None

    def take(self, n: int) -> list[int]:
        """``n`` pages, evicting prefix-cache pages when the free list is short."""
        if self.pages.num_free < n and self.prefix is not None:
            self.pages.give_back(self.prefix.evict(n - self.pages.num_free))
        return self.pages.take(n)

    def grow(self, req: Request, num_tokens: int) -> None:
        """Give ``req`` pages for ``num_tokens`` positions: from its guarantee first, then from
        the spare pages beyond what other requests are owed; stops short when they run out."""
        want = min(self.pages_for(num_tokens), self.max_pages_per_req)
        while len(req.pages) < want:
            if len(req.pages) >= req.reserve and self.available() - self.owed() <= 0:
                break
            req.pages += self.take(1)

    def shrink(self, req: Request, num_tokens: int) -> None:
        """Give back ``req``'s pages past ``num_tokens`` positions."""
        keep = self.pages_for(num_tokens)
        if len(req.pages) > keep:
            self.pages.give_back(req.pages[keep:])  # never prefix-cache pages (all < keep)
            del req.pages[keep:]

    def release(self, req: Request) -> None:
        """Give back ``req``'s pages (but those the prefix cache owns) and slot; its guarantee
        ends. The request's prefix references are the prefix store's to release."""
        self.pages.give_back([p for p in req.pages if p not in req.tree_pages])
        self.slots.give_back([req.slot])
        self._holders.pop(req, None)
        req.pages, req.slot, req.tree_pages = [], 0, set()

    def table(self, reqs: list[Request | None]) -> np.ndarray:
        """Page tables ``[len(reqs), max_pages_per_req]`` int32 (``None`` rows and the tail of
        each row: the trash page 0)."""
        t = np.zeros((len(reqs), self.max_pages_per_req), np.int32)
        for i, r in enumerate(reqs):
            if r is not None:
                t[i, :len(r.pages)] = r.pages
        return t

    # ---- recovery and resizing ----------------------------------------------------------------
    def reset(self, owned_pages=()) -> None:
        """With no request in the engine: every slot free, every page free but ``owned_pages``
        (the prefix cache's), no guarantee held."""
        self._holders.clear()
        self.slots.reset()
        self.pages.reset(owned_pages)

    def resize(self, num_pages: int | None = None, num_slots: int | None = None) -> None:
        """New free lists of these sizes (an idle engine's; ``None``: keep that one)."""
        if num_pages is not None:
            self.pages = FreeList(num_pages, "KV pages")
        if num_slots is not None:
            self.slots = FreeList(num_slots, "request slots")
