"""The prefix cache's arena: one shared-memory block that the daemon owns.

The daemon creates it (``/dev/shm/tandem-kv-<uid>-<pid>``), so cached pages
outlive a worker that dies; both workers map it. ``cache_budget`` sizes it
against the free space of shared memory, and ``remove_stale_arenas`` removes
those of this user's daemons that are gone (killed without their shutdown).
"""

from __future__ import annotations

import logging
import os
from multiprocessing import shared_memory
from pathlib import Path
from typing import Optional

import psutil

from .config import ServeError
from .page_store import index_path

log = logging.getLogger("tandem.daemon")

DEFAULT_CACHE_BYTES = 1 << 30
SHM_DIR = Path("/dev/shm")


def arena_name(pid: int) -> str:
    return f"tandem-kv-{os.getuid()}-{pid}"


def remove_stale_arenas(shm_dir: Path = SHM_DIR) -> list[str]:
    """Prefix cache arenas (and their indexes) of this user's daemons that are
    gone: killed, or stopped by the watchdog, without their shutdown."""
    removed = []
    prefix = arena_name(0)[:-1]
    for path in shm_dir.glob(prefix + "*"):
        pid_text = path.name[len(prefix) :].removesuffix(".index")
        if not pid_text.isdigit() or psutil.pid_exists(int(pid_text)):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    if removed:
        log.info("removed the prefix cache of daemons that are gone: %s", ", ".join(sorted(removed)))
    return removed


def cache_budget(requested: Optional[int], shm_dir: Path = SHM_DIR) -> int:
    """The prefix cache's byte budget: ``requested`` (None: the default, 1 GiB
    or half of what shared memory has free, if less). Shared memory is tmpfs,
    sparse until written: a budget larger than its free space would fault
    (SIGBUS) when the cache fills, so that is refused up front."""
    try:
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    if requested is None:
        budget = min(DEFAULT_CACHE_BYTES, free // 2)
        if budget < DEFAULT_CACHE_BYTES:
            log.warning(
                "%s has %d MiB free: the prefix cache gets %d MiB instead of %d (set --cache-bytes to choose)",
                shm_dir,
                free >> 20,
                budget >> 20,
                DEFAULT_CACHE_BYTES >> 20,
            )
        return budget
    if requested > free:
        raise ServeError(
            f"--cache-bytes {requested >> 20} MiB is more than {shm_dir} has free ({free >> 20} MiB); "
            "give a smaller --cache-bytes (or --cache-bytes 0 to run without a prefix cache), or enlarge /dev/shm"
        )
    return requested


def create_arena(size: int) -> shared_memory.SharedMemory:
    """This daemon's arena, replacing what a crashed daemon that had our pid left."""
    name = arena_name(os.getpid())
    for stale in (SHM_DIR / name, index_path(name)):
        stale.unlink(missing_ok=True)
    return shared_memory.SharedMemory(create=True, size=size, name=name)


def destroy_arena(arena: shared_memory.SharedMemory) -> None:
    arena.close()
    arena.unlink()
    index_path(arena.name).unlink(missing_ok=True)
