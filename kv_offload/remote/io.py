"""RemoteIO: the remote tier's worker half (``tier_contract.TierIO``), one rank's reads
and writes of its part of each chunk.

A read that fails is a miss (vLLM recomputes the chunk), never an error: misses are
counted and logged the first time and every 1000th; errors are counted and logged once
per burst by ``RemoteHealth``. A write that fails, or that the tier skips while it backs
off, is a skipped store.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kv_offload.counters import WorkerCounters
from kv_offload.remote.values import ValueCheck
from kv_offload.tier_contract import Address, Place

logger = logging.getLogger(__name__)
NAME = "remote"


class RemoteIO:
    """One rank's reads and writes of a ``remote.RemoteTier``; thread-safe."""

    name = NAME
    write_batch = 1  # one SET per chunk

    def __init__(self, remote: Any, *, rank: int = 0, verify_checksums: bool = True) -> None:
        self.remote = remote
        self.rank = rank
        self.verify_checksums = verify_checksums
        self._count: Callable[[Any], None] = lambda deltas: None
        self._clock: Callable[[], float] = lambda: 0.0
        self._lock = threading.Lock()
        self._misses = 0

    def bind(self, count: Callable[[Any], None], clock: Callable[[], float]) -> None:
        self._count, self._clock = count, clock

    def read(self, place: Place, out: memoryview) -> bool:
        if not isinstance(place.address, bytes):
            return False
        start = self._clock()
        result = self.remote.read_into(place.address, self.rank, out,
                                       verify_checksum=self.verify_checksums)
        if result is ValueCheck.OK:
            self._count(WorkerCounters(bytes_remote_read=len(out),
                                       seconds_remote_read=self._clock() - start))
            return True
        if isinstance(result, Exception):
            self._count(WorkerCounters(remote_errors=1))  # logged once per burst by RemoteHealth
            return False
        self._count(WorkerCounters(remote_misses=1))
        with self._lock:
            self._misses += 1
            misses = self._misses
        if misses == 1 or misses % 1000 == 0:
            logger.warning(
                "kv-offload: remote chunk unusable (%s: evicted since the lookup, or "
                "written by another format or layout); its tokens are recomputed "
                "(%d so far)", result.value, misses)
        return False

    def write(self, addresses: Sequence[Address], views: Sequence[memoryview]
              ) -> list[object | None]:
        """Write each chunk; True, or None when it failed or the tier is backing off (a
        skipped store, counted)."""
        out: list[object | None] = []
        for key, view in zip(addresses, views):
            start = self._clock()
            if not isinstance(key, bytes) or not self.remote.write(key, self.rank, view):
                self._count(WorkerCounters(remote_skipped_stores=1))
                out.append(None)
                continue
            self._count(WorkerCounters(bytes_remote_write=len(view),
                                       seconds_remote_write=self._clock() - start))
            out.append(True)
        return out

    def take_broken(self) -> str | None:
        return None  # a server that keeps failing backs off (RemoteHealth); never off

    def close(self) -> None:
        self.remote.close()
