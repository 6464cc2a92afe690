"""KV pages through a shared-memory arena with SmolLM2: restoring a cached
prefix gives bit-identical logits; no false hits; the budget holds."""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest

from tandem.daemon.cache.page_store import PageStore
from tandem.daemon.cache.prefix_cache import ExtentAllocator, PageTree

PAGE = 16


@pytest.fixture(scope="module")
def model(smollm2_path):
    from tandem.daemon.worker.llama_model import LlamaModel

    m = LlamaModel(smollm2_path, n_ctx=512)
    yield m
    m.close()


@pytest.fixture
def arena():
    shm = shared_memory.SharedMemory(create=True, size=8 * 2**20)
    yield shm
    shm.close()
    shm.unlink()


def store_for(model, arena, pages: int) -> PageStore:
    probe = PageStore(PageTree(PAGE, ExtentAllocator(0)), arena.buf, model)
    page_bytes = probe.probe_layout().page_bytes(PAGE)
    tree = PageTree(PAGE, ExtentAllocator(pages * page_bytes, align=1))
    s = PageStore(tree, arena.buf, model)
    s.layout = probe.layout
    return s


def text_tokens(model, text: str, n: int) -> list[int]:
    out = model.tokenize(text * 20, add_special=True)
    assert len(out) >= n
    return out[:n]


def prefill_and_store(model, s: PageStore, tokens) -> int:
    """Read ``tokens`` from scratch, then cache them; returns the pages written."""
    model.clear()
    model.decode(tokens)
    return s.store(tokens)


def fresh_logits(model, tokens):
    model.clear()
    return model.decode(tokens)[0]


def test_restored_prefix_gives_bit_identical_logits(model, arena):
    s = store_for(model, arena, pages=8)
    prompt = text_tokens(model, "Tool output: the build passed with 3 warnings. ", 3 * PAGE + 5)
    assert prefill_and_store(model, s, prompt) == 3  # the partial fourth page is not cached

    follow_up = prompt + text_tokens(model, "Next turn: fix the warnings. ", 9)
    expected = fresh_logits(model, follow_up)
    n = s.restore(follow_up)
    assert n == 3 * PAGE and model.n_past == n
    got = model.decode(follow_up[n:])[0]
    assert np.array_equal(got, expected)
    assert all(node.locks == 1 for node in s.locked)
    s.release()
    assert s.tree.stats.tokens_from_cache == 3 * PAGE


def test_same_page_tokens_after_another_prefix_are_not_a_hit(model, arena):
    s = store_for(model, arena, pages=8)
    a = text_tokens(model, "Alpha beta gamma delta. ", 2 * PAGE)
    prefill_and_store(model, s, a)
    b = text_tokens(model, "Zeta eta theta iota. ", PAGE) + a[PAGE:]  # shares only a's second page
    assert s.restore(b + [1]) == 0 and model.n_past == 0
    assert s.restore(a + [1]) == 2 * PAGE


def test_at_least_one_token_is_left_to_decode(model, arena):
    s = store_for(model, arena, pages=8)
    a = text_tokens(model, "One two three four. ", 2 * PAGE)
    prefill_and_store(model, s, a)
    assert s.restore(a) == PAGE  # all of it is cached, but its last token must be decoded for logits


def test_budget_holds_when_the_prompt_is_bigger_than_the_cache(model, arena):
    s = store_for(model, arena, pages=2)
    a = text_tokens(model, "Red green blue. ", 4 * PAGE)
    assert prefill_and_store(model, s, a) == 2
    assert s.tree.allocator.used <= s.tree.allocator.capacity
    assert s.restore(a + [1]) == 2 * PAGE


def test_a_new_store_over_the_same_arena_takes_the_pages_back_from_the_index(model, arena, tmp_path):
    """What a restarted worker does: same arena, fresh tree, the saved index."""
    s = store_for(model, arena, pages=8)
    a = text_tokens(model, "Tool output: 12 files changed. ", 3 * PAGE + 3)
    assert prefill_and_store(model, s, a) == 3
    s.save_index(tmp_path / "index")
    follow_up = a + text_tokens(model, "Now summarise. ", 5)
    expected = fresh_logits(model, follow_up)

    again = store_for(model, arena, pages=8)
    assert again.load_index(tmp_path / "index") == (3, 0)
    n = again.restore(follow_up)
    assert n == 3 * PAGE
    assert np.array_equal(model.decode(follow_up[n:])[0], expected)


def test_pages_overwritten_after_the_index_was_saved_are_dropped(model, arena, tmp_path):
    s = store_for(model, arena, pages=8)
    a = text_tokens(model, "Alpha beta gamma delta. ", 3 * PAGE)
    prefill_and_store(model, s, a)
    s.save_index(tmp_path / "index")
    second = s.tree.match(a, "target")[1].pages["target"]
    arena.buf[second.offset : second.offset + 8] = b"\xff" * 8  # what a later eviction + write would do

    again = store_for(model, arena, pages=8)
    assert again.load_index(tmp_path / "index") == (1, 2)  # the second fails, the third hangs below it
    assert again.restore(a + [1]) == PAGE


@pytest.mark.parametrize("content", [b"not msgpack \xc1", b"\x80"])
def test_an_unreadable_or_foreign_index_is_ignored(model, arena, tmp_path, content, caplog):
    (tmp_path / "index").write_bytes(content)
    s = store_for(model, arena, pages=8)
    assert s.load_index(tmp_path / "index") == (0, 0)
    assert "ignoring the prefix-cache index" in caplog.text
    assert s.load_index(tmp_path / "missing") == (0, 0)


def test_the_index_is_readable_by_this_user_only(model, arena, tmp_path):
    s = store_for(model, arena, pages=8)
    s.save_index(tmp_path / "index")
    assert (tmp_path / "index").stat().st_mode & 0o777 == 0o600
