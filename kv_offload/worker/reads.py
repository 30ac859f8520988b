"""TierReads: one rank's reads of a chunk from the disk or remote tier into its host slot.

Runs on the worker's I/O threads. A read that fails for any reason is a miss (vLLM
recomputes the chunk), never an error: disk failures go to ``DiskHealth``, remote misses
are counted and logged the first time and every 1000th.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from kv_offload.counters import WorkerCounters
from kv_offload.jobs import ChunkMove
from kv_offload.remote.values import ValueCheck
from kv_offload.worker.disk_health import DiskHealth

if TYPE_CHECKING:
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.disk.slab import ReadResult, SlabFile
    from kv_offload.remote.tier import RemoteTier

logger = logging.getLogger(__name__)


class TierReads:
    """Reads chunks into host slots for one rank. ``count(deltas)`` adds to the worker's
    counters (``kv_offload.counters.WorkerCounters``); thread-safe."""

    def __init__(self, *, rank: int, host: HostSlots, slab: SlabFile | None,
                 remote: RemoteTier | None, verify_checksums: bool, disk: DiskHealth,
                 count: Callable[[WorkerCounters], None], clock: Callable[[], float]
                 ) -> None:
        self.rank = rank
        self.host = host
        self.slab = slab
        self.remote = remote
        self.verify_checksums = verify_checksums
        self._disk = disk
        self._count = count
        self._clock = clock
        self._lock = threading.Lock()
        self._remote_misses = 0

    def read(self, move: ChunkMove) -> bool:
        """Read ``move``'s chunk from its disk slot, else its remote key, into its host
        slot; whether the slot now holds the verified chunk."""
        if move.disk_slot is not None:
            return self._read_disk(move)
        return self._read_remote(move)

    def _read_disk(self, move: ChunkMove) -> bool:
        if (self.slab is None or move.checksums is None or move.cpu_slot is None
                or move.disk_slot is None):
            return False
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        result: ReadResult | Exception
        try:
            expected = move.checksums[self.rank] if self.verify_checksums else None
            result = self.slab.read(move.disk_slot, view, expected)
        except Exception as exc:  # any I/O failure is a miss; vLLM recomputes
            result = exc
        self._count(WorkerCounters(bytes_disk_read=len(view),
                                   seconds_disk_read=self._clock() - start))
        if isinstance(result, Exception) or not result:
            self._count(self._disk.read_failed(move.disk_slot, result))
            return False
        self._disk.read_ok()
        return True

    def _read_remote(self, move: ChunkMove) -> bool:
        if self.remote is None or move.cpu_slot is None or move.remote_key is None:
            return False
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        result = self.remote.read_into(move.remote_key, self.rank, view,
                                       verify_checksum=self.verify_checksums)
        if result is ValueCheck.OK:
            self._count(WorkerCounters(bytes_remote_read=len(view),
                                       seconds_remote_read=self._clock() - start))
            return True
        if isinstance(result, Exception):
            self._count(WorkerCounters(remote_errors=1))  # logged once per burst by RemoteHealth
            return False
        self._count(WorkerCounters(remote_misses=1))
        with self._lock:
            self._remote_misses += 1
            misses = self._remote_misses
        if misses == 1 or misses % 1000 == 0:
            logger.warning(
                "kv-offload: remote chunk unusable (%s: evicted since the lookup, or "
                "written by another format or layout); its tokens are recomputed "
                "(%d so far)", result.value, misses)
        return False
