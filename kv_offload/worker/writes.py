"""SlabWrites: one rank's writes of stored chunks from their host slots to its slab file.

Runs on the worker's write lane, queued once the engine copy that fills the host slots
has ended (``worker/stores.py``). A store job's chunks go out in tasks of up to
``WRITE_TASK_BYTES``, each one ``SlabFile.write_many``: small chunks in few system calls,
a large job still spread over the lane's threads. When a task's write fails, each of its chunks is written alone to learn
which failed (a full disk may still take some). A failed write is a skipped store, never
an error for vLLM: ``DiskHealth`` accounts it and it is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_offload.counters import WorkerCounters
from kv_offload.worker.disk_health import DiskHealth

if TYPE_CHECKING:
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.disk.slab import SlabFile

WRITE_TASK_BYTES = 8 << 20


class SlabWrites:
    """Writes host slots to slab slots for one rank. ``count(deltas)`` adds to the
    worker's counters (``kv_offload.counters.WorkerCounters``); thread-safe."""

    def __init__(self, *, host: HostSlots, slab: SlabFile, disk: DiskHealth,
                 count: Callable[[WorkerCounters], None], clock: Callable[[], float]
                 ) -> None:
        self.host = host
        self.slab = slab
        self._disk = disk
        self._count = count
        self._clock = clock

    def chunks_per_task(self) -> int:
        return max(1, WRITE_TASK_BYTES // self.host.slot_bytes)

    def write_chunks(self, pairs: list[tuple[int, int]]) -> list[int | None]:
        """Write (host slot, disk slot) ``pairs`` whose engine copy has ended; each chunk's
        checksum, or None when it was not written. Never raises."""
        if len(pairs) == 1:  # a failure would only write it again
            return [self.write(*pairs[0])]
        start = self._clock()
        try:
            sums = self.slab.write_many([d for _, d in pairs],
                                        [self.host.slot_view(c) for c, _ in pairs])
        except Exception:  # which chunk failed: one at a time
            return [self.write(c, d) for c, d in pairs]
        self._count(WorkerCounters(bytes_disk_write=len(pairs) * self.host.slot_bytes,
                                   seconds_disk_write=self._clock() - start))
        self._disk.write_ok()
        return list(sums)

    def write(self, cpu_slot: int, disk_slot: int) -> int | None:
        """Write one host slot to a slab slot; its checksum, or None if it failed. Any
        exception is a failed store: a full disk (ENOSPC) only for this chunk, any other
        error also counts towards DISK_BROKEN_AFTER."""
        try:
            view = self.host.slot_view(cpu_slot)
            start = self._clock()
            checksum = self.slab.write(disk_slot, view)
        except Exception as exc:  # OSError, StorePathError (directory re-creation)...
            self._disk.write_failed(exc)
            self._count(WorkerCounters(disk_write_errors=1))
            return None
        self._count(WorkerCounters(bytes_disk_write=len(view),
                                   seconds_disk_write=self._clock() - start))
        self._disk.write_ok()
        return checksum
