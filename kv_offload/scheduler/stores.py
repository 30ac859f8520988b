"""StorePlanner: reserves CPU (and disk) slots for completed chunks, and publishes,
commits and releases them as workers report their copies and writes.

Scheduler thread only. A chunk is visible to lookups only once every rank copied it
(invariant 1); its slot stays pinned while disk or remote writes read it (invariant 2).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

from kv_offload.counters import SchedulerCounters
from kv_offload.jobs import ChunkMove, StoreJob
from kv_offload.keys import ChunkKey
from kv_offload.scheduler.cpu_index import CpuIndex, SlotState
from kv_offload.scheduler.disk_tier import DiskTier
from kv_offload.scheduler.events import Tier, TierEvents
from kv_offload.scheduler.records import StorePhase, StoreRecord


class StorePlanner:
    """Plans stores and completes them (see the module docstring)."""

    def __init__(self, *, cpu: CpuIndex, disk: DiskTier, counters: SchedulerCounters,
                 job_ids: itertools.count, num_ranks: int, with_remote: bool) -> None:
        self.cpu, self.disk, self.counters = cpu, disk, counters
        self.num_ranks = num_ranks
        self.with_remote = with_remote
        self.records: dict[int, StoreRecord] = {}
        self._job_ids = job_ids
        self.events: TierEvents | None = None  # told which chunks the remote tier holds

    def plan(self, chunks: Sequence[tuple[ChunkKey, tuple[int, ...], str]], *,
             tail: bool = False) -> StoreJob | None:
        """One StoreJob for ``chunks`` (key, engine blocks, request), each key once; a
        chunk that finds no CPU slot is skipped (counted). None when none found a slot.
        ``tail``: request tails (``tails.py``), kept in the CPU and disk tiers (the remote
        tier has no index of tails: it keeps whole chunks only).
        All or nothing: if a step raises, the slots reserved so far are given back
        before the exception propagates (no chunk is left STORING for a job that never
        runs)."""
        unique: dict[ChunkKey, tuple[tuple[int, ...], str]] = {}
        for key, blocks, req_id in chunks:
            unique.setdefault(key, (blocks, req_id))
        keys, slots, moves, req_ids = [], [], [], []
        with contextlib.ExitStack() as undo:
            reserved: list[tuple[ChunkKey, tuple[int, ...], str, int]] = []
            for key, (blocks, req_id) in unique.items():
                evictions = self.cpu.num_evictions
                slot = self.cpu.reserve(key, SlotState.STORING)
                self.counters.evictions_cpu += self.cpu.num_evictions - evictions
                if slot is None:
                    self.counters.skipped_stores += 1
                    continue
                undo.callback(self.cpu.unpin, [slot])  # runs second: frees the slot
                undo.callback(self.cpu.discard_slot, slot)
                reserved.append((key, blocks, req_id, slot))
            # Disk slots only for chunks that got a CPU slot: each may evict a disk entry.
            disk_slots = self.disk.allocate([key for key, *_ in reserved])
            undo.callback(self.disk.release, [s for s in disk_slots if s is not None])
            for (key, blocks, req_id, slot), disk_slot in zip(reserved, disk_slots):
                keys.append(key)
                slots.append(slot)
                req_ids.append(req_id)
                moves.append(ChunkMove(blocks, slot, disk_slot,
                                       remote_key=key if self.with_remote and not tail
                                       else None))
            undo.pop_all()
        if not moves:
            return None
        job_id = next(self._job_ids)
        self.records[job_id] = StoreRecord(tuple(keys), tuple(slots), tuple(moves), tail=tail)
        return StoreJob(job_id, tuple(moves), tuple(req_ids), audited=not tail)

    def on_copied(self, job_id: int, num_ranks: int, num_failed: int = 0) -> bool:
        """``num_ranks`` more ranks finished the job's engine -> host copy, ``num_failed``
        of them with an error; once all did, True is returned and its chunks are
        published (COPYING -> WRITING), or discarded if any rank's copy failed."""
        record = self.records.get(job_id)
        if record is None:
            return False
        record.ranks_copied += num_ranks
        record.copy_failed = record.copy_failed or num_failed > 0
        if record.ranks_copied < self.num_ranks or record.phase is not StorePhase.COPYING:
            return False
        record.phase = StorePhase.WRITING
        if record.copy_failed:  # the slots hold no chunk: never visible
            self.counters.skipped_stores += len(record.keys)
            for slot, move in zip(record.slots, record.moves):
                self.cpu.discard_slot(slot)
                if move.disk_slot is None and move.remote_key is None:
                    self.cpu.unpin([slot])
            self._maybe_finish(job_id, record)
            return True
        self.counters.chunks_stored_cpu += len(record.keys)
        self.counters.tails_stored += len(record.keys) if record.tail else 0
        for slot, move in zip(record.slots, record.moves):
            self.cpu.publish(slot)
            if move.disk_slot is None and move.remote_key is None:
                self.cpu.unpin([slot])
        self._maybe_finish(job_id, record)
        return True

    def on_disk_written(self, job_id: int, per_rank: dict[int, tuple[int | None, ...]]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            record.disk_sums_by_rank.update(per_rank)
            self._maybe_finish(job_id, record)

    def on_remote_written(self, job_id: int, per_rank: dict[int, tuple[bool, ...]]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            record.remote_ok_by_rank.update(per_rank)
            self._maybe_finish(job_id, record)

    def _maybe_finish(self, job_id: int, record: StoreRecord) -> None:
        """Once every rank copied, wrote the disk and wrote the remote tier: release the
        CPU pins held for those writes, commit the disk slots that all ranks wrote."""
        ranks = self.num_ranks
        if (record.phase is not StorePhase.WRITING
                or (record.has_disk and len(record.disk_sums_by_rank) < ranks)
                or (record.has_remote and len(record.remote_ok_by_rank) < ranks)):
            return
        del self.records[job_id]
        self.cpu.unpin(slot for slot, m in zip(record.slots, record.moves)
                       if m.disk_slot is not None or m.remote_key is not None)
        if record.has_remote:
            per_rank = list(record.remote_ok_by_rank.values())
            written = [k for i, (k, m) in enumerate(zip(record.keys, record.moves))
                       if m.remote_key is not None and all(r[i] for r in per_rank)]
            self.counters.chunks_stored_remote += len(written)
            if self.events is not None and self.with_remote:  # off after reset_all
                self.events.stored(Tier.REMOTE, written)
        if record.has_disk:
            self.counters.chunks_stored_disk += self.disk.commit_written(
                record.keys, [m.disk_slot for m in record.moves], record.disk_sums_by_rank)
