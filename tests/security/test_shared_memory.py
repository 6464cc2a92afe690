"""The prefix cache's shared memory (issue 19, items 8 and 9): names nobody can
predict, every file checked for owner and mode before it is used, only this
user's provably stale arenas swept, space reserved up front so that a full
tmpfs never kills a worker with SIGBUS, and a page that does not restore never
fails a request.

Other users are uid 65534 (files chown'ed to it, which needs root); a small
tmpfs of its own is mounted for the full-memory cases (also root). Both skip
with that reason elsewhere."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import msgpack
import pytest

from tandem.daemon.cache.arena import UntrustedFile, create_arena, destroy_arena, index_path, remove_stale_arenas
from tandem.daemon.cache.page_store import map_arena

NOBODY = 65534
root_only = pytest.mark.skipif(os.getuid() != 0, reason="files of another user (uid 65534) and mounts need root")


@pytest.fixture
def shm(tmp_path):
    """A directory like /dev/shm (world-writable, sticky), on tmpfs where there is one."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = Path(tempfile.mkdtemp(prefix="tandem-test-", dir=base))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def small_tmpfs(path: Path, mib: int):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=1777", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Fill a tmpfs to the last byte (what another program or daemon does to /dev/shm)."""
    hog = directory / "hog"
    with open(hog, "wb") as f:
        try:
            while True:
                f.write(b"\xff" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return hog


# --------------------------------------------------------------------------- names, modes, reservation


def test_arenas_have_unpredictable_private_names_and_their_space_reserved(shm):
    a, b = create_arena(8 << 20, shm), create_arena(8 << 20, shm)
    try:
        for arena in (a, b):
            assert re.fullmatch(rf"tandem-kv-{os.getuid()}-[0-9a-f]{{32}}", arena.name)
            st = arena.path.stat()
            assert st.st_mode & 0o777 == 0o600 and st.st_size == 8 << 20
            assert st.st_blocks * 512 >= 8 << 20, "the arena's pages must be reserved, not a sparse file"
        assert a.name != b.name
    finally:
        destroy_arena(a)
        destroy_arena(b)
    assert list(shm.iterdir()) == []


@root_only
def test_an_arena_larger_than_shared_memory_can_hold_is_shrunk_with_a_warning(tmp_path, caplog):
    with small_tmpfs(tmp_path / "small", 24) as d:
        with caplog.at_level(logging.WARNING, "tandem.daemon"):
            arena = create_arena(64 << 20, d)
        try:
            assert arena is not None and 4 << 20 <= arena.size <= 24 << 20 and arena.size < 64 << 20
            assert arena.path.stat().st_blocks * 512 >= arena.size
            assert f"the prefix cache gets {arena.size >> 20} MiB instead of the 64 asked" in caplog.text
        finally:
            destroy_arena(arena)
        hog = fill(d)  # nothing left at all: no cache, said so, never a failure
        with caplog.at_level(logging.WARNING, "tandem.daemon"):
            assert create_arena(16 << 20, d) is None
        assert "no prefix cache" in caplog.text
        hog.unlink()


@root_only
def test_the_worker_maps_only_this_users_private_arena(shm):
    arena = create_arena(8 << 20, shm)
    try:
        m = map_arena(str(arena.path), arena.size)
        m.close()
        os.chmod(arena.path, 0o644)
        with pytest.raises(UntrustedFile, match="mode 0644"):
            map_arena(str(arena.path), arena.size)
        os.chmod(arena.path, 0o600)
        os.chown(arena.path, NOBODY, NOBODY)
        with pytest.raises(UntrustedFile, match="owned by uid 65534"):
            map_arena(str(arena.path), arena.size)
        os.chown(arena.path, 0, 0)
        link = shm / "link"
        link.symlink_to(arena.path)
        with pytest.raises(OSError):
            map_arena(str(link), arena.size)  # O_NOFOLLOW
        with pytest.raises(UntrustedFile, match="less than"):
            map_arena(str(arena.path), arena.size * 2)
        link.unlink()
    finally:
        destroy_arena(arena)


LIVE = """
import sys, time
from pathlib import Path
from tandem.daemon.cache.arena import create_arena
a = create_arena(1 << 20, Path(sys.argv[1]))
print(a.path, flush=True)
time.sleep(60)
"""


@root_only
def test_only_this_users_arenas_that_nobody_holds_are_swept(shm):
    uid = os.getuid()
    live = subprocess.Popen([sys.executable, "-c", LIVE, str(shm)], stdout=subprocess.PIPE, text=True)
    try:
        live_path = Path(live.stdout.readline().strip())  # a daemon in another PID namespace, say
        stale = create_arena(1 << 20, shm)
        os.close(stale.fd)  # its daemon was killed: nobody holds it
        index_path(stale.path).write_bytes(b"x")
        os.chmod(index_path(stale.path), 0o600)
        foreign = shm / f"tandem-kv-{uid}-{'0' * 32}"
        foreign.write_bytes(b"")
        os.chown(foreign, NOBODY, NOBODY)  # planted by another user under our name: not ours to remove
        symlink = shm / f"tandem-kv-{uid}-{'1' * 32}"
        symlink.symlink_to("/etc/passwd")
        orphan_index = shm / f"tandem-kv-{uid}-{'2' * 32}.index"  # its arena is gone
        orphan_index.write_bytes(b"x")
        dead_pid = 2**22 + 7  # above pid_max: no such process
        legacy = shm / f"tandem-kv-{uid}-{dead_pid}"  # an arena of tandem before unpredictable names
        legacy.write_bytes(b"")
        other_user = shm / f"tandem-kv-{NOBODY}-{'3' * 32}"
        other_user.write_bytes(b"")
        unrelated = shm / "something-else"
        unrelated.write_bytes(b"")

        removed = set(remove_stale_arenas(shm))

        assert removed == {stale.name, stale.name + ".index", orphan_index.name, legacy.name}
        assert live_path.exists() and foreign.exists() and symlink.is_symlink() and other_user.exists()
        assert unrelated.exists() and Path("/etc/passwd").exists()
    finally:
        live.kill()
        live.wait()
    assert live_path.name in remove_stale_arenas(shm)  # its holder is gone now


# --------------------------------------------------------------------------- through the daemon


PROMPT = "A prefix the cache keeps between turns. " * 8


@root_only
def test_an_index_another_user_planted_is_not_trusted(start_daemon, restart_target, arena_of):
    # the disk tier off: its own (genuine) copies of the pages would legitimately restore them
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "16M", "--disk-cache-bytes", "0")
    with d.client() as c:
        plain = c.complete(prompt=PROMPT, max_tokens=8, ignore_eos=True, temperature=0).text
        index = index_path(arena_of(c.status().pid))
        assert index.exists()
        os.chown(index, NOBODY, NOBODY)  # (its content is genuine: only the owner is wrong)
        restart_target(c)
        done = c.complete(prompt=PROMPT, max_tokens=8, ignore_eos=True, temperature=0)
        assert done.usage.cached_tokens == 0 and done.text == plain
    assert "ignoring the prefix-cache index" in d.log() and "owned by uid 65534" in d.log()


def test_pages_that_do_not_restore_are_dropped_and_the_request_still_succeeds(start_daemon, restart_target, arena_of):
    """An index whose pages point at zeroed bytes with the zero page's checksum
    (what a planted index did before owners were checked) passes the integrity
    check; restoring it must not fail the request (it was INTERNAL). The disk
    tier is off: its genuine copies of the pages would restore them instead."""
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "16M", "--disk-cache-bytes", "0")
    with d.client() as c:
        plain = c.complete(prompt=PROMPT, max_tokens=8, ignore_eos=True, temperature=0).text
        arena = arena_of(c.status().pid)
        index = index_path(arena)
        data = msgpack.unpackb(index.read_bytes(), strict_map_key=False)
        nodes = data["tree"]["nodes"]
        assert nodes
        size = arena.stat().st_size
        zero_crc = {}
        for i, (_, _, pages) in enumerate(nodes):
            for role, (_, page_size, _) in pages.items():
                at = size - (i + 1) * page_size  # the end of the arena: never written, zeros
                zero_crc.setdefault(page_size, zlib.crc32(bytes(page_size)))
                pages[role] = [at, page_size, zero_crc[page_size]]
        restart_target(c)  # the new worker reads the index at its start: replace it first...
        index.write_bytes(msgpack.packb(data))
        restart_target(c)  # ...and once more, so that this one loads the crafted index
        done = c.complete(prompt=PROMPT, max_tokens=8, ignore_eos=True, temperature=0)
        assert done.text == plain and done.usage.cached_tokens == 0
        again = c.complete(prompt=PROMPT, max_tokens=8, ignore_eos=True, temperature=0)
        assert again.text == plain and again.usage.cached_tokens > 0  # stored afresh
    assert "dropping pages that could not be restored" in d.log()


@root_only
def test_a_full_shared_memory_never_kills_a_worker(start_daemon, tmp_path, arena_of):
    """The arena's space is reserved at start: when something fills shared memory
    afterwards, the cache keeps writing pages (a sparse arena took SIGBUS here,
    and the worker with it)."""
    with small_tmpfs(tmp_path / "shm", 40) as d_shm:
        env = dict(os.environ, TANDEM_SHM_DIR=str(d_shm))
        d = start_daemon("--ctx-size", "1024", "--cache-bytes", "16M", env=env)
        with d.client() as c:
            st = c.status()
            assert arena_of(st.pid).parent == d_shm
            fill(d_shm)
            for i in range(6):  # more pages than 16 MiB holds: stores, evictions
                text = f"Turn {i}: " + "a different long preamble every time. " * (10 + i * 5)
                done = c.complete(prompt=text, max_tokens=4, ignore_eos=True)
                assert done.usage.completion_tokens == 4
            after = c.status()
            assert after.worker_pids == st.worker_pids and after.worker_restarts == 0
            assert after.cache.pages > 0 and after.cache.bytes_used <= after.cache.bytes_budget == 16 << 20
        assert d.stop() == 0
