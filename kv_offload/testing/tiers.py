"""The built-in secondary tiers wired as the connector wires them, for tests and tools
that build a planner or a worker by hand (``OffloadScheduler(tiers=...)``,
``OffloadWorker(tiers=...)``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kv_offload.disk.io import DiskIO
from kv_offload.disk.tier import DiskTier
from kv_offload.remote.index import RemoteIndex
from kv_offload.remote.io import RemoteIO

T = TypeVar("T")


def secondary_tiers(disk_index: Any = None, remote: Any = None) -> list[Any]:
    """The scheduler halves: the disk tier over ``disk_index``, then the remote tier over
    ``remote`` (a ``remote.RemoteTier``), each where given."""
    tiers: list[Any] = []
    if disk_index is not None:
        tiers.append(DiskTier(disk_index))
    if remote is not None:
        tiers.append(RemoteIndex(remote))
    return tiers


def tier_ios(slab: Any = None, remote: Any = None, *, slot_bytes: int, rank: int = 0,
             verify_checksums: bool = True) -> list[Any]:
    """One rank's worker halves: the disk tier over ``slab``, then the remote tier over
    ``remote``, each where given."""
    tiers: list[Any] = []
    if slab is not None:
        tiers.append(DiskIO(slab, slot_bytes=slot_bytes, rank=rank,
                            verify_checksums=verify_checksums))
    if remote is not None:
        tiers.append(RemoteIO(remote, rank=rank, verify_checksums=verify_checksums))
    return tiers


def written_to(report: Any, tier: str) -> dict[int, Any]:
    """A ``WorkerReport``'s results of writes to ``tier``: job -> rank -> per chunk."""
    return {job: by_tier[tier] for job, by_tier in report.written.items() if tier in by_tier}


def place_in(move: Any, tier: str) -> Any:
    """Where ``move`` reads ``tier`` (its source) or, else, writes it (a sink); None."""
    if move.source is not None and move.source.tier == tier:
        return move.source
    return next((p for p in move.sinks if p.tier == tier), None)


def fill_of(move: Any, tier: str = "disk") -> Any:
    """The sink in ``tier`` of a load's move (a fill), or None."""
    return next((p for p in move.sinks if p.tier == tier), None)


def key_in(move: Any) -> Any:
    """The remote key ``move`` reads or writes, or None."""
    place = place_in(move, "remote")
    return None if place is None else place.address


def until_answered(ask: Callable[[], T | None], what: str) -> tuple[T, int]:
    """(the answer of ``ask``, how many times it was pending first), asked as vLLM's
    steps do while a tier's answer is pending; ``what`` names it if it never comes."""
    deadline = time.monotonic() + 30  # bounds a hang only
    pending = 0
    while (answer := ask()) is None:
        pending += 1
        assert time.monotonic() < deadline, f"{what} never answered"
        time.sleep(0.001)
    return answer, pending
