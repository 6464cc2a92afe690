"""One model's KV pages in an arena: the worker-side half of the prefix cache.

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
- the drafter's pages live in the same tree (role "drafter", same budget): the
  target worker plans them here (``match_role``, ``plan``, ``seal``) and the
  drafter worker reads and writes the bytes (``read_pages``/``write_pages``).
- ``save_index``/``load_index``: the tree, written atomically to a file next to
  the arena after each request, so a restarted worker finds its pages again.
- the disk tier (``disk``, a ``DiskTier``; daemon/cache/disk_cache.py): the target's
  pages are queued when stored and written to files between requests
  (``spill``, one page per call); ``restore`` reads the pages that continue
  what the arena holds of a prompt from disk into the arena first.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import mmap
import os
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Optional, Protocol, Sequence

import msgpack

from tandem.protocol import CacheInfo

from .arena import UntrustedFile, hold, open_own
from .kv_pages import Layout, assemble, cut, parse
from .prefix_cache import Node, Page, PageTree

log = logging.getLogger("tandem.cache")

INDEX_VERSION = 1
MAX_QUEUED = 8192  # pages waiting for the disk tier before the evicted ones among them are forgotten


def map_arena(path: str, size: int) -> mmap.mmap:
    """Map the daemon's shared-memory arena at ``path``: only this user's own
    private file of at least ``size`` bytes (``UntrustedFile`` otherwise). The
    map holds the arena's shared lock (its descriptor is the map's), which tells
    a sweeping daemon that it is in use. (Not through multiprocessing's
    SharedMemory: it would register the segment with a resource tracker that
    unlinks it when this process exits, and the arena must outlive a worker.)"""
    fd = open_own(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size < size:
            raise UntrustedFile(errno.EINVAL, f"holds {os.fstat(fd).st_size} bytes, less than {size}", path)
        hold(fd)
        return mmap.mmap(fd, size)  # (it keeps a duplicate of fd, and with it the lock)
    finally:
        os.close(fd)


def write_pages(model, arena, page_tokens: int, pages: Sequence[tuple[int, int]], expect: Optional[Layout]) -> None:
    """Cut pages [start, start + page_tokens) of ``model``'s KV state into the
    arena at the given offsets; ``pages`` holds (start token, offset). Writes
    nothing unless the state's layout is ``expect`` (the pages were sized for it)."""
    state = parse(model.seq_state())
    if state.layout != expect:
        raise ValueError("the model's state layout is not the one its pages were sized for")
    for start, offset in pages:
        data = cut(state, start, start + page_tokens)
        arena[offset : offset + len(data)] = data


def read_pages(
    model, arena, layout: Layout, page_tokens: int, offsets: Sequence[int], tokens: Optional[Sequence[int]] = None
) -> int:
    """Replace ``model``'s KV state by the pages at ``offsets`` (a prefix, in
    order; of ``tokens``, where known); returns the tokens it holds now."""
    size = layout.page_bytes(page_tokens)
    n = len(offsets) * page_tokens
    blob = assemble(layout, [arena[o : o + size] for o in offsets], page_tokens)
    if tokens is None:
        model.set_seq_state(blob, n)
    else:
        model.set_seq_state(blob, n, tokens[:n])
    return n


def probe_layout(model) -> Layout:
    """The layout of ``model``'s sequence state, learnt by decoding one token
    (clears the model)."""
    model.clear()
    model.decode([model.bos_token if model.bos_token >= 0 else 0])
    layout = parse(model.seq_state()).layout
    model.clear()
    return layout


def model_identity(path: str | Path, location: bool = True) -> str:
    """Which model file the pages were computed with: its size, mtime, inode and
    a hash of its first and last MiB (the GGUF header and the start of its
    metadata; the last weights). A ``.gguf`` replaced at the same path, even by
    one of the same architecture (whose KV has the same layout), differs.
    ``location=False`` leaves out the device and inode (the disk tier's: they
    need not survive a reboot)."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    where = f"{st.st_dev}:{st.st_ino}:" if location else ""
    return f"{st.st_size}:{st.st_mtime_ns}:{where}{h.hexdigest()[:32]}"


def page_crc(arena, page: Page) -> int:
    return zlib.crc32(arena[page.offset : page.offset + page.size])


class StateModel(Protocol):
    n_past: int

    def seq_state(self) -> bytes: ...
    def set_seq_state(self, blob, n_tokens: int, tokens: Optional[Sequence[int]] = None) -> None: ...
    def clear(self) -> None: ...
    def truncate(self, n_keep: int) -> None: ...
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
        self.model_identity = ""  # the target's model file (``model_identity``): its index is valid for it only
        self.role_bytes: dict[str, int] = {}  # page size of each model that has stored pages
        self.drafter_tokens_from_cache = 0
        self.tokens_from_live = 0  # of tokens_from_cache: kept in the model's own KV from the request before
        self.disk = None  # the disk tier (a DiskTier), where there is one
        self.to_disk: collections.deque[Node] = collections.deque()  # stored pages not written to disk yet

    def _page_bytes(self) -> int:
        assert self.layout is not None
        return self.layout.page_bytes(self.page_tokens)

    def probe_layout(self) -> Layout:
        """Learn the state layout (clears the model)."""
        self.layout = probe_layout(self.model)
        return self.layout

    def restore(self, tokens: Sequence[int], live: int = 0, keep: int = 1, align: int = 1) -> int:
        """Put the longest cached prefix of ``tokens`` (leaving at least ``keep``
        tokens to read, and ending at a multiple of ``align`` tokens) into the
        model; returns how many tokens it holds now (0: nothing cached, the model
        is cleared). ``live``: the model holds exactly the first ``live`` of
        ``tokens`` from the request before (the caller cut it there); when the
        pages hold no more, they are kept, to the token, and nothing is read."""
        self.release()
        matched = self.layout is not None
        before, from_disk = self._from_disk(tokens[: max(0, len(tokens) - keep)], live) if matched else (0, 0)
        chain = self.tree.match(list(tokens)[: max(0, len(tokens) - keep)], self.role) if matched else []
        step = math.lcm(align, self.page_tokens) // self.page_tokens
        if len(chain) % step:  # pages past the last aligned end are not used (nor counted)
            aligned = chain[: len(chain) // step * step]
            self.tree.stats.tokens_from_cache -= (len(chain) - len(aligned)) * self.page_tokens
            if not aligned:
                self.tree.stats.hits -= 1
                self.tree.stats.misses += 1
            chain = aligned
        n = len(chain) * self.page_tokens
        if live and live >= n:
            stats = self.tree.stats
            if matched and not chain:  # counted as a miss: it is a hit, served from the model's own cache
                stats.misses -= 1
                stats.hits += 1
            elif not matched:
                stats.hits += 1
            stats.tokens_from_cache += live - n
            self.tokens_from_live += live
            self.tokens_prefilled += len(tokens) - live
            if chain:
                self.tree.lock(chain)  # (unlocked by release, as when they are read)
                self.locked = chain
            return live
        self.model.clear()
        if chain:
            try:
                offsets = [node.pages[self.role].offset for node in chain]
                read_pages(self.model, self.arena, self.layout, self.page_tokens, offsets, tokens)
            except Exception as exc:  # bytes that are not this model's state: drop them, read the prompt
                log.warning("prefix cache: dropping pages that could not be restored (%s: %s)", type(exc).__name__, exc)
                for node in reversed(chain):
                    self.tree.drop_page(node, self.role)
                self.tree.stats.tokens_from_cache -= n
                self.tree.stats.hits -= 1
                self.tree.stats.misses += 1
                self.model.clear()
                chain, n = [], 0
        self.tokens_prefilled += len(tokens) - n
        if not chain:
            return 0
        used = min(from_disk, n - before)  # (pages past the aligned end are kept in the arena, unused)
        if used > 0 and self.disk is not None:
            self.disk.stats.hits += 1
            self.disk.stats.tokens_from_disk += used
        self.tree.lock(chain)
        self.locked = chain
        return n

    # ------------------------------------------------------------------ the disk tier

    def _key(self, node: Node) -> bytes:
        """``node``'s key in the disk tier (its whole prefix's)."""
        from .page_file import child_key

        path = []
        while node is not self.tree.root and node.disk_key is None:
            path.append(node)
            node = node.parent
        key = self.disk.root_key if node is self.tree.root else node.disk_key
        for n in reversed(path):
            key = n.disk_key = child_key(key, n.tokens)
        return key

    def _from_disk(self, tokens: Sequence[int], live: int) -> tuple[int, int]:
        """Read the pages of ``tokens`` that continue what the arena holds from
        disk into the arena (where they beat ``live``); returns (tokens the arena
        held before, tokens read from disk)."""
        disk = self.disk
        if disk is None or disk.off_reason or not disk.entries:
            return 0, 0
        from .page_file import child_key

        chain = self.tree.match(tokens, self.role, count=False)
        have = len(chain) * self.page_tokens
        key = self._key(chain[-1]) if chain else disk.root_key
        wanted = []  # (start, parent key, key) of pages on disk after the chain
        for start in range(have, len(tokens) - self.page_tokens + 1, self.page_tokens):
            page = tokens[start : start + self.page_tokens]
            child = child_key(key, page)
            if child not in disk:
                break
            wanted.append((start, key, child))
            key = child
        if not wanted or have + len(wanted) * self.page_tokens <= live:
            return have, 0
        end = have + len(wanted) * self.page_tokens
        fresh: dict[int, tuple[Node, Page]] = {}
        read = 0
        try:
            planned = self.tree.store(list(tokens[:end]), self.role, self._page_bytes())
            fresh = {node.depth * self.page_tokens: (node, page) for node, page, new in planned if new}
            for start, parent, key in wanted:
                node, page = fresh.get(start, (None, None))
                if node is None:
                    break  # no room in the arena for it
                data = disk.read(key, parent, tokens[start : start + self.page_tokens])
                if data is None:
                    break
                self.arena[page.offset : page.offset + len(data)] = data
                node.pages[self.role] = replace(page, crc=page_crc(self.arena, page))
                node.disk_key = key
                del fresh[start]
                read += 1
        except Exception as exc:  # a bug, or the disk failing under it: the prompt is read, the tier stops
            log.warning("prefix cache disk tier: reading pages failed (%s: %s)", type(exc).__name__, exc)
            disk.turn_off(f"reading failed: {type(exc).__name__}: {exc}")
        finally:
            # pages planned but not read (a file that failed its checks, and what follows): freed, deepest first
            self.unplan([node for _, (node, _) in sorted(fresh.items(), reverse=True)], self.role)
        return have, read * self.page_tokens

    @property
    def disk_pending(self) -> bool:
        """Pages to write to disk, or its index to save."""
        disk = self.disk
        return disk is not None and not disk.off_reason and (bool(self.to_disk) or disk.dirty)

    def spill(self) -> bool:
        """Write one stored page to disk, or once none is left the disk's index
        (between requests); returns ``disk_pending``."""
        disk = self.disk
        while disk is not None and self.to_disk and not disk.off_reason:
            node = self.to_disk.popleft()
            node.to_disk = False
            page = node.pages.get(self.role)
            gone = node.parent is None or node.parent.children.get(node.tokens) is not node
            if page is None or page.crc is None or gone:
                continue  # evicted (or never written) since it was stored
            key = self._key(node)
            if key in disk:
                continue
            parent = disk.root_key if node.parent is self.tree.root else self._key(node.parent)
            if page_crc(self.arena, page) == page.crc:  # (as sealed: over the page's whole allocation)
                disk.write(
                    key,
                    parent,
                    node.depth,
                    node.tokens,
                    bytes(self.arena[page.offset : page.offset + self._page_bytes()]),
                )
                return self.disk_pending
        self._unqueue()
        if disk is not None:
            disk.save_index()
        return self.disk_pending

    def _unqueue(self) -> None:
        for node in self.to_disk:
            node.to_disk = False
        self.to_disk.clear()

    def clear(self, memory_only: bool = False) -> tuple[int, int, int, int]:
        """Drop every unlocked page (and, unless ``memory_only``, every page on
        disk); returns (pages, bytes, disk pages, disk bytes) dropped."""
        pages, used = self.tree.pages(), self.tree.allocator.used
        self.release()
        self.tree.clear()
        self._unqueue()
        disk_pages = disk_bytes = 0
        if self.disk is not None and not memory_only:
            disk_pages, disk_bytes = self.disk.clear()
        return pages - self.tree.pages(), used - self.tree.allocator.used, disk_pages, disk_bytes

    def store_or_skip(self, tokens: Sequence[int]) -> int:
        """``store``, except that pages which cannot be written are not cached,
        with a warning: the request they came from still succeeds."""
        try:
            return self.store(tokens)
        except Exception as exc:
            log.warning("prefix cache: could not store pages (%s: %s); they are not cached", type(exc).__name__, exc)
            return 0

    def info(self) -> CacheInfo:
        t = self.tree
        sizes = dict(self.role_bytes)
        if self.layout is not None:
            sizes.setdefault(self.role, self._page_bytes())
        per_node = sum(-(-b // t.allocator.align) * t.allocator.align for b in sizes.values())
        return CacheInfo(
            pages_total=t.allocator.capacity // per_node * len(sizes) if per_node else 0,
            page_bytes=sizes,
            drafter_tokens_from_cache=self.drafter_tokens_from_cache,
            tokens_from_live=self.tokens_from_live,
            page_tokens=self.page_tokens,
            pages=t.pages(),
            bytes_used=t.allocator.used,
            bytes_budget=t.allocator.capacity,
            hits=t.stats.hits,
            misses=t.stats.misses,
            tokens_from_cache=t.stats.tokens_from_cache,
            tokens_prefilled=self.tokens_prefilled,
            evictions=t.stats.evictions,
            disk=self.disk.info() if self.disk is not None else None,
        )

    def release(self) -> None:
        """Unlock every page this request locked (its own and the drafter's)."""
        if self.locked:
            self.tree.unlock(self.locked)
            self.locked = []

    # ------------------------------------------------------------------ another model's pages (the drafter's)

    def match_role(self, tokens: Sequence[int], role: str) -> list[int]:
        """Offsets of the longest cached prefix of ``tokens`` in ``role``'s
        pages, locked until ``release`` (not counted in hits and misses)."""
        chain = self._sealed(self.tree.match(list(tokens), role, count=False), role)
        self.tree.lock(chain)
        self.locked.extend(chain)
        return [node.pages[role].offset for node in chain]

    def cached_role(self, tokens: Sequence[int], role: str) -> int:
        """How many tokens of ``tokens`` ``match_role`` would find in ``role``'s
        pages now; nothing locked, touched or counted (a forecast)."""
        return len(self._sealed(self.tree.peek(list(tokens), role), role)) * self.page_tokens

    @staticmethod
    def _sealed(chain: list, role: str) -> list:
        """The chain up to its first page without a checksum (one still being written)."""
        sealed = next((i for i, node in enumerate(chain) if node.pages[role].crc is None), len(chain))
        return chain[:sealed]

    def plan(self, tokens: Sequence[int], role: str, page_bytes: int) -> list[tuple[int, Node]]:
        """Pages of ``role`` to write for every full page of ``tokens`` not
        cached yet: (start token, node), each already allocated."""
        full = len(tokens) // self.page_tokens * self.page_tokens
        if full == 0:
            return []
        self.role_bytes[role] = page_bytes
        return [
            (node.depth * self.page_tokens, node)
            for node, _, new in self.tree.store(list(tokens[:full]), role, page_bytes)
            if new
        ]

    def seal(self, nodes: Sequence[Node], role: str) -> None:
        """Their ``role`` pages have been written: checksum them (a page without
        a checksum is never saved in the index)."""
        for node in nodes:
            page = node.pages.get(role)
            if page is not None:
                node.pages[role] = replace(page, crc=page_crc(self.arena, page))

    def unplan(self, nodes: Sequence[Node], role: str) -> None:
        """Their ``role`` pages were not written after all: free them."""
        for node in nodes:
            self.tree.drop_page(node, role)

    # ------------------------------------------------------------------ the index, across worker restarts

    def save_index(self, path: Path) -> None:
        data = {
            "version": INDEX_VERSION,
            "layout": repr(self.layout),
            "model": self.model_identity,
            "tree": self.tree.snapshot(),
        }
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)  # a leftover of a killed worker; then never follow a planted link
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # prompts' tokens: ours only
        with os.fdopen(fd, "wb") as f:
            f.write(msgpack.packb(data))
        os.replace(tmp, path)

    def load_index(self, path: Path) -> tuple[int, int]:
        """Take over the pages a previous worker left (after ``probe_layout``);
        returns (pages kept, pages dropped). A missing index keeps nothing; an
        unreadable or foreign one is ignored with a warning."""
        try:
            with os.fdopen(open_own(path), "rb") as f:  # this user's own file only: never one planted
                raw = f.read()
            data = msgpack.unpackb(raw, strict_map_key=False)
        except FileNotFoundError:
            return 0, 0
        except Exception as exc:  # unreadable, not msgpack, keys msgpack cannot map: ignored
            log.warning("ignoring the prefix-cache index %s: %s", path, exc)
            return 0, 0
        if (
            not isinstance(data, dict)
            or data.get("version") != INDEX_VERSION
            or data.get("layout") != repr(self.layout)
        ):
            log.warning("ignoring the prefix-cache index %s: written for another model or version", path)
            return 0, 0
        if data.get("model") != self.model_identity:
            log.warning(
                "ignoring the prefix-cache index %s: written for another model file (the .gguf was replaced or "
                "changed since its pages were computed)",
                path,
            )
            return 0, 0
        try:
            if not isinstance(data.get("tree"), dict):
                raise ValueError("its tree is not a map")
            return self.tree.load(data["tree"], lambda page: page_crc(self.arena, page) == page.crc)
        except Exception as exc:  # any damaged shape: start with an empty cache, never fail the worker
            log.warning("ignoring the prefix-cache index %s (%s: %s)", path, type(exc).__name__, exc)
            self.tree.clear()
            return 0, 0

    def store(self, tokens: Sequence[int]) -> int:
        """Cache every full page of ``tokens`` (which the model holds, from
        position 0) that is not cached yet; returns the pages written."""
        # (with fast prefill, only what was read in whole prefill chunks: LlamaModel.kv_reusable)
        reusable = getattr(self.model, "kv_reusable", self.model.n_past)
        full = min(len(tokens), self.model.n_past, reusable) // self.page_tokens * self.page_tokens
        if full == 0 or self.layout is None:
            return 0
        planned = self.plan(tokens[:full], self.role, self._page_bytes())
        if self.disk is not None and not self.disk.off_reason:  # the whole prompt's pages, parents first
            chain = self.tree.match(tokens[:full], self.role, count=False)
            keys = [self._key(node) for node in chain]
            self.disk.touch([k for k in keys if k in self.disk])
            for node, k in zip(chain, keys):
                if k not in self.disk and not node.to_disk:  # (each queued once)
                    node.to_disk = True
                    self.to_disk.append(node)
            if len(self.to_disk) > MAX_QUEUED:  # no time between requests to write them: drop the evicted
                self.to_disk = collections.deque(n for n in self.to_disk if n.pages.get(self.role) is not None)
        if not planned:
            return 0
        nodes = [node for _, node in planned]
        try:
            write_pages(
                self.model,
                self.arena,
                self.page_tokens,
                [(start, node.pages[self.role].offset) for start, node in planned],
                expect=self.layout,
            )
        except Exception:
            self.unplan(nodes, self.role)
            raise
        self.seal(nodes, self.role)
        return len(planned)
