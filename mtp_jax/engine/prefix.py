"""The engine's prefix cache: the radix tree of committed pages and the GDN snapshot ids.

:class:`PrefixStore` owns the :class:`~mtp_jax.cache.radix.RadixCache` and the free list of
snapshot ids; the pages the tree owns come from the engine's :class:`~mtp_jax.engine.pages.
PageBook`, and every method that lets pages go returns them for the book to take back (the
store never holds the book). What it does for a request:

* admission: hold back a request whose prefix another, still prefilling, is computing
  (:meth:`waits_for_prefill`); reuse the longest cached prefix (shared pages, the GDN snapshot
  to load into the slot, prefill resuming after it; :meth:`admit`);
* snapshot ids for the boundaries inside (or at the end of) prefill chunks and for rounds
  that cross one;
* insertion of committed tokens only: the prompt's full pages when its prefill completes, the
  committed output's when the request ends (never past a stop);
* release of its references and unused snapshot ids.
"""

from __future__ import annotations

from mtp_jax.cache.allocator import FreeList
from mtp_jax.cache.radix import RadixCache
from mtp_jax.engine.requests import Request

__all__ = ["PrefixStore"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixStore:
    """The radix tree (``tree``) and snapshot ids (``snapshot_ids``: ids ``1..num_snapshots``,
    0 is the trash snapshot; ``None`` without snapshots) of one engine.

    Args: ``page_size`` tokens per page; GDN snapshots every ``snapshot_interval_pages`` pages;
    ``num_snapshots`` snapshot slots in the pools; ``lookahead``: the pages hold MTP draft KV,
    so each is keyed with the token after it too (:mod:`~mtp_jax.cache.radix`)."""

    def __init__(self, page_size: int, snapshot_interval_pages: int, num_snapshots: int,
                 lookahead: bool = True):
        self.page_size, self.interval = page_size, snapshot_interval_pages
        self.lookahead = lookahead
        self.tree = RadixCache(page_size, snapshot_interval_pages, lookahead)
        self.snapshot_ids = (FreeList(num_snapshots + 1, "prefix snapshots")
                             if num_snapshots else None)

    @property
    def snapshot_tokens(self) -> int:
        """Tokens between snapshot boundaries."""
        return self.tree.snapshot_tokens

    @property
    def stats(self):
        return self.tree.stats

    # ---- pages and ids ------------------------------------------------------------------------
    def evictable_pages(self) -> int:
        return self.tree.evictable_pages()

    def evict(self, num_pages: int) -> list[int]:
        """Evict up to ``num_pages`` unreferenced pages (least recently used leaves first);
        their snapshot ids come back here. Returns the pages."""
        pages, snapshots = self.tree.evict(num_pages)
        self.give_back_snapshots(snapshots)
        return pages

    def flush(self) -> list[int]:
        """Drop every entry no running request uses; returns their pages."""
        pages, snapshots = self.tree.flush()
        self.give_back_snapshots(snapshots)
        return pages

    def take_snapshot_id(self, req: Request | None = None, end: int = 0) -> int | None:
        """A free snapshot id, else one evicted from the tree, else (``req`` given) the id of
        ``req``'s own shallowest snapshot below ``end`` (the deeper boundary is worth more: a
        follow-up turn or a longer shared prefix resumes from the deepest one it matches),
        else ``None``."""
        if self.snapshot_ids is not None and self.snapshot_ids.num_free:
            return self.snapshot_ids.take()[0]
        sid = self.tree.evict_snapshot()
        if sid is None and req is not None:
            sid = self._own_shallowest(req, end)
        return sid

    def _own_shallowest(self, req: Request, end: int) -> int | None:
        """Take the id of ``req``'s shallowest snapshot below ``end``: one it saved and holds
        (``req.snapshots``), or one on a tree node only it references (a conversation's
        earlier turns: every snapshot of the chain is on the running turn's path), but not at
        or above a point where the tree branches (a prefix other sequences share, such as a
        system prompt, keeps its snapshots)."""
        holds: dict[int, int] = {}
        for n in req.prefix_nodes:
            holds[id(n)] = holds.get(id(n), 0) + 1
        shared = max((n.depth_tokens for n in req.prefix_nodes if len(n.children) > 1),
                     default=0)
        nodes = {n.depth_tokens: n for n in req.prefix_nodes
                 if n.snapshot is not None and n.ref == holds[id(n)]
                 and n.depth_tokens > shared}
        own = [p for p in req.snapshots if p < end] + [p for p in nodes if p < end]
        if not own:
            return None
        p = min(own)
        if p in req.snapshots:
            return req.snapshots.pop(p)
        sid, nodes[p].snapshot = nodes[p].snapshot, None
        return sid

    def give_back_snapshots(self, ids) -> None:
        if ids:
            self.snapshot_ids.give_back(list(ids))

    # ---- a request ----------------------------------------------------------------------------
    def admit(self, req: Request) -> int | None:
        """Reuse the longest cached prefix of ``req``'s prompt (:meth:`RadixCache.lookup`):
        its pages become the request's first pages (owned by the tree), prefill resumes after
        them; ``req.redraft`` is set when the last page's final draft row was written for
        another next token (the caller then gives the request a copy of that page,
        :meth:`private_last_page`). Returns the snapshot id whose GDN state the slot must
        load, or ``None`` on a miss."""
        m = self.tree.lookup(req.prompt_ids)
        self.tree.acquire(m.path, len(req.prompt_ids))
        if not m.path:
            return None
        req.prefix_nodes = list(m.path)
        req.pages = [n.page for n in m.path]
        req.tree_pages = set(req.pages)
        req.prefilled = req.cached_tokens = len(m.path) * self.page_size
        req.redraft = m.redraft
        return m.snapshot

    def waits_for_prefill(self, req: Request, prefilling: list[Request]) -> bool:
        """Whether waiting request ``req`` should stay waiting until a request still
        prefilling has inserted its prompt: their prompts share a deeper snapshot boundary
        (leaving ``req`` one token to prefill) than the tree would give ``req`` now. Prompts
        sharing a prefix that arrive together then compute it once (as SGLang holds back a
        request whose prefix another in its batch is computing). The n > 1 samples of a
        prompt are held by their callers (:mod:`mtp_jax.engine.samples`)."""
        st = self.snapshot_tokens
        best = 0
        for other in prefilling:
            if other.prefilled >= len(other.prompt_ids):
                continue
            n = _common_prefix(req.prompt_ids, other.prompt_ids)
            best = max(best, min(n, len(req.prompt_ids) - 1) // st * st)
        if best == 0:
            return False
        return best > len(self.tree.lookup(req.prompt_ids).path) * self.page_size

    def private_last_page(self, req: Request, page: int) -> int:
        """Swap the last reused page of ``req`` for ``page`` (the request's own; the caller
        copies the tree's page into it before anything writes there) and drop the request's
        reference to the tree's node. Returns the tree's page (the copy's source)."""
        node = req.prefix_nodes.pop()
        self.tree.release([node])
        req.tree_pages.discard(node.page)
        req.pages[-1] = page
        return node.page

    def chunk_snapshots(self, req: Request, start: int, end: int) -> dict[int, int]:
        """Before a prefill chunk of positions ``start .. end-1``: a snapshot id for each
        boundary in ``start+1 .. end`` not saved yet (:meth:`take_snapshot_id`; a boundary
        left without one when none can be had is not saved), recorded in ``req.snapshots``.
        Returns ``{boundary: id}`` of the chunk's boundaries that still hold their id (one
        that went to a deeper boundary of the same chunk, out of ids, is not saved twice)."""
        st = self.snapshot_tokens
        taken = []
        for p in range((start // st + 1) * st, end + 1, st):
            if p in req.snapshots:
                continue
            sid = self.take_snapshot_id(req, p)
            if sid is not None:
                req.snapshots[p] = sid
                taken.append(p)
        return {p: req.snapshots[p] for p in taken if p in req.snapshots}

    def insert_prompt(self, req: Request) -> list[int]:
        """Insert the prompt's full pages (committed; the first output token is the lookahead
        of a page ending at the prompt's end). Returns the pages the tree let go (for the
        book's free list)."""
        tokens = req.prompt_ids + req.output_ids[:1]
        held, freed = self._insert(req, tokens, len(req.prompt_ids))
        req.prefix_nodes += held
        return freed

    def insert_committed(self, req: Request) -> list[int]:
        """At a request's end, insert the full pages of its committed tokens (prompt and kept
        output; the last output token is the lookahead), with the snapshots taken on the way.
        Nothing past a stop is inserted: the committed count is the kept tokens minus the
        pending one. Returns the pages the tree let go."""
        tokens = req.prompt_ids + req.output_ids
        held, freed = self._insert(req, tokens, min(len(tokens) - 1, req.position))
        self.tree.release(held)  # the request is leaving; the tree keeps the pages
        return freed

    def _insert(self, req: Request, tokens: list[int], committed: int) -> tuple[list, list]:
        held, owned, unused, freed = self.tree.insert(tokens, committed, req.pages,
                                                      req.snapshots)
        req.tree_pages |= set(owned)
        self.give_back_snapshots(unused)
        req.snapshots = {}
        return held, freed

    def release(self, req: Request) -> None:
        """Drop ``req``'s references to tree nodes and give back its snapshot ids."""
        self.tree.release(req.prefix_nodes)
        self.give_back_snapshots(req.snapshots.values())
        req.prefix_nodes, req.snapshots = [], {}

    # ---- recovery and resizing ----------------------------------------------------------------
    def clear(self) -> None:
        """An empty tree (its stats kept) and every snapshot id free: for pools made anew."""
        stats = self.tree.stats
        self.tree = RadixCache(self.page_size, self.interval, self.lookahead)
        self.tree.stats = stats
        if self.snapshot_ids is not None:
            self.snapshot_ids.reset()

    def reset_references(self) -> list[int]:
        """With no request in the engine: no node referenced, every snapshot id free but those
        the tree holds. Returns the pages the tree owns."""
        pages, snapshots = self.tree.owned()
        self.tree.drop_references()
        if self.snapshot_ids is not None:
            self.snapshot_ids.reset(snapshots)
        return pages
