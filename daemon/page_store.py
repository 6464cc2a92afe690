"""One model's KV pages in an arena: the worker-side half of the prefix cache.

(Groundwork for the prefix-cache issue; not wired into the daemon yet.)
``PageStore`` ties a ``PageTree`` (which pages exist, where, what to evict) to
an arena (any writable buffer: a ``multiprocessing.shared_memory`` block's
``buf`` in the daemon) and to a model with ``seq_state``/``set_seq_state``.
Page contents go between the model and the arena only, never through a socket.

- ``restore(tokens)``: the longest cached page-aligned prefix of ``tokens``,
  always leaving at least one token to decode (its logits are needed), put
  back into the model's KV cache; the pages stay locked until ``release``.
- ``store(tokens)``: after a request, the model holds ``tokens`` (or more):
  every full page of them not cached yet is cut from the model's state and
  written into the arena (evicting per the tree's policy when needed).
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence

from tandem.protocol import CacheInfo

from .kv_pages import Layout, assemble, cut, parse
from .prefix_cache import Node, PageTree


class StateModel(Protocol):
    n_past: int

    def seq_state(self) -> bytes: ...
    def set_seq_state(self, blob, n_tokens: int) -> None: ...
    def clear(self) -> None: ...
    def decode(self, tokens: Sequence[int], logits_for: Sequence[int] = ...): ...


class PageStore:
    def __init__(self, tree: PageTree, arena: memoryview, model: StateModel, role: str = "target"):
        if len(arena) < tree.allocator.capacity:
            raise ValueError(f"the arena holds {len(arena)} bytes, less than the budget {tree.allocator.capacity}")
        self.tree = tree
        self.arena = arena
        self.model = model
        self.role = role
        self.page_tokens = tree.page_tokens
        self.layout: Optional[Layout] = None
        self.locked: list[Node] = []
        self.tokens_prefilled = 0

    def _page_bytes(self) -> int:
        assert self.layout is not None
        return self.layout.page_bytes(self.page_tokens)

    def probe_layout(self, token: int) -> Layout:
        """Learn the state layout by decoding one token (clears the model)."""
        self.model.clear()
        self.model.decode([token])
        self.layout = parse(self.model.seq_state()).layout
        self.model.clear()
        return self.layout

    def restore(self, tokens: Sequence[int]) -> int:
        """Put the longest cached prefix of ``tokens`` (at most all but one token)
        into the model; returns how many tokens it holds now (0: nothing cached,
        the model is cleared)."""
        self.release()
        self.model.clear()
        chain = self.tree.match(list(tokens)[: len(tokens) - 1], self.role) if self.layout is not None else []
        n = len(chain) * self.page_tokens
        self.tokens_prefilled += len(tokens) - n
        if not chain:
            return 0
        size = self._page_bytes()
        pages = [self.arena[node.pages[self.role].offset : node.pages[self.role].offset + size] for node in chain]
        self.model.set_seq_state(assemble(self.layout, pages, self.page_tokens), n)
        self.tree.lock(chain)
        self.locked = chain
        return n

    def info(self) -> CacheInfo:
        t = self.tree
        return CacheInfo(
            page_tokens=self.page_tokens,
            pages=t.pages(),
            bytes_used=t.allocator.used,
            bytes_budget=t.allocator.capacity,
            hits=t.stats.hits,
            misses=t.stats.misses,
            tokens_from_cache=t.stats.tokens_from_cache,
            tokens_prefilled=self.tokens_prefilled,
            evictions=t.stats.evictions,
        )

    def release(self) -> None:
        if self.locked:
            self.tree.unlock(self.locked)
            self.locked = []

    def store(self, tokens: Sequence[int]) -> int:
        """Cache every full page of ``tokens`` (which the model holds, from
        position 0) that is not cached yet; returns the pages written."""
        full = min(len(tokens), self.model.n_past) // self.page_tokens * self.page_tokens
        if full == 0:
            return 0
        state = parse(self.model.seq_state())
        if self.layout is None:
            self.layout = state.layout
        elif state.layout != self.layout:
            raise ValueError("the model's state layout changed")
        written = 0
        for node, page, new in self.tree.store(list(tokens[:full]), self.role, self._page_bytes()):
            if new:
                start = node.depth * self.page_tokens
                data = cut(state, start, start + self.page_tokens)
                self.arena[page.offset : page.offset + len(data)] = data
                written += 1
        return written
