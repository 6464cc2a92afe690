"""The prefix cache's tree, allocator and eviction policy, without a model."""

from __future__ import annotations

import random

import pytest

from tandem.daemon.cache.prefix_cache import ExtentAllocator, PageTree


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def tree(capacity=10_000, page_tokens=4, clock=None):
    return PageTree(page_tokens, ExtentAllocator(capacity, align=1), clock=clock or Clock())


def cache(t: PageTree, tokens, role="target", size=100):
    """Insert and give every page of ``tokens`` a page for ``role``; returns how many got one."""
    return len(t.store(tokens, role, size))


# ---------------------------------------------------------------------------- allocator


@pytest.mark.parametrize(
    "ops, used, largest",
    [
        ([("a", 10), ("a", 20), ("a", 30)], 60, 40),
        ([("a", 10), ("a", 20), ("f", 0)], 20, 70),  # holes of 10 (the freed front) and 70
        ([("a", 10), ("a", 20), ("f", 0), ("f", 1)], 0, 100),  # coalesced back into one extent
        ([("a", 50), ("a", 50), ("a", 1)], 100, 0),  # the third does not fit
        ([("a", 30), ("a", 30), ("a", 30), ("f", 1), ("a", 20)], 80, 10),  # first fit reuses the hole
    ],
)
def test_allocator(ops, used, largest):
    al = ExtentAllocator(100, align=1)
    live = []
    for op, arg in ops:
        if op == "a":
            off = al.alloc(arg)
            if off is not None:
                live.append(off)
        else:
            al.free(live[arg])
    assert al.used == used and al.largest_free() == largest


def test_allocator_never_exceeds_capacity_under_random_churn():
    rng = random.Random(7)
    al = ExtentAllocator(4096, align=64)
    live: dict[int, int] = {}
    for _ in range(5000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            al.free(off)
            del live[off]
        else:
            size = rng.randint(1, 700)
            off = al.alloc(size)
            if off is not None:
                assert off % 64 == 0 and off + al.size_of(off) <= 4096
                assert all(off + al.size_of(off) <= o or o + s <= off for o, s in live.items())  # no overlap
                live[off] = al.size_of(off)
        assert al.used == sum(live.values()) <= al.capacity
    for off in list(live):
        al.free(off)
    assert al.used == 0 and al.largest_free() == 4096


# ---------------------------------------------------------------------------- tree: insert, match, branch


@pytest.mark.parametrize(
    "cached, query, matched_pages",
    [
        ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7, 8, 9], 2),
        ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 4, 5, 6, 7], 1),  # a partial page never matches
        ([[1, 2, 3, 4, 5, 6, 7, 8]], [1, 2, 3, 9, 5, 6, 7, 8], 0),
        ([[1, 2, 3, 4, 5, 6, 7, 8]], [9, 9, 9, 9, 5, 6, 7, 8], 0),  # same second page, other prefix: no hit
        ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]], [1, 2, 3, 4, 9, 9, 9, 9, 1], 2),  # a branch
        ([[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]], [1, 2, 3, 4, 5, 6, 7, 8], 2),
        ([[5, 6, 7, 8, 1, 2, 3, 4]], [1, 2, 3, 4, 5, 6, 7, 8], 0),  # same pages, other order
        ([], [1, 2, 3, 4], 0),
    ],
)
def test_match_is_keyed_on_content_and_full_prefix(cached, query, matched_pages):
    t = tree()
    for tokens in cached:
        cache(t, tokens)
    chain = t.match(query, "target")
    assert len(chain) == matched_pages
    assert [tok for n in chain for tok in n.tokens] == query[: 4 * matched_pages]


def test_same_tokens_after_different_prefixes_are_different_pages():
    t = tree()
    cache(t, [1, 1, 1, 1, 7, 7, 7, 7])
    cache(t, [2, 2, 2, 2, 7, 7, 7, 7])
    a = t.match([1, 1, 1, 1, 7, 7, 7, 7], "target")[1]
    b = t.match([2, 2, 2, 2, 7, 7, 7, 7], "target")[1]
    assert a.tokens == b.tokens and a is not b and a.pages["target"] != b.pages["target"]
    assert t.pages() == 4


def test_roles_have_their_own_pages():
    t = tree()
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8], role="target")
    assert len(t.match([1, 2, 3, 4, 5, 6, 7, 8], "drafter")) == 0
    chain = t.insert([1, 2, 3, 4, 5, 6, 7, 8])
    t.allocate(chain[0], "drafter", 30)
    assert len(t.match([1, 2, 3, 4, 5, 6, 7, 8], "drafter")) == 1
    assert t.allocator.used == 2 * 100 + 30


def test_hit_miss_and_token_counters():
    t = tree()
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8])
    t.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9], "target")
    t.match([9, 9, 9, 9], "target")
    assert (t.stats.hits, t.stats.misses, t.stats.tokens_from_cache) == (1, 1, 8)


# ---------------------------------------------------------------------------- eviction


def test_evicts_least_recently_used_leaves_first():
    clock = Clock()
    t = tree(capacity=300, clock=clock)  # room for 3 pages
    cache(t, [1, 1, 1, 1])
    clock.now += 60
    cache(t, [2, 2, 2, 2])
    clock.now += 60
    cache(t, [3, 3, 3, 3])
    clock.now += 60
    t.match([1, 1, 1, 1], "target")  # used again: now the most recent
    clock.now += 60
    assert cache(t, [4, 4, 4, 4]) == 1
    assert len(t.match([2, 2, 2, 2], "target")) == 0  # the least recently used went
    assert all(len(t.match([k] * 4, "target")) == 1 for k in (1, 3, 4))
    assert t.stats.evictions == 1 and t.allocator.used == 300


def test_among_leaves_of_similar_age_the_shortest_prefix_goes_first():
    clock = Clock()
    t = tree(capacity=600, clock=clock)
    cache(t, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])  # a 3-page leaf ...
    clock.now += 1  # ... and 1 s later (same 5 s bucket) a 1-page leaf
    cache(t, [9, 9, 9, 9])
    clock.now += 1
    order = t.eviction_order()
    assert [n.prefix_tokens for n in order] == [4, 12]  # the short one first, though it is newer
    clock.now += 1
    assert cache(t, [5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7]) == 3  # 2 free pages: one eviction needed
    assert len(t.match([9, 9, 9, 9], "target")) == 0  # the short one went
    assert len(t.match([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], "target")) == 3
    assert t.allocator.used == 600


def test_older_bucket_beats_shorter_prefix():
    clock = Clock()
    t = tree(capacity=600, clock=clock)
    cache(t, [1, 1, 1, 1, 2, 2, 2, 2])
    clock.now += 30  # a different age bucket
    cache(t, [9, 9, 9, 9])
    assert [n.prefix_tokens for n in t.eviction_order()] == [8, 4]


def test_only_leaves_are_evicted_and_parents_follow():
    t = tree(capacity=300)
    cache(t, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    order = t.eviction_order()
    assert [n.prefix_tokens for n in order] == [12]  # inner pages are not candidates
    t.evict(order[0])
    assert [n.prefix_tokens for n in t.eviction_order()] == [8]
    with pytest.raises(ValueError):
        t.evict(t.match([1, 1, 1, 1], "target")[0])  # not a leaf


def test_locked_pages_are_never_evicted():
    t = tree(capacity=200)
    chain = t.insert([1, 1, 1, 1, 2, 2, 2, 2])
    for n in chain:
        t.allocate(n, "target", 100)
    t.lock(chain)
    assert cache(t, [3, 3, 3, 3]) == 0  # no room and nothing evictable
    assert t.stats.failed_allocations == 1 and len(t.match([1, 1, 1, 1, 2, 2, 2, 2], "target")) == 2
    t.unlock(chain)
    assert cache(t, [3, 3, 3, 3]) == 1  # now the old leaf can go
    with pytest.raises(ValueError):
        t.unlock(chain)


def test_allocating_for_an_evicted_node_is_refused():
    t = tree(capacity=100)
    chain = t.insert([1, 1, 1, 1, 2, 2, 2, 2])  # unlocked, pageless: the second node is an evictable leaf
    t.allocate(chain[0], "target", 100)
    t.evict(chain[1])
    with pytest.raises(ValueError):
        t.allocate(chain[1], "target", 10)


def test_a_new_chain_does_not_evict_its_own_pages():
    t = tree(capacity=300)
    # 4 pages into room for 3: the last cannot be placed without evicting the chain's own pages
    assert cache(t, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]) == 3
    assert len(t.match([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4], "target")) == 3


def test_budget_is_never_exceeded_under_random_workload():
    rng = random.Random(3)
    clock = Clock()
    t = tree(capacity=2_000, clock=clock)
    prefixes = [[rng.randint(0, 5) for _ in range(4 * rng.randint(1, 6))] for _ in range(8)]
    for _ in range(400):
        clock.now += rng.random() * 3
        tokens = rng.choice(prefixes) + [rng.randint(0, 3) for _ in range(4 * rng.randint(0, 4))]
        locked = t.match(tokens, "target")
        t.lock(locked)
        t.store(tokens, "target", rng.choice([90, 100, 130]))
        t.unlock(locked)
        assert t.allocator.used <= 2_000
        assert t.allocator.used == sum(p.size for n in t.nodes() for p in n.pages.values())


def test_clear_drops_everything_unlocked():
    t = tree()
    cache(t, [1, 1, 1, 1, 2, 2, 2, 2])
    keep = t.insert([3, 3, 3, 3])
    t.allocate(keep[0], "target", 100)
    t.lock(keep)
    assert t.clear() == 2
    assert t.pages() == 1 and t.allocator.used == 100


def test_clear_is_not_counted_as_evictions():
    t = tree()
    cache(t, list(range(8)))
    t.clear()
    assert t.stats.evictions == 0 and t.pages() == 0


# ---------------------------------------------------------------------------- surviving a worker restart


@pytest.mark.parametrize(
    "live, offset, size, ok",
    [
        ([], 0, 100, True),
        ([], 40, 20, True),  # splits the free extent in three
        ([(0, 50)], 40, 20, False),  # overlaps a live extent
        ([(0, 50)], 50, 50, True),  # exactly the rest
        ([], 90, 20, False),  # past the end
    ],
)
def test_reserve_takes_only_free_ranges(live, offset, size, ok):
    al = ExtentAllocator(100, align=1)
    for off, sz in live:
        assert al.reserve(off, sz)
    assert al.reserve(offset, size) is ok
    assert al.used == sum(s for _, s in live) + (size if ok else 0)
    if ok:  # the rest is still allocatable, and no byte twice
        rest = []
        while (o := al.alloc(1)) is not None:
            rest.append(o)
        assert not set(rest) & set(range(offset, offset + size))
        assert al.used == 100


def written(t: PageTree, crc=7):
    """Mark every page written (a checksum), as PageStore.seal does."""
    from dataclasses import replace

    for n in t.nodes():
        for role, p in n.pages.items():
            n.pages[role] = replace(p, crc=crc)


def test_snapshot_and_load_give_the_same_tree():
    t = tree()
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8])
    cache(t, [1, 2, 3, 4, 9, 9, 9, 9])
    cache(t, [1, 2, 3, 4], role="drafter", size=40)
    written(t)
    u = tree()
    kept, dropped = u.load(t.snapshot(), lambda page: True)
    assert (kept, dropped) == (4, 0)
    assert u.allocator.used == t.allocator.used
    assert len(u.match([1, 2, 3, 4, 9, 9, 9, 9], "target")) == 2
    assert len(u.match([1, 2, 3, 4, 5, 6, 7, 8], "drafter")) == 1
    assert len(u.match([5, 6, 7, 8], "target")) == 0  # still keyed on the full prefix
    # a new page never lands on a kept one
    offsets = {n.pages["target"].offset for n in u.nodes() if "target" in n.pages}
    new = u.store([7] * 4, "target", 100)
    assert new[0][1].offset not in offsets


def test_load_drops_pages_that_fail_their_check_and_what_hangs_below_them():
    t = tree()
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8], role="drafter", size=40)
    written(t)
    bad = t.match([1, 2, 3, 4, 5, 6, 7, 8], "target")[1].pages["target"].offset
    u = tree()
    kept, dropped = u.load(t.snapshot(), lambda page: page.offset != bad)
    # target: page 1 kept, page 2 failed, page 3 unreachable; drafter: both kept
    assert (kept, dropped) == (3, 2)
    assert len(u.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "target")) == 1
    assert len(u.match([1, 2, 3, 4, 5, 6, 7, 8], "drafter")) == 2


def test_unwritten_pages_are_not_in_the_snapshot():
    t = tree()
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8])
    assert t.snapshot()["nodes"] == []
    written(t)
    assert len(t.snapshot()["nodes"]) == 2


def test_load_refuses_another_page_size_and_a_non_empty_tree():
    t = tree()
    cache(t, [1, 2, 3, 4])
    written(t)
    with pytest.raises(ValueError, match="pages of 4 tokens"):
        tree(page_tokens=8).load(t.snapshot(), lambda page: True)
    with pytest.raises(ValueError, match="empty"):
        t.load(t.snapshot(), lambda page: True)


def test_drop_page_frees_it_and_an_empty_leaf_leaves():
    t = tree()
    cache(t, [1, 2, 3, 4, 5, 6, 7, 8])
    leaf = t.match([1, 2, 3, 4, 5, 6, 7, 8], "target")[1]
    t.drop_page(leaf, "target")
    assert t.allocator.used == 100 and len(t.nodes()) == 1
