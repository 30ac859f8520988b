"""CpuIndex: the scheduler's map of which chunk lives in which CPU-tier slot."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kv_offload.keys import ChunkKey
from kv_offload.scheduler.events import Tier, TierEvents


class SlotState(enum.Enum):
    STORING = "storing"  # engine -> host copy planned; bytes not complete; invisible
    STAGING = "staging"  # disk -> host read planned for a load; visible to loads only
    READY = "ready"  # bytes complete on every rank; visible


@dataclass(slots=True)
class _Entry:
    key: ChunkKey
    slot: int
    state: SlotState
    pins: int = 0
    staging_job: int | None = None  # job that fills a STAGING slot
    listed: bool = True  # False once discarded: invisible, slot freed at the last unpin


class CpuHit(NamedTuple):
    """A CPU-tier hit: the slot, and the load job still filling it (None when READY).
    A NamedTuple: built on every lookup, it must be cheap."""

    key: ChunkKey
    slot: int
    staging_job: int | None


class CpuIndex:
    """Key -> slot map of the CPU tier with LRU (or FIFO) order, states and pins.

    Scheduler thread only (not thread-safe). Never touches bytes. Pins belong to a slot
    (the entry that holds it), not to a key, so releasing a pin never touches a newer
    entry of the same key. A slot is reused only when no pin holds it: a READY unpinned
    entry may be evicted; a discarded entry that is still pinned keeps its slot, invisible,
    until its last pin is released (invariant 2). STORING and STAGING entries are never
    victims.
    """

    def __init__(self, num_slots: int, *, policy: str = "lru") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._touch_on_hit = policy == "lru"
        self._entries: OrderedDict[ChunkKey, _Entry] = OrderedDict()  # oldest first
        self._by_slot: dict[int, _Entry] = {}  # every slot in use, listed or discarded
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._num_evictable = 0  # listed READY entries without pins
        self.num_evictions = 0
        self.events: TierEvents | None = None  # told what becomes and stops being READY

    # -- queries (no side effects) -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._entries

    def hit(self, key: ChunkKey) -> CpuHit | None:
        """The entry of ``key`` if a load may use it (READY or STAGING), else None."""
        entry = self._entries.get(key)
        if entry is None or entry.state is SlotState.STORING:
            return None
        staging = entry.staging_job if entry.state is SlotState.STAGING else None
        return CpuHit(key, entry.slot, staging)

    def hits(self, keys: Sequence[ChunkKey]) -> list[CpuHit | None]:
        """Per key of ``keys``, its hit (READY or STAGING) or None (absent), up to the
        first STORING key, excluded: a chunk being stored can be neither loaded nor
        staged. Read-only."""
        out: list[CpuHit | None] = []
        get, storing, staging = self._entries.get, SlotState.STORING, SlotState.STAGING
        for key in keys:
            entry = get(key)
            if entry is None:
                out.append(None)
            elif entry.state is storing:
                break
            else:
                job = entry.staging_job if entry.state is staging else None
                out.append(CpuHit(key, entry.slot, job))
        return out

    def state(self, key: ChunkKey) -> SlotState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    @property
    def num_free(self) -> int:
        """Slots that hold no entry at all."""
        return len(self._free)

    def num_reservable(self, keep: Iterable[CpuHit] = ()) -> int:
        """Slots ``reserve`` could hand out now if the entries of ``keep`` were pinned
        first (free slots plus READY unpinned entries, less those in ``keep``)."""
        kept = {h.slot for h in keep}
        lost = sum(1 for s in kept if self._evictable(self._by_slot.get(s)))
        return len(self._free) + self._num_evictable - lost

    def counts(self) -> dict[str, int]:
        """Entries per state, pinned entries, free slots and discarded slots still
        pinned: what the leak checks read (``testing/engine_state.py``, the soak, the
        scheduler harness and tests); no metric uses it."""
        out = {s.value: 0 for s in SlotState}
        pinned = 0
        for entry in self._entries.values():
            out[entry.state.value] += 1
            pinned += entry.pins > 0
        out["pinned"] = pinned + len(self._by_slot) - len(self._entries)
        out["free"] = len(self._free)
        out["discarded"] = len(self._by_slot) - len(self._entries)
        return out

    # -- mutations -------------------------------------------------------------------------

    def touch(self, keys: Iterable[ChunkKey]) -> None:
        """Mark ``keys`` most recently used (no-op under FIFO or for unknown keys)."""
        if not self._touch_on_hit:
            return
        for key in keys:
            if key in self._entries:
                self._entries.move_to_end(key)

    def pin(self, slots: Iterable[int]) -> None:
        """Protect ``slots`` (and their entries) from reuse; every pin needs one ``unpin``.
        KeyError for a slot that holds no entry (a bug of the caller)."""
        for slot in slots:
            entry = self._by_slot[slot]
            self._num_evictable -= self._evictable(entry)
            entry.pins += 1

    def unpin(self, slots: Iterable[int]) -> None:
        """Release one pin of each slot; a discarded entry frees its slot at its last pin."""
        for slot in slots:
            entry = self._by_slot.get(slot)
            if entry is None or entry.pins == 0:
                continue
            entry.pins -= 1
            if entry.pins == 0 and not entry.listed:
                del self._by_slot[slot]
                self._free.append(slot)
            self._num_evictable += self._evictable(entry)

    def reserve(self, key: ChunkKey, state: SlotState, *, staging_job: int | None = None
                ) -> int | None:
        """Give ``key`` a slot in state STORING or STAGING, pinned once; None if no room.

        Takes a free slot, else evicts the least recently used READY unpinned entry.
        Atomic: on None nothing changed. ``key`` must not be present (KeyError).
        """
        if key in self._entries:
            raise KeyError("chunk already present in the CPU index")
        if state is SlotState.READY:
            raise ValueError("reserve() creates STORING or STAGING entries")
        slot = self._take_slot()
        if slot is None:
            return None
        entry = _Entry(key, slot, state, pins=1, staging_job=staging_job)
        self._entries[key] = entry
        self._by_slot[slot] = entry
        return slot

    def publish(self, slot: int) -> None:
        """Make the reserved entry holding ``slot`` READY (its bytes are complete on
        every rank). No-op when that entry was discarded meanwhile."""
        entry = self._by_slot[slot]
        if not entry.listed or entry.state is SlotState.READY:
            return
        entry.state = SlotState.READY
        entry.staging_job = None
        self._num_evictable += self._evictable(entry)
        if self.events is not None:
            self.events.stored(Tier.CPU, (entry.key,))

    def discard(self, key: ChunkKey) -> None:
        """Remove the entry of ``key`` whatever its state (failed store or load): it is
        invisible at once; its slot is freed now, or at its last unpin if pinned."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._num_evictable -= self._evictable(entry)
        entry.listed = False
        if self.events is not None:
            self.events.removed(Tier.CPU, (key,))
        if entry.pins == 0:
            del self._by_slot[entry.slot]
            self._free.append(entry.slot)

    def discard_slot(self, slot: int) -> None:
        """``discard`` the entry holding ``slot``, if it is still listed."""
        entry = self._by_slot.get(slot)
        if entry is not None and entry.listed:
            self.discard(entry.key)

    def discard_all(self) -> int:
        """``discard`` every entry, pinned or in flight (stores and loads under way
        then publish nothing); returns how many were listed."""
        keys = list(self._entries)
        for key in keys:
            self.discard(key)
        return len(keys)

    def clear_unpinned(self) -> int:
        """Drop every READY unpinned entry; returns how many were dropped."""
        victims = [k for k, e in self._entries.items() if self._evictable(e)]
        for key in victims:
            self.discard(key)
        return len(victims)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for key, entry in self._entries.items():
            if self._evictable(entry):
                self.discard(key)
                self.num_evictions += 1
                return self._free.pop()
        return None

    @staticmethod
    def _evictable(entry: _Entry | None) -> bool:
        return (entry is not None and entry.listed and entry.state is SlotState.READY
                and entry.pins == 0)
