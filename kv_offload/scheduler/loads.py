"""LoadPlanner: turns a loadable run into a LoadJob, and applies what workers report.

Scheduler thread only. Owns the load records and the loads queued for the next step;
pins CPU slots (and disk slots) for a load until every rank reported it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

from kv_offload.counters import SchedulerCounters
from kv_offload.jobs import ChunkMove, LoadJob
from kv_offload.keys import ChunkKey
from kv_offload.scheduler.cpu_index import CpuIndex, SlotState
from kv_offload.scheduler.disk_tier import DiskTier
from kv_offload.scheduler.lookup import Source
from kv_offload.scheduler.records import LoadPhase, LoadRecord


class LoadPlanner:
    """Plans loads and completes them (see the module docstring)."""

    def __init__(self, *, cpu: CpuIndex, disk: DiskTier, counters: SchedulerCounters,
                 job_ids: itertools.count, num_ranks: int) -> None:
        self.cpu, self.disk, self.counters = cpu, disk, counters
        self.num_ranks = num_ranks
        self.records: dict[int, LoadRecord] = {}
        self._job_ids = job_ids
        self._pending: list[LoadJob] = []

    # -- planning --------------------------------------------------------------------------

    def plan(self, req_id: str, keys: Sequence[ChunkKey], run: Sequence[Source],
             blocks: Sequence[tuple[int, ...]], *, same_step: bool = False
             ) -> list[str | None]:
        """Queue a LoadJob of ``keys`` (engine blocks ``blocks`` per chunk) from the
        sources of ``run`` (a prefix of ``keys``; the chunks past it vanished since the
        lookup and become failed moves, so vLLM recomputes them). Pins every source; a
        staged chunk gets its CPU slot. Returns each chunk's tier ("cpu", "disk",
        "remote"; None for a failed move).

        All or nothing: if a step raises, every pin, staging slot and disk slot taken so
        far is given back before the exception propagates (the caller fails the load),
        so nothing is held for a job that will never run."""
        with contextlib.ExitStack() as undo:
            for source in run:  # every source pinned before any eviction, the fills' too
                if source.cpu is not None:
                    self.cpu.pin([source.cpu.slot])
                    undo.callback(self.cpu.unpin, [source.cpu.slot])
                elif source.disk is not None:
                    self.disk.pin([source.disk.slot])
                    undo.callback(self.disk.unpin, [source.disk.slot])
            fills = self._fill_slots([s.key for s in run if s.remote])
            undo.callback(self.disk.release, list(fills.values()))
            job_id = next(self._job_ids)
            moves: list[ChunkMove] = []
            chunk_tiers: list[str | None] = []
            for i, chunk_blocks in enumerate(blocks):
                move, tier = self._plan_move(run[i] if i < len(run) else None, chunk_blocks,
                                             job_id, fills, undo)
                moves.append(move)
                chunk_tiers.append(tier)
            undo.pop_all()
        self.disk.release(list(fills.values()))  # fills of chunks that found no CPU slot
        self.disk.unpin([s.disk.slot for s, m in zip(run, moves)  # disk chunks that did not
                         if s.cpu is None and s.disk is not None and m.cpu_slot is None])
        self.cpu.touch(k for k, m in zip(keys, moves) if m.cpu_slot is not None)
        self.counters.load_errors += chunk_tiers.count(None)
        self.counters.chunks_loaded_cpu += chunk_tiers.count("cpu")
        self.counters.chunks_loaded_disk += chunk_tiers.count("disk")
        self.counters.chunks_loaded_remote += chunk_tiers.count("remote")
        staged = frozenset(i for i, t in enumerate(chunk_tiers) if t in ("disk", "remote"))
        self.records[job_id] = LoadRecord(tuple(keys), tuple(moves), staged)
        self._pending.append(LoadJob(job_id, req_id, tuple(moves), same_step=same_step))
        return chunk_tiers

    def _plan_move(self, source: Source | None, blocks: tuple[int, ...], job_id: int,
                   fills: dict[ChunkKey, int], undo: contextlib.ExitStack
                   ) -> tuple[ChunkMove, str | None]:
        """The move of one chunk and its tier (None: a failed move); what it takes is
        registered on ``undo``."""
        if source is None:  # vanished since the lookup
            return ChunkMove(blocks, None), None
        if source.cpu is not None:
            return ChunkMove(blocks, source.cpu.slot, after_job=source.cpu.staging_job), "cpu"
        slot = self.cpu.reserve(source.key, SlotState.STAGING, staging_job=job_id)
        if slot is None:  # cannot happen: the lookup counted the slots
            return ChunkMove(blocks, None), None
        undo.callback(self.cpu.unpin, [slot])  # runs second: frees the discarded slot
        undo.callback(self.cpu.discard_slot, slot)
        if source.disk is not None:  # pinned by plan
            return ChunkMove(blocks, slot, source.disk.slot, tuple(source.disk.checksums)), "disk"
        return ChunkMove(blocks, slot, remote_key=source.key,
                         fill_disk_slot=fills.pop(source.key, None)), "remote"

    def _fill_slots(self, keys: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
        """Disk slots reserved for the remote chunks ``keys`` (key -> slot), so that
        what is fetched from the remote tier also lands on the local disk."""
        slots = self.disk.allocate(keys)
        return {k: s for k, s in zip(keys, slots) if s is not None}

    def fail(self, req_id: str, blocks: tuple[int, ...], *, same_step: bool = False) -> None:
        """Queue a load of ``blocks`` that fails at once (the workers report them as load
        errors, vLLM recomputes them). Holds no pin and no record."""
        self.counters.load_errors += 1
        self._pending.append(LoadJob(next(self._job_ids), req_id, (ChunkMove(blocks, None),),
                                     same_step=same_step))

    def take_pending(self) -> tuple[LoadJob, ...]:
        """Hand out the queued loads."""
        loads, self._pending = tuple(self._pending), []
        return loads

    def has_pending(self) -> bool:
        return bool(self.records or self._pending)

    # -- completion ------------------------------------------------------------------------

    def on_bad_reads(self, job_id: int, per_rank: dict[int, frozenset[int]]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            record.bad_reads.update(*per_rank.values())

    def on_fills(self, job_id: int, per_rank: dict[int, tuple[int | None, ...]]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            record.fill_sums_by_rank.update(per_rank)
            self._advance(job_id, record)

    def on_loaded(self, job_id: int, per_rank: dict[int, frozenset[int]]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            record.failed_by_rank.update(per_rank)
            self._advance(job_id, record)

    def _advance(self, job_id: int, record: LoadRecord) -> None:
        """LOADING -> FILLING once every rank reported the load (it is applied); the
        record goes once the disk fills (remote chunks also written locally) are in."""
        if len(record.failed_by_rank) < self.num_ranks:
            return
        if record.phase is LoadPhase.LOADING:
            record.phase = LoadPhase.FILLING
            self._apply(record, frozenset().union(*record.failed_by_rank.values()))
        if record.has_fills and len(record.fill_sums_by_rank) < self.num_ranks:
            return
        del self.records[job_id]
        if record.has_fills:
            self.cpu.unpin(record.fill_pinned)
            self.counters.chunks_stored_disk += self.disk.commit_written(
                record.keys, [m.fill_disk_slot for m in record.moves],
                record.fill_sums_by_rank, record.bad_reads)

    def _apply(self, record: LoadRecord, failed: frozenset[int]) -> None:
        """Release what a load held once every rank reported it.

        A staged chunk whose read succeeded on every rank holds the chunk's bytes, also
        when this job failed it (its engine copy raised, or it timed out): it is
        published, so the jobs that wait on the read (``after_job``) copy valid bytes.
        One whose read failed on a rank is discarded (and its disk entry dropped); its
        slot stays reserved while other jobs pin it, and those jobs fail it too. Pins
        are released per slot; a chunk still being written to the disk keeps its pin
        until then.
        """
        self.counters.load_errors += len(failed)
        for i, (key, move) in enumerate(zip(record.keys, record.moves)):
            if move.cpu_slot is None:
                continue
            if i in record.staged:
                if move.disk_slot is not None:
                    self.disk.unpin([move.disk_slot])
                if i in record.bad_reads:
                    self.cpu.discard_slot(move.cpu_slot)
                    if move.disk_slot is not None:
                        self.disk.drop(key, move.disk_slot)
                else:
                    self.cpu.publish(move.cpu_slot)
                if move.fill_disk_slot is not None:
                    record.fill_pinned.add(move.cpu_slot)
                    continue
            self.cpu.unpin([move.cpu_slot])
