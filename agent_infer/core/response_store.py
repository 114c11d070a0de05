"""Stored responses of the Responses API, kept by the engine core so that every front
end (--api-server-count) sees the same ones: `previous_response_id`, GET and cancel work
whichever front end a client reaches.

An entry is a status and an opaque blob (the front end's JSON); the core never reads
the blob. The store is bounded in entries and bytes: the least recently used finished
entries go first (entries still running are kept until they finish).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

RUNNING = frozenset({"queued", "in_progress"})


@dataclass
class Entry:
    status: str
    blob: bytes


class ResponseStore:
    def __init__(self, max_entries: int = 10_000, max_bytes: int = 512 * 2**20):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store needs room for at least one entry")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, status: str, blob: bytes) -> str:
        """Store `key`'s latest state; returns the status kept. A cancelled entry stays
        cancelled (its run may still report its last state after the cancel)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= len(old.blob)
            if old.status == "cancelled":
                status, blob = old.status, old.blob
        self._entries[key] = Entry(status, bytes(blob))
        self._bytes += len(blob)
        self._evict()
        return status

    def get(self, key: str) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def cancel(self, key: str) -> Entry | None:
        """Mark a running entry cancelled; returns the entry as it was (None if unknown)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        before = Entry(entry.status, entry.blob)
        if entry.status in RUNNING:
            entry.status = "cancelled"
        return before

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry.blob)
        return entry is not None

    def _evict(self) -> None:
        if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
            return
        for key in [k for k, e in self._entries.items() if e.status not in RUNNING]:
            if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                return
            self._bytes -= len(self._entries.pop(key).blob)
            self.evicted += 1
