"""The engine core's store of Responses API objects: bounded, least recently used first,
running entries kept, and a cancelled entry never overwritten by its run's last report."""

from __future__ import annotations

import pytest

from agent_infer.core.response_store import ResponseStore


def test_eviction_is_least_recently_used_and_spares_running_entries():
    store = ResponseStore(max_entries=3, max_bytes=10**6)
    store.put("running", "in_progress", b"r")
    for key in ("a", "b"):
        store.put(key, "completed", key.encode())
    assert store.get("a").blob == b"a"  # "a" is now more recent than "b"
    store.put("c", "completed", b"c")
    assert store.get("b") is None and store.evicted == 1
    assert {k for k in ("running", "a", "c") if store.get(k) is not None} == {"running", "a", "c"}


def test_byte_budget_is_kept():
    store = ResponseStore(max_entries=100, max_bytes=25)
    for i in range(5):
        store.put(f"k{i}", "completed", bytes(10))
    assert len(store) == 2 and store.get("k4") is not None and store.get("k0") is None
    store.put("k4", "completed", bytes(5))  # replacing an entry frees its old bytes
    store.put("k5", "completed", bytes(10))
    assert store.get("k3") is not None and len(store) == 3


def test_cancel_marks_running_entries_only_and_sticks():
    store = ResponseStore()
    store.put("bg", "queued", b"q")
    before = store.cancel("bg")
    assert before.status == "queued" and store.get("bg").status == "cancelled"
    # The run reports its end after the cancel: the entry stays cancelled.
    assert store.put("bg", "completed", b"done") == "cancelled" and store.get("bg").blob == b"q"
    store.put("fg", "completed", b"x")
    assert store.cancel("fg").status == "completed" and store.get("fg").status == "completed"
    assert store.cancel("missing") is None
    assert store.delete("fg") and not store.delete("fg") and store.get("fg") is None


def test_store_needs_room():
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)
