"""The prefix cache's bookkeeping: pages of KV state, a tree keyed on content
and full prefix, a byte budget and the eviction policy. Plain classes, no model.

(Groundwork for the prefix-cache issue: the shared-memory arena, the workers'
page reads/writes and the daemon wiring build on these.)

**Pages and the tree.** The cache holds KV state in pages of ``page_tokens``
tokens. The tree is a radix tree whose edges are whole pages: a node is one
page, its key the page's tokens, its path from the root everything before it.
So a page is found only by walking its whole prefix, and two prompts whose
pages hold the same tokens after different prefixes reach different nodes:
they can never share a page. Only full pages are cached (a partial last page is
prefilled again: at most ``page_tokens - 1`` tokens).

Each node holds one page per model (``role``: "target", "drafter"): each an
extent of the arena. Matching walks the tree along the request's tokens, per
role (a node may hold the target's page but not yet the drafter's).

**Budget.** ``ExtentAllocator`` hands out byte ranges of the arena, first fit,
coalescing freed neighbours; the sum of live extents never exceeds its
capacity. When a page does not fit, ``PageTree.allocate`` evicts until it does,
or gives up (the page is then simply not cached).

**Eviction.** Only unlocked leaves are evicted (a page whose descendants are
cached is worth keeping at least as long as they are; pages of the running
request are locked). Among them: the least recently used first, by buckets of
``age_bucket_seconds`` (5 s): leaves used within the same bucket count as the
same age, and among those the shortest prefix goes first (it saves the least
prefill time for the same memory), then the least recently used. Evicting a
leaf frees all its pages (every role) and may make its parent a leaf.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence


class ExtentAllocator:
    """Byte ranges of an arena of ``capacity`` bytes: first fit, coalescing."""

    def __init__(self, capacity: int, align: int = 64):
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.align = align
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []  # (offset, size), sorted
        self._live: dict[int, int] = {}  # offset -> size
        self.used = 0

    def _round(self, size: int) -> int:
        return -(-size // self.align) * self.align

    def alloc(self, size: int) -> Optional[int]:
        if size <= 0:
            raise ValueError("size must be > 0")
        size = self._round(size)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self._live[offset] = size
                self.used += size
                return offset
        return None

    def free(self, offset: int) -> None:
        size = self._live.pop(offset)
        self.used -= size
        i = bisect.bisect_left(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # coalesce with the next, then with the previous
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            self._free[i] = (offset, size + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]

    def size_of(self, offset: int) -> int:
        return self._live[offset]

    def largest_free(self) -> int:
        return max((s for _, s in self._free), default=0)


@dataclass(frozen=True)
class Page:
    offset: int
    size: int  # bytes, as allocated


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...]
    parent: Optional["Node"]
    depth: int  # pages before this one
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    pages: dict[str, Page] = field(default_factory=dict)  # role -> page
    last_used: float = 0.0
    locks: int = 0
    serial: int = 0  # creation order, for stable tie-breaking

    @property
    def prefix_tokens(self) -> int:
        """Tokens up to the end of this page."""
        return (self.depth + 1) * len(self.tokens)


@dataclass
class CacheStats:
    hits: int = 0  # lookups that found at least one page
    misses: int = 0
    tokens_from_cache: int = 0
    evictions: int = 0  # nodes evicted
    failed_allocations: int = 0  # pages not cached for want of room


class PageTree:
    def __init__(
        self,
        page_tokens: int,
        allocator: ExtentAllocator,
        clock: Callable[[], float] = time.monotonic,
        age_bucket_seconds: float = 5.0,
    ):
        if page_tokens <= 0:
            raise ValueError("page_tokens must be > 0")
        self.page_tokens = page_tokens
        self.allocator = allocator
        self.clock = clock
        self.age_bucket_seconds = age_bucket_seconds
        self.root = Node(tokens=(), parent=None, depth=-1)
        self.stats = CacheStats()
        self._serial = itertools.count()

    # ------------------------------------------------------------------ walking

    def _pages_of(self, tokens: Sequence[int]) -> Iterator[tuple[int, ...]]:
        n = self.page_tokens
        for start in range(0, len(tokens) - len(tokens) % n, n):
            yield tuple(tokens[start : start + n])

    def match(self, tokens: Sequence[int], role: str) -> list[Node]:
        """The longest chain of cached pages of ``role`` that ``tokens`` starts
        with (possibly empty). Touches them (they count as just used)."""
        chain: list[Node] = []
        node = self.root
        for key in self._pages_of(tokens):
            child = node.children.get(key)
            if child is None or role not in child.pages:
                break
            chain.append(child)
            node = child
        now = self.clock()
        for n in chain:
            n.last_used = now
        if chain:
            self.stats.hits += 1
            self.stats.tokens_from_cache += len(chain) * self.page_tokens
        else:
            self.stats.misses += 1
        return chain

    def insert(self, tokens: Sequence[int]) -> list[Node]:
        """Make sure the tree has a node for every full page of ``tokens``;
        returns the whole chain (existing and new nodes), touched."""
        chain: list[Node] = []
        node = self.root
        now = self.clock()
        for key in self._pages_of(tokens):
            child = node.children.get(key)
            if child is None:
                child = Node(tokens=key, parent=node, depth=node.depth + 1, serial=next(self._serial))
                node.children[key] = child
            child.last_used = now
            chain.append(child)
            node = child
        return chain

    def store(self, tokens: Sequence[int], role: str, size: int) -> list[tuple[Node, Page, bool]]:
        """Insert ``tokens`` and give each full page a ``role`` page of ``size``
        bytes, in order, stopping at the first that does not fit (a page past a
        gap can never be matched). The chain is locked meanwhile, so making room
        never evicts the chain's own nodes. Returns (node, page, new) for every
        page that has one, new = it still has to be written."""
        chain = self.insert(tokens)
        self.lock(chain)
        out = []
        try:
            for node in chain:
                new = role not in node.pages
                page = self.allocate(node, role, size)
                if page is None:
                    break
                out.append((node, page, new))
        finally:
            self.unlock(chain)
        return out

    # ------------------------------------------------------------------ locks

    def lock(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            n.locks += 1

    def unlock(self, nodes: Sequence[Node]) -> None:
        for n in nodes:
            if n.locks <= 0:
                raise ValueError("unlock of a node that is not locked")
            n.locks -= 1

    # ------------------------------------------------------------------ pages and eviction

    def allocate(self, node: Node, role: str, size: int) -> Optional[Page]:
        """A page of ``size`` bytes for ``node``'s ``role``, evicting what the
        policy says until it fits; None if it cannot fit (everything left is
        locked or on the path to ``node``). The node is locked meanwhile."""
        if role in node.pages:
            return node.pages[role]
        if node.parent is None or node.parent.children.get(node.tokens) is not node:
            raise ValueError("the node is no longer in the tree (evicted); insert the tokens again")
        node.locks += 1  # neither it nor (being an ancestor of nothing evictable) its path may go
        path = []
        p = node.parent
        while p is not None and p is not self.root:
            path.append(p)
            p = p.parent
        self.lock(path)
        try:
            while True:
                offset = self.allocator.alloc(size)
                if offset is not None:
                    page = Page(offset, self.allocator.size_of(offset))
                    node.pages[role] = page
                    return page
                victim = self.victim()
                if victim is None:
                    self.stats.failed_allocations += 1
                    return None
                self.evict(victim)
        finally:
            self.unlock(path)
            node.locks -= 1

    def leaves(self) -> list[Node]:
        out = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def eviction_order(self) -> list[Node]:
        """Unlocked leaves, first to go first (see the module docstring)."""
        now = self.clock()
        candidates = [n for n in self.leaves() if n.locks == 0]

        def key(n: Node):
            age_bucket = int((now - n.last_used) // self.age_bucket_seconds)
            return (-age_bucket, n.depth, n.last_used, n.serial)

        return sorted(candidates, key=key)

    def victim(self) -> Optional[Node]:
        order = self.eviction_order()
        return order[0] if order else None

    def evict(self, node: Node) -> None:
        if node.children or node.locks:
            raise ValueError("only unlocked leaves can be evicted")
        for page in node.pages.values():
            self.allocator.free(page.offset)
        node.pages.clear()
        assert node.parent is not None
        del node.parent.children[node.tokens]
        self.stats.evictions += 1

    def clear(self) -> int:
        """Drop every unlocked page; returns the number of nodes dropped."""
        dropped = 0
        while True:
            victim = self.victim()
            if victim is None:
                return dropped
            self.evict(victim)
            dropped += 1

    # ------------------------------------------------------------------ accounting

    def nodes(self) -> list[Node]:
        out = []
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def pages(self) -> int:
        return sum(len(n.pages) for n in self.nodes())
