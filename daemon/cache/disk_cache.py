"""The prefix cache's disk tier: the target's KV pages in files, under the arena.

The arena (shared memory) survives a worker crash and a daemon restart, not a
reboot, a logout that ends the user manager, or ``tandem stop``. This tier keeps
the target's pages in files too, so the first turn of the day restores an
agent's preamble instead of reading it again.

**Where.** ``DIR`` (``--disk-cache-dir``; default ``$XDG_CACHE_HOME/tandem/kv``,
mode 0700) holds one directory per *bucket*: a hash of the page format version,
the model file's identity (size, mtime and a hash of its first and last MiB:
``page_store.model_identity`` without the inode, which a reboot may change),
the KV state's layout (flash attention, KV types), the kernels and the page
size. Pages of another model, format or layout are in another bucket and never
read. In a bucket: ``<key>.page`` files, ``index`` and ``lock``.

**Keys.** A page's key hashes its parent's key and its own tokens (the root's
is the bucket), so it names the page's whole prefix, like a node of the radix
tree: two prompts share a file only where they share everything before it.

**A page file** is a header, the page's tokens, then the page's bytes as they
are in the arena (page_file.py: the files' names and format, and the checks).
Reading one checks all of it: the owner and mode (this user's own regular file,
nobody else may read or write it; never through a symbolic link), the format,
the bucket, that the key is the hash of the parent and tokens asked for, the
length (a truncated file) and the checksum (a file half-written when the power
went). A file that fails is dropped (with its descendants, which can no longer
be reached) with a warning.

**Writing** happens between requests, one page at a time, while no request is
waiting (``PageStore.spill``); the ``index`` (every page's key, parent, depth,
size and last use) is written atomically (a temporary file, fsync, rename)
after each batch. A page file is written under a temporary name and renamed,
so a name never holds a half-written page unless the power went between the
two, which the checksum catches.

**Budget.** ``--disk-cache-bytes`` bounds the bytes of page files in DIR, all
buckets together; it is never exceeded. Pages are evicted with the arena's
policy (only leaves; least recently used by 5-second buckets, shortest prefix
first); the buckets of other models (or formats) go first, least recently used
first, unless a running daemon holds them. A write also keeps the file
system's free space above ``FREE_RESERVE``; a disk that is full or read-only
turns the tier off with a warning, and never fails a request.

One daemon at a time writes a bucket: the first takes ``lock`` (``flock``); a
second daemon on the same model runs without the disk tier, saying so.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tandem.protocol import DiskCacheInfo

from .arena import UntrustedFile, check_own, open_own
from .page_file import (
    BUCKET_NAME,
    PageFileError,
    PageFormat,
    bucket_name,
    decode_index,
    encode_index,
    page_name,
    write_atomic,
)

log = logging.getLogger("tandem.cache")

DEFAULT_DISK_BYTES = 4 << 30
DEFAULT_FREE_SHARE = 4  # auto budget: at most a quarter of the file system's free space
FREE_RESERVE = 1 << 30  # never fill the file system closer than this (or 5% of it, if less)
AGE_BUCKET_SECONDS = 5.0
OTHERS_TTL_SECONDS = 30.0  # other buckets' sizes are read again after this long (another daemon writes them)
LOCK_WAIT_SECONDS = 5.0  # a worker being replaced may hold its bucket's lock a moment longer


def default_dir(environ=os.environ) -> Path:
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem" / "kv"


def free_reserve(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return FREE_RESERVE
    return min(FREE_RESERVE, st.f_blocks * st.f_frsize // 20)


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def disk_budget(requested: Optional[int], directory: Path) -> int:
    """``requested`` bytes, or (None) the default: 4 GiB, or a quarter of the
    file system's free space if that is less (the tier's own files counted as
    free: they are its to evict)."""
    if requested is not None:
        return requested
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = free_bytes(probe)
    except OSError:
        return 0
    return min(DEFAULT_DISK_BYTES, (free + cached_bytes(directory)) // DEFAULT_FREE_SHARE)


def buckets(root: Path, skip: str = "") -> list[tuple[Path, int, int, float]]:
    """The buckets in ``root`` (directories named like one, holding a lock or an
    index: nothing else there is ever touched), but ``skip``: (path, page files,
    bytes, last change), least recently changed first."""
    out = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return out
    for e in entries:
        if e.name == skip or not BUCKET_NAME.fullmatch(e.name) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            files = list(os.scandir(e.path))
            names = {f.name for f in files}
            if "lock" not in names and "index" not in names:
                continue
            pages = [f.stat(follow_symlinks=False) for f in files if f.name.endswith((".page", ".tmp"))]
            mtime = max((f.stat(follow_symlinks=False).st_mtime for f in files), default=0.0)
        except OSError:
            continue
        out.append((Path(e.path), len(pages), sum(st.st_size for st in pages), mtime))
    return sorted(out, key=lambda t: t[3])


def cached_bytes(root: Path) -> int:
    """Bytes of page files in every bucket of ``root``."""
    return sum(b for _, _, b, _ in buckets(root))


def clear_dir(root: Path, skip: str = "") -> tuple[int, int, int]:
    """Remove every bucket in ``root`` (but ``skip``) that no daemon holds
    (``tandem cache clear``); returns (page files, bytes, buckets held)."""
    pages = nbytes = held = 0
    for path, n, size, _ in buckets(root, skip):
        if remove_bucket(path):
            pages, nbytes = pages + n, nbytes + size
        else:
            held += 1
    return pages, nbytes, held


def is_held(path: Path) -> bool:
    """A running daemon holds the bucket's lock."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def remove_bucket(path: Path) -> bool:
    """Remove a bucket unless a running daemon holds its lock; True if removed."""
    try:
        fd = os.open(path / "lock", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = -1
    except OSError:
        return False
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(path, ignore_errors=True)
        return not path.exists()
    except BlockingIOError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


@dataclass
class Entry:
    key: bytes
    parent: bytes
    depth: int
    size: int  # bytes of the file
    last_used: float  # wall-clock seconds (it must mean something after a reboot)
    children: int = 0


@dataclass
class DiskStats:
    hits: int = 0
    tokens_from_disk: int = 0
    pages_read: int = 0
    read_seconds: float = 0.0
    pages_written: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0
    evictions: int = 0
    dropped: int = 0  # page files ignored: corrupt, truncated, foreign, of another format


def _private_dir(path: Path) -> None:
    """Create ``path`` (and parents) 0700, or check that it is this user's own
    directory that nobody else may use; ``UntrustedFile`` otherwise."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_own(os.lstat(path), path, directory=True, fix=" (chmod 700 it)")


class DiskTier:
    """One bucket of the disk tier, held (locked) by this process."""

    def __init__(self, root: Path, bucket: str, page_tokens: int, page_bytes: int, budget: int, lock_fd: int):
        self.dir = root
        self.bucket = bucket
        self.path = root / bucket
        self.root_key = bytes.fromhex(bucket)
        self.page_tokens = page_tokens
        self.page_bytes = page_bytes
        self.budget = budget
        self.format = PageFormat(self.root_key, page_tokens, page_bytes)
        self.file_bytes = self.format.file_bytes
        self._lock_fd = lock_fd
        self.entries: dict[bytes, Entry] = {}
        self.bytes_used = 0  # of this bucket's page files
        self.others: Optional[list[tuple[Path, int, float, bool]]] = None  # other buckets: path, bytes, mtime, held
        self.others_read = 0.0  # when (monotonic)
        self.stats = DiskStats()
        self.off_reason = ""  # why the tier is off ("" while on)
        self.dirty = False  # the index on disk is behind
        self._warned_full = False

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls, root: Path, identity: str, layout: str, page_tokens: int, page_bytes: int, budget: int
    ) -> Optional["DiskTier"]:
        """The bucket for this model in ``root`` with its pages, or None (with a
        warning: the daemon runs without the disk tier) where it cannot be used."""
        if budget <= 0:
            return None
        bucket = bucket_name(identity, layout, page_tokens)
        path = root / bucket
        deadline = time.monotonic() + LOCK_WAIT_SECONDS
        while True:
            try:
                _private_dir(root)
                _private_dir(path)
                fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                log.warning("no disk tier for the prefix cache: %s (%s)", exc.filename or root, exc.strerror or exc)
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() > deadline:
                    log.warning("no disk tier for the prefix cache: another tandem daemon on this model uses %s", path)
                    return None
                time.sleep(0.1)
                continue
            try:
                current = os.lstat(path / "lock").st_ino
            except OSError:
                current = -1
            if os.fstat(fd).st_ino == current:
                break
            os.close(fd)  # the bucket was removed (cleared) while this one locked it: lock the new one
        tier = cls(root, bucket, page_tokens, page_bytes, budget, fd)
        tier._load()
        others = tier.others = tier._other_buckets()
        if tier.bytes_used + sum(b for _, b, _, _ in others) > budget:  # a budget lowered since
            tier._make_room(0, set())
            tier.save_index()
        if others:
            log.info(
                "prefix cache disk tier: %d other bucket(s) in %s (other models, kernels or page formats: "
                "%d MiB) are not read; they go first when this one needs room",
                len(others),
                root,
                sum(b for _, b, _, _ in others) >> 20,
            )
        return tier

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _load(self) -> None:
        """Take over the pages the index names whose files are there, whole and
        ours; remove page files it does not name (written after the last index)."""
        index = self._read_index()
        files = {}
        try:
            for e in os.scandir(self.path):
                files[e.name] = e
        except OSError as exc:
            self.turn_off(f"cannot list {self.path} ({exc.strerror or exc})")
            return
        for key, parent, depth, size, last_used in index:
            if key in self.entries:
                continue
            reachable = parent == self.root_key or parent in self.entries
            e = files.get(page_name(key))
            why = ""
            if e is None:
                why = "missing"
            else:
                try:
                    st = e.stat(follow_symlinks=False)
                    check_own(st, e.path)
                    if st.st_size != size or size != self.file_bytes:
                        why = f"holds {st.st_size} bytes, not {self.file_bytes} (truncated?)"
                except UntrustedFile as exc:
                    why = f"not this user's own private file ({exc.strerror})"
                except OSError as exc:
                    why = exc.strerror or str(exc)
            if not reachable and not why:
                why = "its parent page is gone"
            if why:
                if e is not None:
                    log.warning("prefix cache disk tier: ignoring %s: %s", e.path, why)
                    self.stats.dropped += 1
                continue
            self.entries[key] = Entry(key, parent, depth, size, last_used)
            self.bytes_used += size
            if parent in self.entries:
                self.entries[parent].children += 1
        known = {page_name(k) for k in self.entries}
        for name, e in files.items():
            if name.endswith((".page", ".tmp")) and name not in known:
                self._unlink(Path(e.path))  # after the last index, or dropped above: never read
        self.dirty = len(known) != len(index)

    def _read_index(self) -> list[tuple[bytes, bytes, int, int, float]]:
        path = self.path / "index"
        try:
            with os.fdopen(open_own(path), "rb") as f:
                return decode_index(f.read(), self.bucket)
        except FileNotFoundError:
            return []
        except Exception as exc:  # unreadable, foreign, damaged: start empty (its files are removed)
            log.warning("prefix cache disk tier: ignoring the index %s (%s: %s)", path, type(exc).__name__, exc)
            return []

    def save_index(self) -> None:
        if not self.dirty or self.off_reason:
            return
        rows = sorted(self.entries.values(), key=lambda e: e.depth)  # parents first
        index = encode_index(self.bucket, [[e.key, e.parent, e.depth, e.size, e.last_used] for e in rows])
        try:
            write_atomic(self.path / "index", index, sync=True)
            self.dirty = False
        except OSError as exc:
            self._failed(exc)

    # ------------------------------------------------------------------ lookups and reads

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def read(self, key: bytes, parent: bytes, tokens: Sequence[int]) -> Optional[bytes]:
        """The page bytes of ``key`` (the page ``tokens`` after ``parent``), or
        None: not on disk, or its file failed a check (then it is dropped)."""
        entry = self.entries.get(key)
        if entry is None or self.off_reason:
            return None
        path = self.path / page_name(key)
        t0 = time.perf_counter()
        try:
            fd = open_own(path)
            with os.fdopen(fd, "rb") as f:
                raw = f.read(self.file_bytes + 1)
            payload = self.format.decode(raw, key, parent, tokens, entry.depth)
        except (OSError, PageFileError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.warning("prefix cache disk tier: ignoring %s: %s", path, why)
            self.stats.dropped += 1
            self.drop(key)
            return None
        self.stats.pages_read += 1
        self.stats.read_seconds += time.perf_counter() - t0
        entry.last_used = time.time()
        self.dirty = True
        return payload

    def touch(self, keys: Sequence[bytes]) -> None:
        now = time.time()
        for k in keys:
            e = self.entries.get(k)
            if e is not None:
                e.last_used = now
                self.dirty = True

    # ------------------------------------------------------------------ writes

    def write(self, key: bytes, parent: bytes, depth: int, tokens: Sequence[int], payload: bytes) -> bool:
        """Write one page (its parent on disk already, or the root); False when
        it was not written (no room, the tier off)."""
        if self.off_reason or key in self.entries:
            return False
        if parent != self.root_key and parent not in self.entries:
            return False  # it could never be reached
        if len(payload) != self.page_bytes or len(tokens) != self.page_tokens:
            raise ValueError("a page of another size")
        t0 = time.perf_counter()
        protect = self._path_of(parent)
        if not self._make_room(self.file_bytes, protect):
            return False
        data = self.format.encode(key, parent, depth, tokens, payload)
        try:
            write_atomic(self.path / page_name(key), data)
        except OSError as exc:
            self._failed(exc)
            return False
        self.entries[key] = Entry(key, parent, depth, len(data), time.time())
        self.bytes_used += len(data)
        if parent in self.entries:
            self.entries[parent].children += 1
        self.dirty = True
        self.stats.pages_written += 1
        self.stats.bytes_written += len(data)
        self.stats.write_seconds += time.perf_counter() - t0
        return True

    def _failed(self, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.turn_off(f"the disk is full ({exc.filename or self.path})")
        elif exc.errno == errno.EROFS:
            self.turn_off(f"{self.path} is on a read-only file system")
        else:
            self.turn_off(f"cannot write {exc.filename or self.path} ({exc.strerror or exc})")

    def turn_off(self, why: str) -> None:
        if not self.off_reason:
            log.warning("prefix cache: the disk tier is off: %s; requests go on with the shared-memory cache", why)
            self.off_reason = why

    def _path_of(self, key: bytes) -> set[bytes]:
        out = set()
        while key in self.entries:
            out.add(key)
            key = self.entries[key].parent
        return out

    def _make_room(self, size: int, protect: set[bytes]) -> bool:
        """Evict until ``size`` more bytes keep DIR within the budget and the
        file system above its reserve; False (evicting nothing) if they cannot."""
        if self.others is None or time.monotonic() - self.others_read > OTHERS_TTL_SECONDS:
            self.others = self._other_buckets()
        while True:
            held = sum(b for _, b, _, h in self.others if h)  # a running daemon's: counted, never removed
            unheld = sum(b for _, b, _, h in self.others if not h)
            try:
                room = free_bytes(self.path) - free_reserve(self.path)
            except OSError:
                room = size
            over = self.bytes_used + held + unheld + size - self.budget
            if over <= 0 and size <= room:
                return True
            evictable = unheld + self.bytes_used - sum(self.entries[k].size for k in protect if k in self.entries)
            if max(over, size - room) > evictable:  # evicting all that may go would not do: keep it all
                if size > room and not self._warned_full:
                    self._warned_full = True
                    log.warning(
                        "prefix cache disk tier: %s has too little free space; pages are not written to disk "
                        "until there is more (or set --disk-cache-bytes)",
                        self.path,
                    )
                return False
            other = next((t for t in self.others if not t[3]), None)
            if other is not None:  # another model's (or format's) pages go first, least recently used first
                self.others.remove(other)
                if not self._remove_bucket(other[0]):
                    self.others.append((other[0], other[1], other[2], True))  # held after all
                continue
            victim = self._victim(protect)
            if victim is None:
                return False
            self.drop(victim, evicted=True)

    def _victim(self, protect: set[bytes]) -> Optional[bytes]:
        now = time.time()
        leaves = [e for e in self.entries.values() if e.children == 0 and e.key not in protect]
        if not leaves:
            return None

        def order(e: Entry):
            return (-int((now - e.last_used) // AGE_BUCKET_SECONDS), e.depth, e.last_used)

        return min(leaves, key=order).key

    def _other_buckets(self) -> list[tuple[Path, int, float, bool]]:
        """The other buckets in DIR: (path, bytes, last change, held by a running daemon), oldest first."""
        self.others_read = time.monotonic()
        return [(path, size, mtime, is_held(path)) for path, _, size, mtime in buckets(self.dir, skip=self.bucket)]

    def _remove_bucket(self, path: Path) -> bool:
        if remove_bucket(path):
            log.info("prefix cache disk tier: removed %s (another model's pages) to stay in budget", path)
            return True
        return False

    # ------------------------------------------------------------------ dropping

    def drop(self, key: bytes, evicted: bool = False) -> int:
        """Remove ``key``'s page and every page under it; returns pages removed."""
        doomed = {key} if key in self.entries else set()
        if doomed:
            grew = True
            while grew:  # descendants (a few hundred pages at most)
                grew = False
                for e in self.entries.values():
                    if e.parent in doomed and e.key not in doomed:
                        doomed.add(e.key)
                        grew = True
        for k in doomed:
            e = self.entries.pop(k)
            self.bytes_used -= e.size
            parent = self.entries.get(e.parent)
            if parent is not None:
                parent.children -= 1
            self._unlink(self.path / page_name(k))
        if doomed:
            self.dirty = True
            if evicted:
                self.stats.evictions += len(doomed)
        return len(doomed)

    def clear(self) -> tuple[int, int]:
        """Remove every page of this bucket, and every other bucket no daemon
        holds; returns (pages, bytes) removed."""
        pages, used = len(self.entries), self.bytes_used
        for key in list(self.entries):
            self._unlink(self.path / page_name(key))
        self.entries.clear()
        self.bytes_used = 0
        other_pages, other_bytes, _ = clear_dir(self.dir, skip=self.bucket)
        pages, used = pages + other_pages, used + other_bytes
        self.others = None
        self.dirty = True
        self.save_index()
        return pages, used

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    # ------------------------------------------------------------------ reporting

    def info(self) -> DiskCacheInfo:
        s = self.stats
        return DiskCacheInfo(
            path=str(self.path),
            state=f"off: {self.off_reason}" if self.off_reason else "on",
            pages=len(self.entries),
            bytes_used=self.bytes_used,
            bytes_budget=self.budget,
            hits=s.hits,
            tokens_from_disk=s.tokens_from_disk,
            pages_read=s.pages_read,
            read_seconds=round(s.read_seconds, 6),
            pages_written=s.pages_written,
            bytes_written=s.bytes_written,
            write_seconds=round(s.write_seconds, 6),
            evictions=s.evictions,
            dropped=s.dropped,
        )
