"""Prefix cache: a radix tree over committed tokens at page granularity, with one token of
lookahead (host side).

Each node is one full KV page: the ``page_size`` tokens it holds and, with MTP draft KV in the
pages (``lookahead=True``), the token that follows them. The lookahead is part of the key then
because the page's last MTP draft-KV row (position ``end - 1``) pairs the target hidden at
``end - 1`` with token ``end``: a request may reuse the page's draft rows only when its own
token ``end`` is the same. Keyed this way, one reuse length serves the target KV, the draft KV
and the GDN state. Without draft KV (speculation off, or drafts from the host) the target KV
and the GDN state depend on the page's tokens alone, so the key holds no lookahead (-1) and a
prompt sharing exactly a snapshot boundary's tokens reuses them all.

A prompt whose tokens match a cached page but whose next token differs still reuses it (and
everything below) when the page ends on a snapshot boundary (:meth:`RadixCache.lookup`): its
target KV, GDN snapshot and every draft row but the last depend on the shared tokens only, so
the engine copies the page and rewrites that one row from the hidden kept with the snapshot
(:mod:`mtp_jax.engine.snapshots`). Likewise a matched node without a snapshot of its own
resumes from a same-token sibling's (the GDN state depends on the tokens alone).

GDN layers cannot resume from KV pages alone; they need the recurrent and conv state at the
reuse point. Snapshots of that state are taken at aligned boundaries, every
``page_size * snapshot_interval_pages`` tokens (during prefill and during decoding rounds), and
hang on the node that ends there; a hit resumes at the deepest matched node that holds one.

Nodes are reference-counted by the requests using them; unreferenced leaves are evicted least
recently used first, returning their page (and snapshot) to the pools. Only committed tokens are
ever inserted.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence


@dataclasses.dataclass(eq=False)
class Node:
    key: tuple  # (page tokens, lookahead token)
    page: int
    parent: "Node | None"
    children: dict = dataclasses.field(default_factory=dict)
    ref: int = 0
    last_used: int = 0
    snapshot: int | None = None  # snapshot id of the GDN state at this node's end

    @property
    def depth_tokens(self) -> int:
        n, d = self, 0
        while n.parent is not None:
            d += len(n.key[0])
            n = n.parent
        return d


@dataclasses.dataclass
class PrefixMatch:
    """What a prompt reuses (:meth:`RadixCache.lookup`): ``path``, the nodes of its reused
    pages in order; ``snapshot``, the id of the GDN snapshot at their end (``None`` on a
    miss); ``redraft``: the last node's lookahead differs from the prompt's next token, so
    its final draft-KV row must be rewritten (in a copy of the page) before use."""

    path: list
    snapshot: int | None = None
    redraft: bool = False


@dataclasses.dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0


class RadixCache:
    def __init__(self, page_size: int, snapshot_interval_pages: int, lookahead: bool = True):
        self.page_size, self.lookahead = page_size, lookahead
        self.snapshot_tokens = page_size * snapshot_interval_pages
        self.root = Node(key=((), -1), page=-1, parent=None)
        self._clock = itertools.count(1)
        self.stats = PrefixStats()

    # ---- lookup --------------------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int], limit: int):
        ps = self.page_size
        for i in range(limit // ps):
            end = (i + 1) * ps
            if end >= len(tokens):
                return
            yield (tuple(tokens[i * ps:end]), int(tokens[end]) if self.lookahead else -1)

    def match(self, tokens: Sequence[int]) -> list[Node]:
        """Nodes of the longest reusable prefix of ``tokens``: it ends at the deepest matched
        node holding a GDN snapshot and leaves at least one token to prefill. Empty on a miss."""
        path, node = [], self.root
        for key in self._keys(tokens, len(tokens) - 1):
            node = node.children.get(key)
            if node is None:
                break
            path.append(node)
        while path and path[-1].snapshot is None:
            path.pop()
        return path

    def lookup(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest reusable prefix of ``tokens`` (:class:`PrefixMatch`), leaving at least
        one token to prefill. As :meth:`match`, and with lookahead keys two more ways to end
        on a snapshot: where the keyed walk stops at a page whose tokens match a child's but
        whose next token does not, that child, if it holds a snapshot, ends the match with
        ``redraft``; a matched node without a snapshot takes a same-token sibling's."""
        path, node = [], self.root
        for key in self._keys(tokens, len(tokens) - 1):
            child = node.children.get(key)
            if child is None:
                other = self._same_tokens_with_snapshot(node, key[0])
                if other is not None:
                    return PrefixMatch(path + [other], other.snapshot, redraft=True)
                break
            path.append(child)
            node = child
        while path:
            last = path[-1]
            if last.snapshot is not None:
                return PrefixMatch(path, last.snapshot)
            other = self._same_tokens_with_snapshot(last.parent, last.key[0])
            if other is not None:
                return PrefixMatch(path, other.snapshot)
            path.pop()
        return PrefixMatch([])

    def _same_tokens_with_snapshot(self, parent: Node, page_tokens: tuple) -> Node | None:
        """A child of ``parent`` holding ``page_tokens`` (any lookahead) and a snapshot; only
        with lookahead keys (without them a page has one node)."""
        if not self.lookahead:
            return None
        for key, child in parent.children.items():
            if key[0] == page_tokens and child.snapshot is not None:
                return child
        return None

    def acquire(self, path: list[Node], prompt_tokens: int) -> None:
        now = next(self._clock)
        for n in path:
            n.ref += 1
            n.last_used = now
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_tokens
        if path:
            self.stats.hits += 1
            self.stats.reused_tokens += len(path) * self.page_size

    def release(self, nodes: list[Node]) -> None:
        now = next(self._clock)
        for n in nodes:
            n.ref -= 1
            n.last_used = now

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], num_committed: int, pages: Sequence[int],
               snapshots: dict[int, int]) -> tuple[list[Node], list[int], list[int], list[int]]:
        """Insert the full pages of ``tokens[:num_committed]`` (``tokens`` must hold the token
        after them). ``pages[i]`` holds page i; ``snapshots`` maps an end position to a snapshot
        id. Returns ``(nodes the caller now references, pages now owned by the tree,
        snapshot ids the tree did not take, pages the tree let go)``; the caller keeps (and
        later frees) every page not returned as owned, and frees those let go.

        A node already holding another page of the same tokens that no request uses takes the
        caller's page instead and lets its own go: referencing it as it was would pin a second
        copy of the tokens that the caller's page guarantee counted as evictable (a request
        that re-prefilled tokens past its reuse point could then run out of pages)."""
        node, held, owned, freed = self.root, [], [], []
        taken = set()
        now = next(self._clock)
        for i, key in enumerate(self._keys(tokens, num_committed)):
            child = node.children.get(key)
            if child is None:
                child = Node(key=key, page=pages[i], parent=node)
                node.children[key] = child
                owned.append(pages[i])
            elif child.page != pages[i] and child.ref == 0:
                freed.append(child.page)
                child.page = pages[i]
                owned.append(pages[i])
            elif child.page != pages[i]:
                # A running request uses the tree's copy; keep ours private.
                pass
            end = (i + 1) * self.page_size
            if end in snapshots and child.snapshot is None and child.page == pages[i]:
                child.snapshot = snapshots[end]
                taken.add(end)
            child.ref += 1
            child.last_used = now
            held.append(child)
            node = child
        unused = [sid for end, sid in snapshots.items() if end not in taken]
        return held, owned, unused, freed

    # ---- eviction ------------------------------------------------------------------------------
    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and not n.children and n.ref == 0:
                yield n

    def evictable_pages(self) -> int:
        """Pages held only by the tree (evictable now or after their children)."""
        def count(n):
            c = sum(count(ch) for ch in n.children.values())
            return c + (1 if n is not self.root and n.ref == 0 else 0)
        return count(self.root)

    def evict(self, num_pages: int) -> tuple[list[int], list[int]]:
        """Evict least-recently-used unreferenced leaves until ``num_pages`` pages are freed.
        Returns ``(pages, snapshot ids)`` released."""
        pages, snaps = [], []
        while len(pages) < num_pages:
            leaves = sorted(self._leaves(), key=lambda n: n.last_used)
            if not leaves:
                break
            for n in leaves:
                if len(pages) >= num_pages:
                    break
                del n.parent.children[n.key]
                pages.append(n.page)
                if n.snapshot is not None:
                    snaps.append(n.snapshot)
        return pages, snaps

    def evict_snapshot(self) -> int | None:
        """Drop the least recently used snapshot of an unreferenced node; returns its id."""
        best = None
        stack = [self.root]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.snapshot is not None and n.ref == 0 and (best is None or n.last_used < best.last_used):
                best = n
        if best is None:
            return None
        sid, best.snapshot = best.snapshot, None
        return sid

    def owned(self) -> tuple[list[int], list[int]]:
        """``(pages, snapshot ids)`` the tree holds."""
        nodes = list(self._nodes())
        return [n.page for n in nodes], [n.snapshot for n in nodes if n.snapshot is not None]

    def drop_references(self) -> None:
        """Zero every node's reference count (no request uses the tree any more)."""
        for n in self._nodes():
            n.ref = 0

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    def flush(self) -> tuple[list[int], list[int]]:
        """Evict every unreferenced node."""
        return self.evict(10**12)
