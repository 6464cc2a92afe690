"""The prefix cache's budget against the free space of shared memory (a pure
unit: statvfs is faked, since this machine's /dev/shm size is what it is)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tandem.daemon.cache.arena import DEFAULT_CACHE_BYTES, cache_budget
from tandem.daemon.config import ServeError


def fake_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=free // 4096, f_frsize=4096))


@pytest.mark.parametrize(
    "requested, free, expected",
    [
        (None, 24 * 2**30, DEFAULT_CACHE_BYTES),  # plenty: 1 GiB
        (None, 64 * 2**20, 32 * 2**20),  # a container's 64 MiB /dev/shm: half of it
        (None, 0, 0),  # none: no cache
        (512 * 2**20, 2**30, 512 * 2**20),  # asked, fits
        (0, 0, 0),  # off
    ],
)
def test_budget(monkeypatch, requested, free, expected):
    fake_free(monkeypatch, free)
    assert cache_budget(requested) == expected


def test_more_than_shared_memory_holds_is_refused_and_says_what_to_do(monkeypatch):
    fake_free(monkeypatch, 2**30)
    with pytest.raises(
        ServeError, match=r"--cache-bytes 2048 MiB is more than /dev/shm has free \(1024 MiB\).*--cache-bytes 0"
    ):
        cache_budget(2 * 2**30)


def test_no_shared_memory_at_all(monkeypatch):
    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(os, "statvfs", missing)
    assert cache_budget(None) == 0
    with pytest.raises(ServeError):
        cache_budget(2**20)
