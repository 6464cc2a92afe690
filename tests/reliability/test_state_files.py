"""Damaged state files never stop the model from loading: the governor's state and
the prefix cache's index, fuzzed with arbitrary JSON/msgpack values and bytes, are
ignored with a warning and the daemon starts fresh (the cases that used to raise
are pinned below the fuzzing)."""

from __future__ import annotations

import json

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.daemon.cache.page_store import INDEX_VERSION, PageStore
from tandem.daemon.cache.prefix_cache import ExtentAllocator, PageTree
from tandem.daemon.drafting.governor import STATE_VERSION, GovernorBank

IDENTITY = "target|drafter|k4"
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def governor_from(path, payload: bytes) -> GovernorBank:
    path.write_bytes(payload)
    bank = GovernorBank(IDENTITY, path)
    bank.get("task")  # usable
    bank.save()
    return bank


@pytest.mark.slow  # seconds, no model: out of the fast subset
@FUZZ
@given(tasks=JSON, last=JSON)
def test_any_governor_state_shape_is_ignored_or_loaded(tmp_path, tasks, last):
    doc = {"version": STATE_VERSION, "identity": IDENTITY, "tasks": tasks, "last_task": last}
    governor_from(tmp_path / "g.json", json.dumps(doc).encode())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.json", "g.json.lock"]  # no temp file left


@pytest.mark.slow  # seconds, no model: out of the fast subset
@FUZZ
@given(payload=st.binary(max_size=200))
def test_any_governor_state_bytes_are_ignored(tmp_path, payload):
    governor_from(tmp_path / "g.json", payload)


def test_governor_states_that_used_to_stop_the_model_loading(tmp_path):
    for payload in (
        b"\xff\xfe{}",  # not UTF-8
        json.dumps({"version": STATE_VERSION, "identity": IDENTITY, "tasks": []}).encode(),
        json.dumps({"version": STATE_VERSION, "identity": IDENTITY, "tasks": {"t": []}}).encode(),
    ):
        assert governor_from(tmp_path / "g.json", payload).tasks.keys() == {"task"}


def page_store() -> PageStore:
    arena = memoryview(bytearray(4096))
    return PageStore(PageTree(4, ExtentAllocator(len(arena), align=1)), arena, model=None)


def index_from(path, payload: bytes) -> tuple[int, int]:
    path.write_bytes(payload)
    store = page_store()
    kept, dropped = store.load_index(path)
    assert kept == 0  # nothing in this arena matches a checksum: nothing is trusted
    return kept, dropped


@pytest.mark.slow  # seconds, no model: out of the fast subset
@FUZZ
@given(tree=JSON)
def test_any_cache_index_shape_is_ignored(tmp_path, tree):
    index_from(tmp_path / "i", msgpack.packb({"version": INDEX_VERSION, "layout": "None", "tree": tree}))


@FUZZ
@given(payload=st.binary(max_size=200))
def test_any_cache_index_bytes_are_ignored(tmp_path, payload):
    index_from(tmp_path / "i", payload)


def test_cache_indexes_that_used_to_stop_the_model_loading(tmp_path):
    for tree in ([], {"page_tokens": 4, "nodes": {}}, {"page_tokens": 4, "nodes": [[-1, [1, 2, 3, 4], []]]}):
        index_from(tmp_path / "i", msgpack.packb({"version": INDEX_VERSION, "layout": "None", "tree": tree}))
    index_from(tmp_path / "i", msgpack.packb({(1, 2): 3}, use_bin_type=True))  # a map key Python cannot hash


def test_two_daemons_sharing_a_state_file_keep_each_others_tasks(tmp_path):
    """Issue 19, item 7: two daemons, one state directory, the same models: each
    saves what it learnt without dropping what the other learnt."""
    path = tmp_path / "g.json"
    a, b = GovernorBank(IDENTITY, path), GovernorBank(IDENTITY, path)
    a.get("json").record(16, 0.2)
    a.save()
    b.get("story")
    b.save()  # b never saw "json": it must keep it
    a.get("json")
    a.save()  # nor may a drop b's "story"
    again = GovernorBank(IDENTITY, path)
    assert set(again.tasks) == {"json", "story"}
    assert again.tasks["json"].to_dict() == a.tasks["json"].to_dict()  # a's own measurements, not b's copy
