"""The prefix cache's arena: one shared-memory file that the daemon owns.

The daemon creates it, so cached pages outlive a worker that dies; both
workers map it. Shared memory (``/dev/shm``, or ``$TANDEM_SHM_DIR``) is a
world-writable directory that other users and other PID namespaces share, so:

- **Names are unpredictable** (``tandem-kv-<uid>-<128 random bits>``) and
  created with ``O_EXCL | O_NOFOLLOW``, mode 0600: nobody can plant a file
  where the daemon will look, or make its start fail by pre-creating one.
- **Every open checks** that the file is a regular file of this user, not
  readable or writable by anyone else (``open_own``); the worker's map of the
  arena and its read of the cache index both go through it.
- **Space is reserved at creation** (``posix_fallocate``). tmpfs is sparse
  until written: a budget that fitted at start could no longer be written when
  something else filled shared memory later, and a page write into a hole that
  tmpfs cannot back kills the worker with SIGBUS. When the whole budget cannot
  be reserved, the arena is smaller (halved until it fits), with a warning.
- **Liveness is a lock, not a pid.** The daemon (and each worker) holds a
  shared ``flock`` on the arena while it lives; ``remove_stale_arenas`` removes
  only this user's arenas that nobody holds (an exclusive lock succeeds), with
  their indexes, so a daemon in another PID namespace sharing ``/dev/shm`` is
  never swept. (Arenas of tandem before this scheme, ``tandem-kv-<uid>-<pid>``,
  are swept by pid as before.)
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from ..config import ServeError

log = logging.getLogger("tandem.daemon")

DEFAULT_CACHE_BYTES = 1 << 30
MIN_ARENA_BYTES = 4 << 20  # below this a shrunk arena is not worth having: no prefix cache
SHM_DIR = Path("/dev/shm")


class UntrustedFile(OSError):
    """A shared-memory file that is not this user's own, private regular file."""


def shm_dir() -> Path:
    """Where arenas live: ``$TANDEM_SHM_DIR`` (another tmpfs) or /dev/shm."""
    return Path(os.environ.get("TANDEM_SHM_DIR") or SHM_DIR)


def index_path(arena: str | Path) -> Path:
    """Where the tree of the arena ``arena`` (its path) is kept between worker lives."""
    return Path(f"{arena}.index")


def _arena_re() -> re.Pattern:
    return re.compile(rf"tandem-kv-{os.getuid()}-([0-9a-f]{{32}}|\d+)(\.index)?")


def check_own(st: os.stat_result, path: str | Path, directory: bool = False, fix: str = "") -> None:
    """``UntrustedFile`` unless ``st`` is of a regular file (or ``directory``) of
    this user that nobody else may use; ``fix`` is added to the mode's complaint."""
    if not (stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)):
        why = "not a directory (or a symbolic link)" if directory else "not a regular file"
        raise UntrustedFile(errno.ENOTDIR if directory else errno.EPERM, why, str(path))
    if st.st_uid != os.getuid():
        raise UntrustedFile(errno.EPERM, f"owned by uid {st.st_uid}, not by this user ({os.getuid()})", str(path))
    if st.st_mode & 0o077:
        raise UntrustedFile(errno.EPERM, f"mode {stat.S_IMODE(st.st_mode):04o}: others may use it{fix}", str(path))


def open_own(path: str | Path, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` (never through a symbolic link) and return the fd, only if
    it is a regular file of this user that nobody else can read or write;
    otherwise ``UntrustedFile`` (or the open's own OSError)."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_own(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass
class Arena:
    path: Path
    size: int
    fd: int  # holds the shared lock that says this daemon is alive

    @property
    def name(self) -> str:
        return self.path.name


def remove_stale_arenas(directory: Optional[Path] = None) -> list[str]:
    """This user's arenas (and indexes) that no living process holds: of
    daemons killed, or stopped by the watchdog, without their shutdown."""
    directory = directory or shm_dir()
    pattern = _arena_re()
    removed = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    names = {p.name for p in entries}
    for path in entries:
        m = pattern.fullmatch(path.name)
        if m is None:
            continue
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                continue  # not provably ours: never touched
            if m.group(2):  # an index: stale when its arena is gone
                if path.name.removesuffix(".index") not in names:
                    path.unlink()
                    removed.append(path.name)
            elif m.group(1).isdigit():  # before unpredictable names: by pid
                if not psutil.pid_exists(int(m.group(1))):
                    removed += _unlink_with_index(path, names)
            else:
                removed += _remove_if_unheld(path, names)
        except OSError:
            continue
    if removed:
        log.info("removed the prefix cache of daemons that are gone: %s", ", ".join(sorted(removed)))
    return removed


def _unlink_with_index(path: Path, names: set[str]) -> list[str]:
    path.unlink()
    removed = [path.name]
    index = index_path(path)
    if index.name in names and not os.path.islink(index):
        index.unlink(missing_ok=True)
        removed.append(index.name)
    return removed


def _remove_if_unheld(path: Path, names: set[str]) -> list[str]:
    """Remove the arena ``path`` (and its index) if no process holds its lock:
    unlinked while this holds the exclusive lock, so a daemon that created it
    and is waiting for its shared lock sees it unlinked (and takes another name)."""
    fd = open_own(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return []
    try:
        return _unlink_with_index(path, names)
    finally:
        os.close(fd)


def hold(fd: int) -> None:
    """Take the shared lock that marks an arena as in use (see the module docstring)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize
    except OSError:
        return 0


def cache_budget(requested: Optional[int], directory: Optional[Path] = None) -> int:
    """The prefix cache's byte budget: ``requested`` (None: the default, 1 GiB
    or half of what shared memory has free, if less). A budget larger than
    shared memory's free space is refused up front (``create_arena`` reserves it)."""
    directory = directory or shm_dir()
    free = free_bytes(directory)
    if requested is None:
        budget = min(DEFAULT_CACHE_BYTES, free // 2)
        if budget < DEFAULT_CACHE_BYTES:
            log.warning(
                "%s has %d MiB free: the prefix cache gets %d MiB instead of %d (set --cache-bytes to choose)",
                directory,
                free >> 20,
                budget >> 20,
                DEFAULT_CACHE_BYTES >> 20,
            )
        return budget
    if requested > free:
        raise ServeError(
            f"--cache-bytes {requested >> 20} MiB is more than {directory} has free ({free >> 20} MiB); "
            "give a smaller --cache-bytes (or --cache-bytes 0 to run without a prefix cache), or enlarge /dev/shm"
        )
    return requested


def create_arena(size: int, directory: Optional[Path] = None) -> Optional[Arena]:
    """A new arena of at most ``size`` bytes, its space reserved; smaller (with
    a warning) when shared memory cannot hold it all, None (no prefix cache,
    with a warning) when it cannot hold even ``MIN_ARENA_BYTES``."""
    directory = directory or shm_dir()
    while True:
        path = directory / f"tandem-kv-{os.getuid()}-{secrets.token_hex(16)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue  # 2**-128: another name
        except OSError as exc:
            log.warning("no prefix cache: cannot create %s (%s)", path, exc.strerror or exc)
            return None
        hold(fd)
        if os.fstat(fd).st_nlink:
            break
        os.close(fd)  # swept between its creation and the lock (taken for a dead daemon's): another name
    reserved = size
    while True:
        try:
            os.posix_fallocate(fd, 0, reserved)
            break
        except OSError as exc:
            os.ftruncate(fd, 0)  # give back what a partial reservation took
            if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG) or reserved // 2 < MIN_ARENA_BYTES:
                log.warning(
                    "no prefix cache: %s could not reserve %d MiB for it (%s); free shared memory, or enlarge %s",
                    path,
                    reserved >> 20,
                    exc.strerror or exc,
                    directory,
                )
                os.close(fd)
                path.unlink(missing_ok=True)
                return None
            reserved = reserved // 2 >> 20 << 20
    if reserved < size:
        log.warning(
            "%s could reserve only %d MiB of shared memory: the prefix cache gets %d MiB instead of the %d asked "
            "(free shared memory or enlarge %s, or set a smaller --cache-bytes)",
            directory,
            reserved >> 20,
            reserved >> 20,
            size >> 20,
            directory,
        )
    return Arena(path, reserved, fd)


def destroy_arena(arena: Arena) -> None:
    for path in (arena.path, index_path(arena.path)):
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
    os.close(arena.fd)
