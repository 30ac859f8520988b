"""LoadPlanner: turns a loadable run into a LoadJob, and applies what workers report.

Scheduler thread only. Owns the load records and the loads queued for the next step;
pins CPU slots (and the secondary tiers' places it reads) for a load until every rank
reported it. A chunk staged from a tier is also written to the tiers before it that take
fills (the disk, for a remote chunk): ordinary sinks of the load.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

from kv_offload.counters import SchedulerCounters
from kv_offload.jobs import ChunkMove, LoadJob, Results
from kv_offload.keys import ChunkKey
from kv_offload.scheduler.cpu_index import CpuIndex, SlotState
from kv_offload.scheduler.lookup import Source
from kv_offload.scheduler.records import (
    LoadPhase,
    LoadRecord,
    add_written,
    all_written,
    sink_places,
)
from kv_offload.tier_contract import Place, SecondaryTier


class LoadPlanner:
    """Plans loads and completes them (see the module docstring)."""

    def __init__(self, *, cpu: CpuIndex, tiers: Sequence[SecondaryTier],
                 counters: SchedulerCounters, job_ids: itertools.count, num_ranks: int) -> None:
        self.cpu, self.counters = cpu, counters
        self.tiers = {tier.name: tier for tier in tiers}
        self._order = [tier.name for tier in tiers]
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
        staged chunk gets its CPU slot. Returns each chunk's tier ("cpu", or the
        secondary tier's name; None for a failed move).

        All or nothing: if a step raises, every pin, staging slot and sink place taken so
        far is given back before the exception propagates (the caller fails the load),
        so nothing is held for a job that will never run."""
        with contextlib.ExitStack() as undo:
            for source in run:  # every source pinned before any eviction, the fills' too
                if source.cpu is not None:
                    self.cpu.pin([source.cpu.slot])
                    undo.callback(self.cpu.unpin, [source.cpu.slot])
                elif source.place is not None:
                    tier = self.tiers[source.place.tier]
                    tier.pin([source.place])
                    undo.callback(tier.unpin, [source.place])
            fills = self._fill_places(run)
            undo.callback(self._give_back, [p for places in fills.values() for p in places])
            job_id = next(self._job_ids)
            moves: list[ChunkMove] = []
            chunk_tiers: list[str | None] = []
            for i, chunk_blocks in enumerate(blocks):
                move, tier_name = self._plan_move(run[i] if i < len(run) else None,
                                                  chunk_blocks, job_id, fills, undo)
                moves.append(move)
                chunk_tiers.append(tier_name)
            undo.pop_all()
        # fills of chunks that found no CPU slot, sources of chunks that did not
        self._give_back([p for places in fills.values() for p in places])
        for source, move in zip(run, moves):
            if source.cpu is None and source.place is not None and move.cpu_slot is None:
                self.tiers[source.place.tier].unpin([source.place])
        self.cpu.touch(k for k, m in zip(keys, moves) if m.cpu_slot is not None)
        self.counters.load_errors += chunk_tiers.count(None)
        for name in {t for t in chunk_tiers if t is not None}:
            self.counters.add_per_tier("chunks_loaded", name, chunk_tiers.count(name))
        staged = frozenset(i for i, t in enumerate(chunk_tiers) if t not in (None, "cpu"))
        self.records[job_id] = LoadRecord(tuple(keys), tuple(moves), staged)
        self._pending.append(LoadJob(job_id, req_id, tuple(moves), same_step=same_step))
        return chunk_tiers

    def _plan_move(self, source: Source | None, blocks: tuple[int, ...], job_id: int,
                   fills: dict[ChunkKey, list[Place]], undo: contextlib.ExitStack
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
        assert source.place is not None  # pinned by plan
        sinks = tuple(fills.pop(source.key, ()))
        return ChunkMove(blocks, slot, source.place, sinks), source.place.tier

    def _fill_places(self, run: Sequence[Source]) -> dict[ChunkKey, list[Place]]:
        """Places reserved, in the tiers before a staged chunk's source that take fills,
        for the chunk (key -> places): what is fetched from the remote tier also lands
        on the local disk; a request tail only in tiers that keep tails, noted there
        (``note_tail``) with its parent and tokens."""
        fills: dict[ChunkKey, list[Place]] = {}
        for position, name in enumerate(self._order):
            tier = self.tiers[name]
            if not tier.takes_fills:
                continue
            staged = [s for s in run if s.cpu is None and s.place is not None
                      and self._order.index(s.place.tier) > position
                      and (not s.tail or (tier.keeps_tails and s.tail_of is not None))]
            for source in staged:  # a tail's records go with its commit there
                if source.tail_of is not None:
                    tier.note_tail(source.key, *source.tail_of)
            keys = [s.key for s in staged]
            for key, place in zip(keys, tier.reserve(keys) if keys else ()):
                if place is not None:
                    fills.setdefault(key, []).append(place)
        return fills

    def _give_back(self, places: Sequence[Place]) -> None:
        """Reserved places that will not be written: released as unwritten."""
        for name in {p.tier for p in places}:
            self.tiers[name].release([p for p in places if p.tier == name])

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

    def on_fills(self, job_id: int, by_tier: dict[str, Results]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            add_written(record.fills, by_tier)
            self._advance(job_id, record)

    def on_loaded(self, job_id: int, per_rank: dict[int, frozenset[int]]) -> None:
        record = self.records.get(job_id)
        if record is not None:
            record.failed_by_rank.update(per_rank)
            self._advance(job_id, record)

    def _advance(self, job_id: int, record: LoadRecord) -> None:
        """LOADING -> FILLING once every rank reported the load (it is applied); the
        record goes once the fills (chunks also written to earlier tiers) are in."""
        if len(record.failed_by_rank) < self.num_ranks:
            return
        if record.phase is LoadPhase.LOADING:
            record.phase = LoadPhase.FILLING
            self._apply(record, frozenset().union(*record.failed_by_rank.values()))
        sinks = record.sink_tiers
        if not all_written(record.fills, sinks, self.num_ranks):
            return
        del self.records[job_id]
        if sinks:
            self.cpu.unpin(record.fill_pinned)
        for name in sinks:
            self.tiers[name].written(record.keys, sink_places(record.moves, name),
                                     record.fills[name], frozenset(record.bad_reads))

    def _apply(self, record: LoadRecord, failed: frozenset[int]) -> None:
        """Release what a load held once every rank reported it.

        A staged chunk whose read succeeded on every rank holds the chunk's bytes, also
        when this job failed it (its engine copy raised, or it timed out): it is
        published, so the jobs that wait on the read (``after_job``) copy valid bytes.
        One whose read failed on a rank is discarded (and its disk entry dropped); its
        slot stays reserved while other jobs pin it, and those jobs fail it too. Pins
        are released per slot; a chunk still being written to a fill keeps its pin
        until then.
        """
        self.counters.load_errors += len(failed)
        for i, (key, move) in enumerate(zip(record.keys, record.moves)):
            if move.cpu_slot is None:
                continue
            if i in record.staged and move.source is not None:
                source = self.tiers[move.source.tier]
                source.unpin([move.source])
                if i in record.bad_reads:
                    self.cpu.discard_slot(move.cpu_slot)
                    source.drop(move.source, key)
                else:
                    self.cpu.publish(move.cpu_slot)
                if move.sinks:
                    record.fill_pinned.add(move.cpu_slot)
                    continue
            self.cpu.unpin([move.cpu_slot])
