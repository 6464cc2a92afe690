"""The prefix cache's disk tier through the daemon with SmolLM2: a prompt cached,
the daemon stopped (its shared-memory arena gone, as after a reboot), a new
daemon restores it from disk with output identical to an uncached run; damaged,
foreign and other-format page files are ignored with a warning; `tandem cache
clear` clears both tiers (or memory only), also with no daemon running."""

from __future__ import annotations

import os
import struct
import time

from tandem.daemon.cache import page_file

SYSTEM = (
    "You are the build assistant of a small software team. You read tool output and say what failed, in one "
    "sentence, naming the file. Never invent facts. Prefer plain words. "
) * 4
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "tests/test_io.py::test_read failed: FileNotFoundError: data/input.csv"},
]


def arenas() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith(f"tandem-kv-{os.getuid()}-")}


def pages_on_disk(kv) -> list:
    return sorted(kv.rglob("*.page"))


def bytes_on_disk(kv) -> int:
    """Bytes of every file in the tier (temporary ones too), as the worker may be writing and evicting."""
    total = 0
    for p in kv.rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() and p.name not in ("index", "lock") else 0
        except FileNotFoundError:
            pass
    return total


def test_a_prompt_survives_a_reboot_and_bad_page_files_are_ignored(start_daemon, tandem_cli):
    before = arenas()
    first = start_daemon("--ctx-size", "1024")
    kv = first.dir / "kv"
    with first.client() as client:
        st = client.status()
        assert st.cache.disk is not None and st.cache.disk.state == "on"
        assert st.cache.disk.path.startswith(str(kv))
        plain = client.complete(messages=MESSAGES, max_tokens=24, temperature=0.0)
        assert plain.usage.cached_tokens == 0 and plain.usage.prompt_tokens > 128
    assert first.stop() == 0  # stopping writes what was not on disk yet
    assert arenas() <= before  # shared memory holds nothing of it now: as after a reboot
    files = pages_on_disk(kv)
    chunk = 64
    kept = plain.usage.prompt_tokens // chunk * chunk  # what fast prefill keeps: whole chunks
    assert len(files) >= kept // 16

    second = start_daemon("--ctx-size", "1024", env={"TANDEM_DISK_CACHE_DIR": str(kv)})
    with second.client() as client:
        st = client.status()
        assert st.cache.pages == 0 and st.cache.disk.pages == len(files)
        again = client.complete(messages=MESSAGES, max_tokens=24, temperature=0.0)
        fresh = client.complete(messages=MESSAGES, max_tokens=24, temperature=0.0, cache=False)
    assert again.usage.cached_tokens == (plain.usage.prompt_tokens - 1) // chunk * chunk > 0
    assert again.cache.disk.tokens_from_disk == again.usage.cached_tokens and again.cache.disk.hits == 1
    assert again.text == fresh.text == plain.text
    assert second.stop() == 0

    # damaged files: each ignored with a warning, the output unchanged
    files = sorted(pages_on_disk(kv), key=lambda p: p.stat().st_mtime_ns)
    tier_dir = files[0].parent
    depth_of = {}
    for p in files:
        raw = p.read_bytes()
        depth_of[p] = page_file.HEADER.unpack_from(raw)[3]
    by_depth = sorted(files, key=lambda p: depth_of[p])
    victim = by_depth[len(by_depth) // 2]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF  # a bit flipped (or a page half-written when the power went)
    victim.write_bytes(bytes(raw))
    third = start_daemon("--ctx-size", "1024", env={"TANDEM_DISK_CACHE_DIR": str(kv)})
    with third.client() as client:
        damaged = client.complete(messages=MESSAGES, max_tokens=24, temperature=0.0)
        st = client.status()
    assert damaged.text == plain.text
    assert 0 < damaged.usage.cached_tokens < again.usage.cached_tokens  # up to the page before the bad one
    assert st.cache.disk.dropped == 1
    assert third.stop() == 0
    log = third.log()
    assert "checksum mismatch" in log and victim.name in log, log

    # a file of an older page format, and a truncated one: ignored at the next start, with a warning
    files = sorted(pages_on_disk(kv), key=lambda p: page_file.HEADER.unpack_from(p.read_bytes())[3])
    old, short, foreign = files[0], files[1], files[2]
    raw = bytearray(old.read_bytes())
    struct.pack_into("<I", raw, 8, page_file.FORMAT_VERSION - 1)
    old.write_bytes(bytes(raw))
    short.write_bytes(short.read_bytes()[:1000])
    as_root = os.getuid() == 0  # (CI runs as root: giving a file to another user needs it)
    if as_root:
        os.chown(foreign, 65534, 65534)
    fourth = start_daemon("--ctx-size", "1024", env={"TANDEM_DISK_CACHE_DIR": str(kv)})
    with fourth.client() as client:
        out = client.complete(messages=MESSAGES, max_tokens=24, temperature=0.0)
    assert out.text == plain.text and out.usage.cached_tokens == 0  # the first page was the old-format one
    assert fourth.stop() == 0
    log = fourth.log()
    assert "an older tandem's" in log and "truncated" in log, log
    assert not as_root or f"ignoring {foreign}: not this user's own" in log, log
    assert tier_dir.is_dir()


def test_another_models_pages_are_never_read(start_daemon, coder_path):
    smol = start_daemon("--ctx-size", "1024")
    kv = smol.dir / "kv"
    with smol.client() as client:
        client.complete(messages=MESSAGES, max_tokens=4, temperature=0.0)
    assert smol.stop() == 0
    files = {p: p.read_bytes() for p in pages_on_disk(kv)}
    assert files
    coder = start_daemon("--ctx-size", "1024", model=coder_path, env={"TANDEM_DISK_CACHE_DIR": str(kv)})
    with coder.client() as client:
        assert client.status().cache.disk.pages == 0
        out = client.complete(messages=MESSAGES, max_tokens=4, temperature=0.0)
    assert out.usage.cached_tokens == 0 and out.cache.disk.pages_read == 0
    assert coder.stop() == 0
    assert "1 other bucket(s)" in coder.log() and "not read" in coder.log(), coder.log()
    assert all(p.read_bytes() == raw for p, raw in files.items())  # and left as they were, in budget


def test_the_disk_budget_holds_under_a_long_random_workload(start_daemon):
    import random

    budget = 3 << 20
    d = start_daemon("--ctx-size", "1024", "--disk-cache-bytes", str(budget))
    kv = d.dir / "kv"
    rng = random.Random(3)
    words = "alpha beta gamma delta build test file error warning module function class import".split()
    with d.client() as client:
        for i in range(24):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(60, 200)))
            client.complete(prompt=f"{i}: {text}", max_tokens=2, temperature=0.0)
            assert bytes_on_disk(kv) <= budget
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            disk = client.status().cache.disk
            if disk.pages_written and disk.evictions:
                break
            time.sleep(0.1)
    assert d.stop() == 0
    assert disk.evictions > 0 and 0 < disk.bytes_used <= budget
    assert bytes_on_disk(kv) <= budget


def test_cache_clear_clears_both_tiers_or_memory_only(start_daemon, tandem_cli):
    d = start_daemon("--ctx-size", "1024")
    kv = d.dir / "kv"
    with d.client() as client:
        client.complete(messages=MESSAGES, max_tokens=8, temperature=0.0)
        deadline = time.monotonic() + 30
        while client.status().cache.disk.pages_written == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # written between requests, never while one waits
        on_disk = client.status().cache.disk.pages
        assert on_disk > 0
    out = tandem_cli(d.socket, "status")
    assert out.returncode == 0 and f"disk:      on: {on_disk:,} pages" in out.stdout, out.stdout + out.stderr
    out = tandem_cli(d.socket, "cache", "clear", "--memory-only")
    assert out.returncode == 0 and "from disk" not in out.stdout, out.stdout + out.stderr
    with d.client() as client:
        st = client.status()
        assert st.cache.pages == 0 and st.cache.disk.pages == on_disk
        again = client.complete(messages=MESSAGES, max_tokens=8, temperature=0.0)
        assert again.cache.disk.tokens_from_disk > 0  # the disk still had it
    out = tandem_cli(d.socket, "cache", "clear")
    assert out.returncode == 0 and "from disk" in out.stdout, out.stdout + out.stderr
    with d.client() as client:
        assert client.status().cache.disk.pages == 0
    assert pages_on_disk(kv) == []

    # with no daemon running, `cache clear` removes the page files
    with d.client() as client:
        client.complete(messages=MESSAGES, max_tokens=8, temperature=0.0)
    assert d.stop() == 0
    assert pages_on_disk(kv)
    out = tandem_cli(d.socket, "cache", "clear", env={**os.environ, "TANDEM_DISK_CACHE_DIR": str(kv)})
    assert out.returncode == 0 and "no daemon is running; removed" in out.stdout, out.stdout + out.stderr
    assert pages_on_disk(kv) == []


def test_disk_cache_bytes_0_turns_the_tier_off(start_daemon):
    d = start_daemon("--ctx-size", "1024", "--disk-cache-bytes", "0")
    with d.client() as client:
        assert client.status().cache.disk is None
        client.complete(messages=MESSAGES, max_tokens=4, temperature=0.0)
    assert not (d.dir / "kv").exists() or pages_on_disk(d.dir / "kv") == []
