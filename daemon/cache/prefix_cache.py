"""The prefix cache's bookkeeping: pages of KV state, a tree keyed on content
and full prefix, a byte budget and the eviction policy. Plain classes, no model.

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

**Surviving a worker restart.** ``snapshot`` writes the tree (tokens, pages,
each page's checksum) as plain msgpack-able lists; ``load`` rebuilds it over a
fresh allocator, keeping a page only if its bytes in the arena still match its
checksum (a worker killed between evicting a page and writing the next
snapshot leaves the old snapshot naming bytes that were overwritten) and its
parent kept its page of the same role (otherwise it could never be matched).
"""

from __future__ import annotations

import bisect
import collections
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

    def reserve(self, offset: int, size: int) -> bool:
        """Take ``[offset, offset + size)`` (as ``alloc`` would round it) if it
        is wholly free; False if any of it is not."""
        size = self._round(size)
        i = bisect.bisect_right(self._free, (offset, float("inf"))) - 1
        if i < 0:
            return False
        start, free = self._free[i]
        if offset < start or offset + size > start + free:
            return False
        del self._free[i]
        if offset + size < start + free:
            self._free.insert(i, (offset + size, start + free - offset - size))
        if offset > start:
            self._free.insert(i, (start, offset - start))
        self._live[offset] = size
        self.used += size
        return True

    def size_of(self, offset: int) -> int:
        return self._live[offset]

    def largest_free(self) -> int:
        return max((s for _, s in self._free), default=0)


@dataclass(frozen=True)
class Page:
    offset: int
    size: int  # bytes, as allocated
    crc: Optional[int] = None  # zlib.crc32 of its bytes once written; None: not written yet


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
    disk_key: Optional[bytes] = None  # its key in the disk tier, once computed (daemon/cache/disk_cache.py)
    to_disk: bool = False  # queued to be written to the disk tier

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

    def peek(self, tokens: Sequence[int], role: str) -> list[Node]:
        """The chain ``match`` would return, without touching or counting anything."""
        chain: list[Node] = []
        node = self.root
        for key in self._pages_of(tokens):
            child = node.children.get(key)
            if child is None or role not in child.pages:
                break
            chain.append(child)
            node = child
        return chain

    def match(self, tokens: Sequence[int], role: str, count: bool = True) -> list[Node]:
        """The longest chain of cached pages of ``role`` that ``tokens`` starts
        with (possibly empty). Touches them (they count as just used); counts a
        hit or a miss unless ``count`` is False."""
        chain = self.peek(tokens, role)
        now = self.clock()
        for n in chain:
            n.last_used = now
        if not count:
            return chain
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

    def drop_page(self, node: Node, role: str) -> None:
        """Free ``node``'s ``role`` page (one that was never written); a node
        left without pages or children leaves the tree."""
        page = node.pages.pop(role, None)
        if page is not None:
            self.allocator.free(page.offset)
        if not node.pages and not node.children and node.locks == 0 and node.parent is not None:
            if node.parent.children.get(node.tokens) is node:
                del node.parent.children[node.tokens]

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
        """Drop every unlocked page (not counted as evictions); returns the
        number of nodes dropped."""
        dropped, evictions = 0, self.stats.evictions
        while True:
            victim = self.victim()
            if victim is None:
                self.stats.evictions = evictions
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

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> dict:
        """The tree as plain data: nodes parents first, each
        ``[parent index (-1: root), tokens, {role: [offset, size, crc]}]``;
        pages not written yet (no checksum) are left out."""
        out: list = []
        index = {id(self.root): -1}
        queue = collections.deque(self.root.children.values())
        while queue:
            n = queue.popleft()
            pages = {r: [p.offset, p.size, p.crc] for r, p in n.pages.items() if p.crc is not None}
            if not pages:
                continue  # nothing under it can be matched either
            index[id(n)] = len(out)
            out.append([index[id(n.parent)], list(n.tokens), pages])
            queue.extend(c for c in n.children.values())
        return {"page_tokens": self.page_tokens, "nodes": out}

    def load(self, snapshot: dict, intact: Callable[[Page], bool]) -> tuple[int, int]:
        """Rebuild the tree from ``snapshot`` (into an empty tree) keeping the
        pages for which ``intact(page)`` holds; returns (pages kept, pages dropped)."""
        if self.root.children or self.allocator.used:
            raise ValueError("load into an empty tree")
        if snapshot.get("page_tokens") != self.page_tokens:
            raise ValueError(f"the snapshot has pages of {snapshot.get('page_tokens')} tokens, not {self.page_tokens}")
        nodes: list[Optional[Node]] = []
        kept = dropped = 0
        for parent_index, tokens, pages in snapshot["nodes"]:
            parent = self.root if parent_index < 0 else nodes[parent_index]
            key = tuple(int(t) for t in tokens)
            node = None
            if parent is not None and len(key) == self.page_tokens and key not in parent.children:
                node = Node(tokens=key, parent=parent, depth=parent.depth + 1, serial=next(self._serial))
                for role, (offset, size, crc) in pages.items():
                    page = Page(int(offset), int(size), int(crc))
                    reachable = parent is self.root or role in parent.pages
                    if reachable and intact(page) and self.allocator.reserve(page.offset, page.size):
                        node.pages[role] = page
                if node.pages:
                    parent.children[key] = node
                else:
                    node = None
            kept += len(node.pages) if node is not None else 0
            dropped += len(pages) - (len(node.pages) if node is not None else 0)
            nodes.append(node)
        return kept, dropped
