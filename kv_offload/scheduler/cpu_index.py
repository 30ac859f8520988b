"""CpuIndex: the scheduler's map of which chunk lives in which CPU-tier slot."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kv_offload.keys import ChunkKey


class SlotState(enum.Enum):
    STORING = "storing"  # engine -> host copy planned; bytes not complete; invisible
    STAGING = "staging"  # disk -> host read planned for a load; visible to loads only
    READY = "ready"  # bytes complete on every rank; visible


@dataclass(slots=True)
class _Entry:
    slot: int
    state: SlotState
    pins: int = 0
    staging_job: int | None = None  # job that fills a STAGING slot


@dataclass(frozen=True, slots=True)
class CpuHit:
    """A CPU-tier hit: the slot, and the load job still filling it (None when READY)."""

    key: ChunkKey
    slot: int
    staging_job: int | None


class CpuIndex:
    """Key -> slot map of the CPU tier with LRU (or FIFO) order, states and pins.

    Scheduler thread only (not thread-safe). Never touches bytes. A slot is reused only
    when its entry is READY, unpinned and chosen as victim (invariant 2); STORING and
    STAGING entries are never victims.
    """

    def __init__(self, num_slots: int, *, policy: str = "lru") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._touch_on_hit = policy == "lru"
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()  # oldest first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self.num_evictions = 0

    # -- queries (no side effects) -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._entries

    def lookup_prefix(self, keys: Sequence[ChunkKey]) -> list[CpuHit]:
        """Hits for the longest prefix of ``keys`` that is READY or STAGING. Read-only."""
        hits: list[CpuHit] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.state is SlotState.STORING:
                break
            staging = entry.staging_job if entry.state is SlotState.STAGING else None
            hits.append(CpuHit(key, entry.slot, staging))
        return hits

    def state(self, key: ChunkKey) -> SlotState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def counts(self) -> dict[str, int]:
        """Entries per state, pinned entries and free slots (for tests and metrics)."""
        out = {s.value: 0 for s in SlotState}
        pinned = 0
        for entry in self._entries.values():
            out[entry.state.value] += 1
            pinned += entry.pins > 0
        out["pinned"] = pinned
        out["free"] = len(self._free)
        return out

    # -- mutations -------------------------------------------------------------------------

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Mark ``keys`` most recently used (no-op under FIFO or for unknown keys)."""
        if not self._touch_on_hit:
            return
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def pin(self, keys: Iterable[ChunkKey]) -> None:
        """Protect the slots of ``keys`` from eviction; every pin needs one ``unpin``."""
        for key in keys:
            self._entries[key].pins += 1

    def unpin(self, keys: Iterable[ChunkKey]) -> None:
        for key in keys:
            entry = self._entries.get(key)
            if entry is not None and entry.pins > 0:
                entry.pins -= 1

    def reserve(self, key: ChunkKey, state: SlotState, *, staging_job: int | None = None
                ) -> int | None:
        """Give ``key`` a slot in state STORING or STAGING, pinned once; None if no room.

        Takes a free slot, else evicts the least recently used READY unpinned entry.
        Atomic: on None nothing changed. ``key`` must not be present.
        """
        if key in self._entries:
            raise KeyError("chunk already present in the CPU index")
        if state is SlotState.READY:
            raise ValueError("reserve() creates STORING or STAGING entries")
        slot = self._take_slot()
        if slot is None:
            return None
        self._entries[key] = _Entry(slot, state, pins=1, staging_job=staging_job)
        return slot

    def publish(self, key: ChunkKey) -> None:
        """Make a reserved entry READY (its bytes are complete on every rank)."""
        entry = self._entries[key]
        entry.state = SlotState.READY
        entry.staging_job = None

    def discard(self, key: ChunkKey) -> None:
        """Remove an entry whatever its state and free its slot (failed store or load)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._free.append(entry.slot)

    def clear_unpinned(self) -> int:
        """Drop every READY unpinned entry; returns how many were dropped."""
        victims = [k for k, e in self._entries.items()
                   if e.state is SlotState.READY and e.pins == 0]
        for key in victims:
            self.discard(key)
        return len(victims)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, entry in self._entries.items():
            if entry.state is SlotState.READY and entry.pins == 0:
                del self._entries[key]
                self.num_evictions += 1
                return entry.slot
        return None
