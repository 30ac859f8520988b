"""StorePlanner: reserves CPU slots (and places in the secondary tiers) for completed
chunks, and publishes, commits and releases them as workers report their copies and
writes.

Scheduler thread only. A chunk is visible to lookups only once every rank copied it
(invariant 1); its slot stays pinned while the secondary tiers' writes read it
(invariant 2).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

from kv_offload.counters import SchedulerCounters
from kv_offload.jobs import ChunkMove, Results, StoreJob
from kv_offload.keys import ChunkKey
from kv_offload.scheduler.cpu_index import CpuIndex, SlotState
from kv_offload.scheduler.records import (
    StorePhase,
    StoreRecord,
    add_written,
    all_written,
    sink_places,
)
from kv_offload.tier_contract import Place, SecondaryTier


class StorePlanner:
    """Plans stores and completes them (see the module docstring)."""

    def __init__(self, *, cpu: CpuIndex, tiers: Sequence[SecondaryTier],
                 counters: SchedulerCounters, job_ids: itertools.count, num_ranks: int
                 ) -> None:
        self.cpu, self.counters = cpu, counters
        self.tiers = {tier.name: tier for tier in tiers}
        self.num_ranks = num_ranks
        self.records: dict[int, StoreRecord] = {}
        self._job_ids = job_ids

    def plan(self, chunks: Sequence[tuple[ChunkKey, tuple[int, ...], str]], *,
             tail: bool = False) -> StoreJob | None:
        """One StoreJob for ``chunks`` (key, engine blocks, request), each key once; a
        chunk that finds no CPU slot is skipped (counted). None when none found a slot.
        ``tail``: request tails (``tails.py``), kept in the CPU tier and the tiers that
        keep tails (``keeps_tails``).
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
            # Places only for chunks that got a CPU slot: each may evict a tier's entry.
            sinks: list[tuple[Place, ...]] = [()] * len(reserved)
            for tier in self.tiers.values():
                if tail and not tier.keeps_tails:
                    continue
                places = tier.reserve([key for key, *_ in reserved]) if reserved else []
                taken = [p for p in places if p is not None]
                undo.callback(tier.release, taken)
                sinks = [(*s, p) if p is not None else s for s, p in zip(sinks, places)]
            for (key, blocks, req_id, slot), chunk_sinks in zip(reserved, sinks):
                keys.append(key)
                slots.append(slot)
                req_ids.append(req_id)
                moves.append(ChunkMove(blocks, slot, sinks=chunk_sinks))
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
                if not move.sinks:
                    self.cpu.unpin([slot])
            self._maybe_finish(job_id, record)
            return True
        self.counters.chunks_stored_cpu += len(record.keys)
        self.counters.tails_stored += len(record.keys) if record.tail else 0
        for slot, move in zip(record.slots, record.moves):
            self.cpu.publish(slot)
            if not move.sinks:
                self.cpu.unpin([slot])
        self._maybe_finish(job_id, record)
        return True

    def on_written(self, job_id: int, by_tier: dict[str, Results]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            add_written(record.written, by_tier)
            self._maybe_finish(job_id, record)

    def _maybe_finish(self, job_id: int, record: StoreRecord) -> None:
        """Once every rank copied and wrote every sink: release the CPU pins held for
        those writes, and have each tier commit what all ranks wrote (a failed copy
        wrote nothing: its places are given back)."""
        sinks = record.sink_tiers
        if (record.phase is not StorePhase.WRITING
                or not all_written(record.written, sinks, self.num_ranks)):
            return
        del self.records[job_id]
        self.cpu.unpin(slot for slot, m in zip(record.slots, record.moves) if m.sinks)
        for name in sinks:
            self.tiers[name].written(record.keys, sink_places(record.moves, name),
                                     record.written[name])
