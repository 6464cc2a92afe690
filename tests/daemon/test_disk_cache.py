"""The prefix cache's disk tier (daemon/cache/disk_cache.py, its files' format page_file.py) on its own: page files
written and read back, every kind of bad file ignored with a warning, the
index across reopening, the budget under a random workload, one daemon per
bucket, a disk that fails. (Through the daemon: tests/integration/test_disk_tier.py.)"""

from __future__ import annotations

import errno
import logging
import os
import random
import struct

import pytest

from tandem.daemon.cache import disk_cache, page_file
from tandem.daemon.cache.disk_cache import DiskTier
from tandem.daemon.cache.page_file import HEADER, child_key

PT = 4  # tokens per page
PB = 64  # bytes per page
IDENTITY = "123:456:abc kernels=mixed prefill_chunk=64"


def open_tier(root, budget=1 << 20, identity=IDENTITY, layout="L"):
    return DiskTier.open(root, identity, layout, PT, PB, budget)


def page(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(PB))


def chain(tier, pages: list[list[int]]) -> list[bytes]:
    """Write ``pages`` as one prefix; returns their keys."""
    keys, parent = [], tier.root_key
    for depth, tokens in enumerate(pages):
        key = child_key(parent, tokens)
        assert tier.write(key, parent, depth, tokens, page(sum(tokens)))
        keys.append(key)
        parent = key
    return keys


TOKENS = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]


def test_pages_come_back_after_reopening(tmp_path):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS)
    tier.save_index()
    tier.close()
    again = open_tier(tmp_path)
    assert set(again.entries) == set(keys) and again.bytes_used == 3 * again.file_bytes
    parent = again.root_key
    for key, tokens in zip(keys, TOKENS):
        assert again.read(key, parent, tokens) == page(sum(tokens))
        parent = key
    assert again.stats.dropped == 0
    # the directory and every file are this user's alone
    assert os.stat(tmp_path).st_mode & 0o777 == 0o700 and os.stat(again.path).st_mode & 0o777 == 0o700
    assert all(os.stat(p).st_mode & 0o077 == 0 for p in again.path.iterdir())


def test_the_same_tokens_after_another_prefix_are_another_page(tmp_path):
    tier = open_tier(tmp_path)
    a = chain(tier, [[1, 1, 1, 1], [2, 2, 2, 2]])
    b = chain(tier, [[3, 3, 3, 3], [2, 2, 2, 2]])
    assert a[1] != b[1]
    assert tier.read(a[1], b[0], [2, 2, 2, 2]) is None  # asked under the wrong parent: not this page


def test_another_model_or_layout_is_another_directory(tmp_path):
    one = open_tier(tmp_path)
    chain(one, TOKENS)
    one.close()
    assert open_tier(tmp_path, identity="999:456:abc kernels=mixed prefill_chunk=64").entries == {}
    assert open_tier(tmp_path, layout="other").entries == {}


def damage(tier, key, how: str) -> None:
    path = tier.path / (key.hex() + ".page")
    raw = bytearray(path.read_bytes())
    if how == "corrupt":
        raw[-1] ^= 0xFF
    elif how == "truncated":
        raw = raw[: len(raw) // 2]
    elif how == "old format":
        struct.pack_into("<I", raw, 8, page_file.FORMAT_VERSION + 1)
    elif how == "other model":
        fields = list(HEADER.unpack_from(raw))
        fields[4] = bytes(16)  # the bucket of another model file
        HEADER.pack_into(raw, 0, *fields)
    path.write_bytes(bytes(raw))
    os.chmod(path, 0o600)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "old format", "other model"])
def test_a_bad_page_file_is_ignored_with_a_warning(tmp_path, caplog, how):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS)
    tier.save_index()
    damage(tier, keys[1], how)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        tier.close()
        tier = open_tier(tmp_path)
        first = tier.read(keys[0], tier.root_key, TOKENS[0])
        second = tier.read(keys[1], keys[0], TOKENS[1]) if keys[1] in tier else None
    assert first == page(sum(TOKENS[0]))
    assert second is None
    assert keys[1] not in tier and keys[2] not in tier  # what lay under it can no longer be reached
    assert not (tier.path / (keys[1].hex() + ".page")).exists()
    assert any(keys[1].hex() in r.getMessage() for r in caplog.records), caplog.text
    assert tier.stats.dropped >= 1


def test_a_page_file_others_may_read_is_ignored(tmp_path, caplog):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS[:1])
    os.chmod(tier.path / (keys[0].hex() + ".page"), 0o644)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert tier.read(keys[0], tier.root_key, TOKENS[0]) is None
    assert "others may use it" in caplog.text and keys[0] not in tier


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file to another user (CI runs as root)")
def test_a_page_file_of_another_user_is_ignored(tmp_path, caplog):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS)
    tier.save_index()
    tier.close()
    os.chown(tier.path / (keys[0].hex() + ".page"), 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        again = open_tier(tmp_path)
    assert again.entries == {}  # the first page is foreign: nothing under it is reachable
    assert "not this user's own" in caplog.text


def test_a_directory_others_can_enter_is_refused(tmp_path, caplog):
    root = tmp_path / "kv"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert open_tier(root) is None
    assert "chmod 700" in caplog.text


def test_a_damaged_index_starts_empty_and_removes_the_files_it_no_longer_names(tmp_path, caplog):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS)
    tier.save_index()
    tier.close()
    (tier.path / "index").write_bytes(b"\x93not msgpack at all")
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        again = open_tier(tmp_path)
    assert again.entries == {} and "ignoring the index" in caplog.text
    assert not any((again.path / (k.hex() + ".page")).exists() for k in keys)


def test_pages_written_after_the_last_index_are_removed_at_start(tmp_path):
    tier = open_tier(tmp_path)
    chain(tier, TOKENS[:1])
    tier.save_index()
    late = chain(tier, [[7, 7, 7, 7]])  # the worker is killed before the index names it
    tier.close()
    again = open_tier(tmp_path)
    assert late[0] not in again and not (again.path / (late[0].hex() + ".page")).exists()
    assert len(again.entries) == 1


def test_one_daemon_per_bucket(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(disk_cache, "LOCK_WAIT_SECONDS", 0.2)
    first = open_tier(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert open_tier(tmp_path) is None
    assert "another tandem daemon" in caplog.text
    first.close()
    assert open_tier(tmp_path) is not None


def test_the_budget_holds_under_a_random_workload(tmp_path):
    rng = random.Random(7)
    tier = open_tier(tmp_path, budget=0)  # none: refused
    assert tier is None
    probe = open_tier(tmp_path)
    budget = 10 * probe.file_bytes + 5
    probe.close()
    tier = open_tier(tmp_path, budget=budget)
    for i in range(400):
        n = rng.randint(1, 6)
        prefix = rng.randint(0, 3)
        pages = [[prefix, d, rng.randint(0, 2) if d == n - 1 else 0, 0] for d in range(n)]
        parent = tier.root_key
        for depth, tokens in enumerate(pages):
            key = child_key(parent, tokens)
            if key not in tier:
                tier.write(key, parent, depth, tokens, page(i))
            parent = key
        on_disk = sum(p.stat().st_size for p in tier.path.glob("*.page"))
        assert on_disk == tier.bytes_used <= budget
        for e in tier.entries.values():  # every page is reachable
            assert e.parent == tier.root_key or e.parent in tier.entries
    assert tier.stats.evictions > 0


def test_another_models_pages_go_first(tmp_path):
    other = open_tier(tmp_path, identity="other model")
    chain(other, TOKENS)
    other.save_index()
    other.close()
    budget = 4 * other.file_bytes
    tier = open_tier(tmp_path, budget=budget)
    chain(tier, TOKENS[:2])  # 3 + 2 pages > 4: the other model's bucket is removed, not this one's pages
    assert not other.path.exists() and len(tier.entries) == 2


@pytest.mark.parametrize("code, says", [(errno.ENOSPC, "the disk is full"), (errno.EROFS, "read-only file system")])
def test_a_full_or_read_only_disk_turns_the_tier_off_and_never_raises(tmp_path, monkeypatch, caplog, code, says):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS[:1])
    real_write = page_file.write_atomic

    def full(path, data, sync=False):  # the disk fills (or is remounted read-only) halfway through the page
        real_write(path, data[:10])
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(disk_cache, "write_atomic", full)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert not tier.write(child_key(keys[0], TOKENS[1]), keys[0], 1, TOKENS[1], page(1))
    assert tier.off_reason and says in caplog.text
    assert tier.info().state.startswith("off: ") and says in tier.info().state
    assert not tier.write(child_key(keys[0], TOKENS[2]), keys[0], 1, TOKENS[2], page(2))  # quietly, from now on


def test_a_held_bucket_of_another_model_counts_and_stays(tmp_path):
    other = open_tier(tmp_path, identity="other model")  # a running daemon on another model holds it
    chain(other, TOKENS)
    budget = 5 * other.file_bytes
    tier = open_tier(tmp_path, budget=budget)
    chain(tier, [[1, 1, 1, 1], [2, 2, 2, 2]])
    assert tier.write(child_key(tier.root_key, [9, 9, 9, 9]), tier.root_key, 0, [9, 9, 9, 9], page(9))
    assert len(other.entries) == 3 and all(other.path.glob("*.page"))  # never removed
    assert len(tier.entries) == 2 and tier.stats.evictions == 1  # this one's own page went instead
    assert tier.bytes_used + other.bytes_used <= budget


def test_nothing_but_buckets_is_ever_removed(tmp_path):
    models = tmp_path / "models"  # --disk-cache-dir pointed at ~/.cache/tandem, say
    models.mkdir()
    (models / "model.gguf").write_bytes(b"GGUF")
    lookalike = tmp_path / ("0" * 32)  # named like a bucket, but not one
    lookalike.mkdir()
    (lookalike / "notes.txt").write_text("mine")
    other = open_tier(tmp_path, identity="other model")
    chain(other, TOKENS)
    other.close()
    tier = open_tier(tmp_path)
    chain(tier, TOKENS[:2])
    assert tier.clear() == (5, 5 * tier.file_bytes)
    assert (models / "model.gguf").read_bytes() == b"GGUF" and (lookalike / "notes.txt").read_text() == "mine"
    assert disk_cache.clear_dir(tmp_path) == (0, 0, 1)  # (the one held is this test's own)
    assert (models / "model.gguf").exists()


def test_too_little_free_space_evicts_nothing_it_cannot_use(tmp_path, monkeypatch, caplog):
    tier = open_tier(tmp_path)
    keys = chain(tier, TOKENS)
    monkeypatch.setattr(disk_cache, "free_bytes", lambda path: 0)  # full of someone else's files
    monkeypatch.setattr(disk_cache, "free_reserve", lambda path: 10 * tier.file_bytes)
    with caplog.at_level(logging.WARNING, logger="tandem.cache"):
        assert not tier.write(child_key(keys[-1], [0, 0, 0, 0]), keys[-1], 3, [0, 0, 0, 0], page(0))
    assert len(tier.entries) == 3 and not tier.off_reason  # kept: evicting them would not have made room
    assert "too little free space" in caplog.text


def test_a_lowered_budget_is_enforced_at_start(tmp_path):
    tier = open_tier(tmp_path)
    chain(tier, TOKENS)
    tier.save_index()
    tier.close()
    again = open_tier(tmp_path, budget=2 * tier.file_bytes)
    assert again.bytes_used <= 2 * tier.file_bytes and len(again.entries) == 2
    assert len(list(again.path.glob("*.page"))) == 2


def test_clear_removes_every_page_file(tmp_path):
    other = open_tier(tmp_path, identity="other model")
    chain(other, TOKENS)
    other.close()
    tier = open_tier(tmp_path)
    chain(tier, TOKENS)
    pages, nbytes = tier.clear()
    assert pages == 6 and nbytes == 6 * tier.file_bytes
    assert not list(tmp_path.rglob("*.page"))
    tier.close()
    assert DiskTier.open(tmp_path, IDENTITY, "L", PT, PB, 1 << 20).entries == {}


def test_clear_dir_without_a_daemon_leaves_a_held_bucket(tmp_path):
    held = open_tier(tmp_path)
    chain(held, TOKENS)
    other = open_tier(tmp_path, identity="other model")
    chain(other, TOKENS[:2])
    other.close()
    assert disk_cache.clear_dir(tmp_path) == (2, 2 * other.file_bytes, 1)
    assert len(list(held.path.glob("*.page"))) == 3


# --------------------------------------------------------------------------- with a model's real KV pages


@pytest.mark.parametrize("page_tokens", [16, 5])  # (5: a page whose bytes are no multiple of the arena's alignment)
def test_pages_spilled_to_disk_restore_bit_identical_logits_into_an_empty_arena(smollm2_path, tmp_path, page_tokens):
    from multiprocessing import shared_memory

    import numpy as np

    from tandem.daemon.cache.page_store import PageStore
    from tandem.daemon.cache.prefix_cache import ExtentAllocator, PageTree
    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(smollm2_path, n_ctx=512)
    shms = [shared_memory.SharedMemory(create=True, size=8 << 20) for _ in range(2)]
    try:

        def store_with_disk(shm) -> PageStore:
            s = PageStore(PageTree(page_tokens, ExtentAllocator(8 << 20)), shm.buf, model)
            s.probe_layout()
            page_bytes = s.layout.page_bytes(page_tokens)
            s.disk = DiskTier.open(tmp_path, IDENTITY, repr(s.layout), page_tokens, page_bytes, 64 << 20)
            return s

        prompt = model.tokenize("Tool output: the build passed with 3 warnings. " * 12, add_special=True)
        prompt = prompt[: 4 * page_tokens + page_tokens // 2]
        first = store_with_disk(shms[0])
        model.clear()
        model.decode(prompt)
        assert first.store(prompt) == 4
        assert len(first.to_disk) == 4
        first.store(prompt)  # stored again: queued once
        assert len(first.to_disk) == 4
        while first.spill():
            pass
        assert first.disk.stats.pages_written == 4 and not first.to_disk
        first.disk.close()

        # a reboot: a new arena, empty; the disk tier finds the pages
        follow_up = prompt + model.tokenize(" Next turn: fix the warnings.", add_special=False)
        model.clear()
        expected = model.decode(follow_up)[0]
        second = store_with_disk(shms[1])
        assert second.tree.pages() == 0
        n = second.restore(follow_up)
        assert n == 4 * page_tokens and model.n_past == n
        assert np.array_equal(model.decode(follow_up[n:])[0], expected)
        second.release()
        info = second.info()
        assert info.disk.hits == 1 and info.disk.tokens_from_disk == n and info.disk.pages_read == 4
        assert info.tokens_from_cache == n and second.tree.pages() == 4  # now in shared memory too
        # ... and the next hit is served from shared memory, not read from disk again
        second.restore(follow_up)
        second.release()
        assert second.info().disk.pages_read == 4

        # an arena with room for two pages: two are read from disk, the rest of the prompt is read
        second.disk.close()
        small_shm = shared_memory.SharedMemory(create=True, size=8 << 20)
        shms.append(small_shm)
        small = PageStore(
            PageTree(page_tokens, ExtentAllocator(2 * second.tree.allocator._round(second._page_bytes()))),
            small_shm.buf,
            model,
        )
        small.probe_layout()
        small.disk = DiskTier.open(tmp_path, IDENTITY, repr(small.layout), page_tokens, small._page_bytes(), 64 << 20)
        n = small.restore(follow_up)
        assert n == 2 * page_tokens and small.tree.pages() == 2
        assert np.array_equal(model.decode(follow_up[n:])[0], expected)
        small.release()
        small.disk.close()

        # a damaged page: the restore stops before it, the output stays the same
        third_shm = shared_memory.SharedMemory(create=True, size=8 << 20)
        shms.append(third_shm)
        victim = sorted(second.disk.entries.values(), key=lambda e: e.depth)[2]
        path = second.disk.path / (victim.key.hex() + ".page")
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x01
        path.write_bytes(bytes(raw))
        third = store_with_disk(third_shm)
        n = third.restore(follow_up)
        assert n == 2 * page_tokens
        assert np.array_equal(model.decode(follow_up[n:])[0], expected)
        third.release()
        assert third.info().disk.dropped == 1
    finally:
        model.close()
        for shm in shms:
            shm.close()
            shm.unlink()
