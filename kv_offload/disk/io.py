"""DiskIO: the disk tier's worker half, one rank's reads and writes of its slab file.

Reads run on the worker's read lane, writes on its write lane once the engine copy that
fills their host slots has ended (``worker/stores.py``). A store job's chunks go out in
tasks of up to ``WRITE_TASK_BYTES`` (``write_batch`` chunks), each one
``SlabFile.write_many``: small chunks in few system calls, a large job still spread over
the lane's threads. When a task's write fails, each of its chunks is written alone to
learn which failed (a full disk may still take some). A failed read is a miss and a
failed write a skipped store, never an error for vLLM: ``DiskHealth`` accounts them
(``take_broken`` once the disk keeps failing) and they are counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kv_offload.counters import WorkerCounters
from kv_offload.disk.health import DiskHealth
from kv_offload.tier_contract import Address, Place

if TYPE_CHECKING:
    from kv_offload.disk.slab import ReadResult, SlabFile

NAME = "disk"
WRITE_TASK_BYTES = 8 << 20


class DiskIO:
    """One rank's slab reads and writes (``tier_contract.TierIO``); thread-safe."""

    name = NAME

    def __init__(self, slab: SlabFile, *, slot_bytes: int, rank: int = 0,
                 verify_checksums: bool = True) -> None:
        self.slab = slab
        self.rank = rank
        self.verify_checksums = verify_checksums
        self.health = DiskHealth(rank)
        self.write_batch = max(1, WRITE_TASK_BYTES // slot_bytes)
        self._count: Callable[[Any], None] = lambda deltas: None
        self._clock: Callable[[], float] = lambda: 0.0

    def bind(self, count: Callable[[Any], None], clock: Callable[[], float]) -> None:
        self._count, self._clock = count, clock

    def read(self, place: Place, out: memoryview) -> bool:
        """Read the slab slot ``place.address`` into ``out``, verified against this
        rank's checksum; whether ``out`` holds it."""
        if place.checksums is None or not isinstance(place.address, int):
            return False
        start = self._clock()
        result: ReadResult | Exception
        try:
            expected = place.checksums[self.rank] if self.verify_checksums else None
            result = self.slab.read(place.address, out, expected)
        except Exception as exc:  # any I/O failure is a miss; vLLM recomputes
            result = exc
        self._count(WorkerCounters(bytes_disk_read=len(out),
                                   seconds_disk_read=self._clock() - start))
        if isinstance(result, Exception) or not result:
            self._count(self.health.read_failed(place.address, result))
            return False
        self.health.read_ok()
        return True

    def write(self, addresses: Sequence[Address], views: Sequence[memoryview]
              ) -> list[object | None]:
        """Write ``views`` to the slab slots ``addresses``; each chunk's checksum, or None
        when it was not written. Never raises."""
        slots = [int(a) for a in addresses]
        if len(slots) == 1:  # a failure would only write it again
            return [self._write_one(slots[0], views[0])]
        start = self._clock()
        try:
            sums = self.slab.write_many(slots, list(views))
        except Exception:  # which chunk failed: one at a time
            return [self._write_one(s, v) for s, v in zip(slots, views)]
        self._count(WorkerCounters(bytes_disk_write=sum(len(v) for v in views),
                                   seconds_disk_write=self._clock() - start))
        self.health.write_ok()
        return list(sums)

    def _write_one(self, slot: int, view: memoryview) -> int | None:
        """Write one view to a slab slot; its checksum, or None if it failed. Any
        exception is a failed store: a full disk (ENOSPC) only for this chunk, any other
        error also counts towards DISK_BROKEN_AFTER."""
        try:
            start = self._clock()
            checksum = self.slab.write(slot, view)
        except Exception as exc:  # OSError, StorePathError (directory re-creation)...
            self.health.write_failed(exc)
            self._count(WorkerCounters(disk_write_errors=1))
            return None
        self._count(WorkerCounters(bytes_disk_write=len(view),
                                   seconds_disk_write=self._clock() - start))
        self.health.write_ok()
        return checksum

    def take_broken(self) -> str | None:
        return self.health.take_broken()

    def close(self) -> None:
        self.slab.close()
