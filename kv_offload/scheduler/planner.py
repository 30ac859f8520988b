"""OffloadScheduler: the scheduler-side brain (lookups, load and store planning, pins).

Pure logic: imports neither torch nor vLLM (the remote tier is injected). It sees
requests through a small protocol
(``request_id``, ``block_hashes``, ``num_tokens``, ``num_prompt_tokens``) and engine
block ids through an injected callable, so it is unit-tested with fakes.

A disk index that fails (``StoreError``: a full or read-only file system under the
index, a corrupted environment) turns the disk tier off for the rest of the run, with
one error line; serving goes on from the CPU tier. It never escapes into vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from kv_offload.disk.errors import StoreError
from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob, StepPlan, StoreJob, WorkerReport
from kv_offload.keys import ChunkKey, chunk_keys
from kv_offload.scheduler.counters import SchedulerCounters
from kv_offload.scheduler.cpu_index import CpuHit, CpuIndex, SlotState

logger = logging.getLogger(__name__)

ACCESS_FLUSH_INTERVAL_S = 2.0


class RequestLike(Protocol):
    request_id: str
    block_hashes: Sequence[bytes]

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(slots=True)
class _Request:
    request: Any
    next_store_chunk: int = 0
    lookup: tuple[int, int] | None = None  # (num_computed_tokens, hit tokens) memo
    remote: tuple[int, int, frozenset] | None = None  # (first chunk, num keys, hit keys) memo
    disk_outcome: tuple[int, int] = (0, 0)  # (hits, misses) of the last disk lookup
    tier_tokens: dict[str, int] = field(default_factory=dict)
    loading: bool = False  # a load was planned and the request has not run since
    # True: vLLM gave the last load up as a whole (freed its blocks, asked again), so
    # the request is answered a miss until it runs; None: no such load.
    load_given_up: bool | None = None


class _Source(NamedTuple):
    """Where one chunk of a loadable run comes from: a CPU hit, a disk entry, or the
    remote tier (a NamedTuple: built per chunk on every lookup)."""

    key: ChunkKey
    cpu: CpuHit | None = None
    disk: Any = None  # a kv_offload.disk.DiskEntry
    remote: bool = False


@dataclass(slots=True)
class _Job:
    """Scheduler-side record of an in-flight job, with what to release on completion."""

    kind: str  # "load" or "store"
    keys: tuple[ChunkKey, ...]
    moves: tuple[ChunkMove, ...]
    staged: frozenset[int] = frozenset()  # load: chunk indexes read from disk or remote
    ranks_host: int = 0
    disk_reports: dict[int, Any] = field(default_factory=dict)
    remote_reports: dict[int, Any] = field(default_factory=dict)  # store: remote writes
    fill_reports: dict[int, Any] = field(default_factory=dict)  # load: fill_disk_slot writes
    fill_pinned: set[int] = field(default_factory=set)  # load: CPU pins held for fills
    bad_reads: set[int] = field(default_factory=set)  # load: disk copies found damaged
    host_done: bool = False  # store: published in the CPU tier; load: loaded on all ranks


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """The numbers the planner needs, resolved from OffloadConfig and the engine."""

    chunk_tokens: int
    block_size: int
    tokens_per_hash: int
    num_ranks: int
    num_cpu_slots: int
    store_generated: bool = False
    eviction_policy: str = "lru"


class OffloadScheduler:
    """Plans loads and stores from the CPU, disk and remote tiers; owns every pin.

    Scheduler thread only. ``disk_index`` is a ``kv_offload.disk.DiskIndex`` or None
    (disk tier off); ``remote`` a ``kv_offload.remote.RemoteTier`` or None.
    ``block_ids_of(req_id)`` returns the request's engine block ids.
    """

    def __init__(
        self,
        config: PlannerConfig,
        *,
        disk_index: Any | None,
        block_ids_of: Callable[[str], Sequence[int]],
        remote: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.chunk_tokens % config.block_size or config.block_size % config.tokens_per_hash:
            raise ValueError(
                f"chunk_tokens={config.chunk_tokens} must be a multiple of the block size "
                f"{config.block_size}, itself a multiple of tokens_per_hash "
                f"{config.tokens_per_hash}"
            )
        self.config = config
        self.blocks_per_chunk = config.chunk_tokens // config.block_size
        self.cpu = CpuIndex(config.num_cpu_slots, policy=config.eviction_policy)
        self.disk = disk_index
        self.disk_enabled = disk_index is not None
        self.remote = remote
        self.counters = SchedulerCounters()
        self._block_ids_of = block_ids_of
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._jobs: dict[int, _Job] = {}
        self._job_ids = itertools.count(1)
        self._pending_loads: list[LoadJob] = []
        self._last_access_flush = clock()

    # -- lookups ---------------------------------------------------------------------------

    def _keys(self, request: Any, *, for_load: bool) -> list[ChunkKey]:
        # A load leaves at least one token to compute so vLLM can sample the next one.
        limit = request.num_tokens - 1 if for_load else None
        return chunk_keys(
            request.block_hashes,
            tokens_per_hash=self.config.tokens_per_hash,
            chunk_tokens=self.config.chunk_tokens,
            max_tokens=limit,
        )

    def _loadable_run(self, state: _Request, keys: Sequence[ChunkKey], first: int
                      ) -> list[_Source]:
        """The chunks of ``keys[first:]`` a load can take now, each with its tier: the
        longest run held by the CPU tier (READY or STAGING), the disk or the remote tier,
        cut where no CPU slot is left to stage a disk or remote chunk into. So a hit
        reported to vLLM can always be staged and pinned. Read-only (the remote check is
        memoised per request)."""
        run = self._local_run(keys[first:])
        start = first + len(run)
        if len(run) == len(keys) - first or self.cpu.state(keys[start]) is not None:
            return self._cut_to_budget(run)  # a STORING chunk ends the run
        for key in keys[start:start + self._remote_lookup(state, keys, start)]:
            hit = self.cpu.hit(key)
            if hit is None and key in self.cpu:
                break
            run.append(_Source(key, cpu=hit, remote=hit is None))
        return self._cut_to_budget(run)

    def _local_run(self, keys: Sequence[ChunkKey]) -> list[_Source]:
        """Leading chunks of ``keys`` in the CPU tier or, for those the CPU tier lacks,
        on disk (a CPU entry past a CPU miss is used as it is: never staged twice)."""
        hits = self.cpu.hits(keys)
        if None not in hits:
            return [_Source(h.key, h) for h in hits]  # type: ignore[union-attr]
        wanted = [k for k, h in zip(keys, hits) if h is None]
        on_disk: list = []
        if wanted and self.disk_enabled:
            with self._disk_guard("lookup"):
                on_disk = self.disk.find_prefix(wanted)
        run: list[_Source] = []
        num_disk = 0
        for key, hit in zip(keys, hits):
            if hit is not None:
                run.append(_Source(key, hit))
            elif num_disk < len(on_disk):
                run.append(_Source(key, None, on_disk[num_disk]))
                num_disk += 1
            else:
                break
        return run

    def _cut_to_budget(self, run: list[_Source]) -> list[_Source]:
        """``run`` up to the first chunk that would find no CPU slot to stage into."""
        num_staged = sum(s.cpu is None for s in run)
        if num_staged <= self.cpu.num_free:
            return run
        budget = self.cpu.num_reservable(s.cpu for s in run if s.cpu is not None)
        for i, source in enumerate(run):
            if source.cpu is None:
                if budget == 0:
                    return run[:i]
                budget -= 1
        return run

    def num_matched_tokens(self, request: Any, num_computed_tokens: int) -> int | None:
        """Tokens past ``num_computed_tokens`` that the tiers can load (and stage: see
        ``_loadable_run``). No side effects beyond a per-request memo of the answer.

        None ("ask again later") once for a request whose previous load vLLM gave up
        as a whole, then 0 until it ran: see docs/vllm-bugs.md (vLLM 0.32 would stall
        it, and the requests behind it, if it reported an asynchronous hit again)."""
        state = self._requests.setdefault(request.request_id, _Request(request))
        state.request = request
        if state.load_given_up is None and state.loading:
            state.loading, state.load_given_up = False, True
            self.counters.loads_given_up += 1
            return None
        keys = self._keys(request, for_load=True)
        first = num_computed_tokens // self.config.chunk_tokens
        if first >= len(keys) or state.load_given_up:
            hit_tokens = 0
        else:
            run = self._loadable_run(state, keys, first)
            if self.disk_enabled:
                disk_hits = sum(s.disk is not None for s in run)
                state.disk_outcome = (disk_hits, len(keys) - first - len(run))
            end = (first + len(run)) * self.config.chunk_tokens
            hit_tokens = max(0, end - num_computed_tokens)
        state.lookup = (num_computed_tokens, hit_tokens)
        return hit_tokens

    def _remote_lookup(self, state: _Request, keys: Sequence[ChunkKey], start: int) -> int:
        """Leading chunks of ``keys[start:]`` held by the remote tier: one pipelined check
        per request (memoised: vLLM asks again while a request waits for blocks)."""
        if self.remote is None or start >= len(keys):
            return 0
        memo = state.remote
        if memo is not None and memo[:2] == (start, len(keys)):
            return len(memo[2])
        began, failures = self._clock(), self.remote.health.num_failures
        hits = self.remote.lookup(keys[start:])
        self.counters.remote_lookups += 1
        self.counters.remote_lookup_errors += self.remote.health.num_failures - failures
        self.counters.seconds_remote_lookup += self._clock() - began
        state.remote = (start, len(keys), frozenset(keys[start:start + hits]))
        return hits

    # -- loads -----------------------------------------------------------------------------

    def plan_load(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Pin sources and queue a LoadJob for ``num_external_tokens`` after the local hit.

        Called once vLLM allocated the request's blocks, also with 0 tokens (then it only
        counts the miss). Chunks that vanished since the lookup (another process evicted
        them from the disk or remote tier) are queued as failed moves, so the worker
        reports their blocks as load errors and vLLM recomputes them.
        """
        state = self._requests.get(request.request_id)
        if state is None or state.lookup is None:
            return
        num_local, _ = state.lookup
        state.lookup = None
        self._count_disk_lookup(state)
        looked_up = max(0, request.num_tokens - 1 - num_local)
        self.counters.miss_tokens += max(0, looked_up - num_external_tokens)
        if num_external_tokens <= 0:
            return
        chunk = self.config.chunk_tokens
        first = num_local // chunk
        last = (num_local + num_external_tokens) // chunk
        all_keys = self._keys(request, for_load=True)
        run = self._loadable_run(state, all_keys, first)[:last - first]
        self.cpu.pin(s.cpu.slot for s in run if s.cpu is not None)  # before any eviction
        fills = self._fill_slots([s.key for s in run if s.remote])
        job_id = next(self._job_ids)
        moves: list[ChunkMove] = []
        staged: set[int] = set()
        tiers: dict[str, int] = {}
        for i in range(last - first):
            blocks = self._chunk_blocks(block_ids, first + i, skip_before=num_local)
            tokens = (first + i + 1) * chunk - max(num_local, (first + i) * chunk)
            move, tier = self._plan_move(run[i] if i < len(run) else None, blocks, job_id, fills)
            moves.append(move)
            if tier is None:
                self.counters.load_errors += 1
                continue
            tiers[tier] = tiers.get(tier, 0) + tokens
            staged.update([i] if tier != "cpu" else [])
        self._release_disk(list(fills.values()))  # fills of chunks that found no CPU slot
        keys = tuple(all_keys[first:last])
        self.cpu.touch(k for k, m in zip(keys, moves) if m.cpu_slot is not None)
        state.tier_tokens = tiers
        state.loading = True
        self._count_load(tiers, moves, len(staged))
        self._jobs[job_id] = _Job("load", keys, tuple(moves), frozenset(staged))
        self._pending_loads.append(LoadJob(job_id, request.request_id, tuple(moves)))

    def fail_load(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int
                  ) -> None:
        """Queue a load whose every chunk fails, for a request told to wait for
        ``num_external_tokens`` after ``plan_load`` raised: the workers report its last
        ``num_external_tokens`` worth of blocks as load errors, and vLLM recomputes them
        instead of waiting forever. Holds no pin."""
        num_blocks = num_external_tokens // self.config.block_size
        if num_blocks <= 0:
            return
        blocks = tuple(int(b) for b in block_ids[-num_blocks:])
        state = self._requests.get(req_id)
        if state is not None:
            state.loading, state.lookup = True, None
        self.counters.load_errors += 1
        move = ChunkMove(blocks, None)
        self._pending_loads.append(LoadJob(next(self._job_ids), req_id, (move,)))

    def take_pending_loads(self) -> tuple[LoadJob, ...]:
        """Hand out the queued loads (what ``plan_step`` does first; the fallback plan
        when planning stores failed)."""
        loads, self._pending_loads = tuple(self._pending_loads), []
        return loads

    def _plan_move(self, source: _Source | None, blocks: tuple[int, ...], job_id: int,
                   fills: dict) -> tuple[ChunkMove, str | None]:
        """The move of one chunk of a load and its tier (None: failed move). A staged
        chunk gets its CPU slot here (its CPU hits are pinned already)."""
        if source is None:  # vanished since the lookup
            return ChunkMove(blocks, None), None
        if source.cpu is not None:
            return ChunkMove(blocks, source.cpu.slot, after_job=source.cpu.staging_job), "cpu"
        slot = self.cpu.reserve(source.key, SlotState.STAGING, staging_job=job_id)
        if slot is None:  # cannot happen: the lookup counted the slots
            return ChunkMove(blocks, None), None
        if source.disk is not None:
            self.disk.pin([source.disk.slot])
            return ChunkMove(blocks, slot, source.disk.slot, tuple(source.disk.checksums)), "disk"
        return ChunkMove(blocks, slot, remote_key=source.key,
                         fill_disk_slot=fills.pop(source.key, None)), "remote"

    def _count_disk_lookup(self, state: _Request) -> None:
        if self.disk_enabled and any(state.disk_outcome):
            # Counted once per scheduled request, however often vLLM asked before.
            hits, misses = state.disk_outcome
            state.disk_outcome = (0, 0)
            with self._disk_guard("count_lookup"):
                self.disk.count_lookup(hits=hits, misses=misses)

    def _count_load(self, tiers: dict[str, int], moves: list[ChunkMove], num_staged: int
                    ) -> None:
        num_remote = sum(m.remote_key is not None for m in moves)
        self.counters.hit_tokens_cpu += tiers.get("cpu", 0)
        self.counters.hit_tokens_disk += tiers.get("disk", 0)
        self.counters.hit_tokens_remote += tiers.get("remote", 0)
        self.counters.chunks_loaded_cpu += sum(
            m.cpu_slot is not None for m in moves) - num_staged
        self.counters.chunks_loaded_disk += num_staged - num_remote
        self.counters.chunks_loaded_remote += num_remote

    def _fill_slots(self, keys: Sequence[ChunkKey]) -> dict:
        """Disk slots reserved for the remote chunks ``keys`` (key -> slot), so that
        what is fetched from the remote tier also lands on the local disk."""
        if not (keys and self.disk_enabled):
            return {}
        slots: list[int | None] = []
        with self._disk_guard("allocate"):
            slots = self.disk.allocate(list(keys))
        return {k: s for k, s in zip(keys, slots) if s is not None}

    def _release_disk(self, slots: list[int]) -> None:
        if slots and self.disk is not None:
            with self._disk_guard("release"):
                self.disk.release(slots)

    def hit_tokens_by_tier(self, req_id: str) -> dict[str, int]:
        """Tokens of the last planned load of ``req_id`` per tier ("cpu", "disk",
        "remote")."""
        state = self._requests.get(req_id)
        return dict(state.tier_tokens) if state else {}

    def _chunk_blocks(self, block_ids: Sequence[int], chunk_index: int, *, skip_before: int
                      ) -> tuple[int, ...]:
        bpc, bs = self.blocks_per_chunk, self.config.block_size
        out = []
        for j in range(bpc):
            b = chunk_index * bpc + j
            out.append(SKIP_BLOCK if (b + 1) * bs <= skip_before else int(block_ids[b]))
        return tuple(out)

    # -- stores ----------------------------------------------------------------------------

    def plan_step(self, scheduled: Iterable[tuple[str, int]]) -> StepPlan:
        """Build this step's plan: queued loads, plus stores for chunks that this step
        completes. ``scheduled`` yields (req_id, tokens computed once the step ran)."""
        stores: list[tuple[ChunkKey, tuple[int, ...]]] = []
        for req_id, computed in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            state.loading, state.load_given_up = False, None  # it runs: its load is over
            request = state.request
            limit = computed if self.config.store_generated else min(
                computed, request.num_prompt_tokens)
            # Decide from counts first: building keys every decode step costs O(prompt).
            hashed = len(request.block_hashes) * self.config.tokens_per_hash
            num_done = min(hashed, limit) // self.config.chunk_tokens
            if num_done <= state.next_store_chunk:
                continue
            keys = self._keys(request, for_load=False)
            block_ids = self._block_ids_of(req_id)
            for c in range(state.next_store_chunk, num_done):
                key = keys[c]
                if key in self.cpu:
                    self.cpu.touch([key])
                    continue
                stores.append((key, self._chunk_blocks(block_ids, c, skip_before=0)))
            state.next_store_chunk = num_done
        store_jobs = (self._plan_store(stores),) if stores else ()
        store_jobs = tuple(j for j in store_jobs if j is not None)
        loads = self.take_pending_loads()
        self._maybe_flush_access()
        return StepPlan(loads, store_jobs)

    def _plan_store(self, chunks: list[tuple[ChunkKey, tuple[int, ...]]]) -> StoreJob | None:
        seen: set[ChunkKey] = set()
        unique = [(k, b) for k, b in chunks if not (k in seen or seen.add(k))]
        disk_slots: list[int | None] = [None] * len(unique)
        if self.disk_enabled:
            with self._disk_guard("allocate"):
                disk_slots = list(self.disk.allocate([k for k, _ in unique]))
        job_id = next(self._job_ids)
        keys, moves, unused_disk = [], [], []
        for (key, blocks), disk_slot in zip(unique, disk_slots):
            evictions = self.cpu.num_evictions
            slot = self.cpu.reserve(key, SlotState.STORING)
            self.counters.evictions_cpu += self.cpu.num_evictions - evictions
            if slot is None:
                self.counters.skipped_stores += 1
                if disk_slot is not None:
                    unused_disk.append(disk_slot)
                continue
            keys.append(key)
            moves.append(ChunkMove(blocks, slot, disk_slot,
                                   remote_key=key if self.remote is not None else None))
        self._release_disk(unused_disk)
        if not moves:
            return None
        self._jobs[job_id] = _Job("store", tuple(keys), tuple(moves))
        return StoreJob(job_id, tuple(moves))

    # -- completions -----------------------------------------------------------------------

    def on_report(self, report: WorkerReport) -> None:
        """Apply what workers finished: publish, commit, release pins (invariants 1-2)."""
        if report.disk_broken:
            self._disable_disk(report.disk_broken)
        for job_id, count in report.host_stored.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            job.ranks_host += count
            if job.ranks_host >= self.config.num_ranks and not job.host_done:
                job.host_done = True
                self.counters.chunks_stored_cpu += len(job.keys)
                for move in job.moves:
                    self.cpu.publish(move.cpu_slot)
                    if move.disk_slot is None and move.remote_key is None:
                        self.cpu.unpin([move.cpu_slot])
                self._maybe_finish_store(job_id, job)
        for job_id, per_rank in report.disk_stored.items():
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if job.kind == "load":
                job.fill_reports.update(per_rank)
                self._maybe_finish_load(job_id, job)
            else:
                job.disk_reports.update(per_rank)
                self._maybe_finish_store(job_id, job)
        for job_id, per_rank in report.remote_stored.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.remote_reports.update(per_rank)
                self._maybe_finish_store(job_id, job)
        for job_id, per_rank in report.bad_reads.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.bad_reads.update(*per_rank.values())
        for job_id, per_rank in report.loaded.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.disk_reports.update(per_rank)
                self._maybe_finish_load(job_id, job)

    def _maybe_finish_store(self, job_id: int, job: _Job) -> None:
        """Once every rank copied, wrote the disk and wrote the remote tier: release the
        CPU pins held for those writes, commit the disk slots that all ranks wrote."""
        ranks = self.config.num_ranks
        has_disk = any(m.disk_slot is not None for m in job.moves)
        has_remote = any(m.remote_key is not None for m in job.moves)
        if (not job.host_done or (has_disk and len(job.disk_reports) < ranks)
                or (has_remote and len(job.remote_reports) < ranks)):
            return
        del self._jobs[job_id]
        self.cpu.unpin(m.cpu_slot for m in job.moves
                       if m.disk_slot is not None or m.remote_key is not None)
        if has_remote:
            per_rank = list(job.remote_reports.values())
            self.counters.chunks_stored_remote += sum(
                all(r[i] for r in per_rank) for i, m in enumerate(job.moves)
                if m.remote_key is not None)
        if has_disk:
            self._commit_disk(job.keys, [m.disk_slot for m in job.moves], job.disk_reports)

    def _commit_disk(self, keys: Sequence[ChunkKey], slots: Sequence[int | None],
                     reports: dict[int, Any], failed: frozenset[int] = frozenset()) -> None:
        """Commit the disk slots whose chunk every rank wrote (a checksum from each rank
        in ``reports``), release the others and those in ``failed``."""
        ranks = sorted(reports)
        commits, releases = [], []
        for i, (key, slot) in enumerate(zip(keys, slots)):
            if slot is None:
                continue
            sums = tuple(reports[r][i] for r in ranks)
            if i not in failed and all(s is not None for s in sums):
                commits.append((key, slot, sums))
            else:
                releases.append(slot)
        self.counters.chunks_stored_disk += len(commits)
        if commits and self.disk is not None:  # also after _disable_disk: in-flight jobs
            with self._disk_guard("commit"):
                self.disk.commit(commits)
        self._release_disk(releases)

    def _maybe_finish_load(self, job_id: int, job: _Job) -> None:
        """Apply a load once every rank reported it; drop the job once its disk fills
        (remote chunks also written to the local disk) are reported too."""
        ranks = self.config.num_ranks
        if len(job.disk_reports) < ranks:
            return
        failed = frozenset(set().union(*job.disk_reports.values()))
        if not job.host_done:
            job.host_done = True
            self._apply_load(job, failed)
        fills = [m.fill_disk_slot for m in job.moves]
        if any(s is not None for s in fills) and len(job.fill_reports) < ranks:
            return
        del self._jobs[job_id]
        if any(s is not None for s in fills):
            self.cpu.unpin(job.moves[i].cpu_slot for i in job.fill_pinned)
            self._commit_disk(job.keys, fills, job.fill_reports, frozenset(job.bad_reads))

    def _apply_load(self, job: _Job, failed: frozenset[int]) -> None:
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
        for i, (key, move) in enumerate(zip(job.keys, job.moves)):
            if move.cpu_slot is None:
                continue
            if i in job.staged:
                if move.disk_slot is not None:
                    self.disk.unpin([move.disk_slot])
                if i in job.bad_reads:
                    self.cpu.discard_slot(move.cpu_slot)
                    if move.disk_slot is not None:
                        with self._disk_guard("drop"):
                            self.disk.drop(key, move.disk_slot)
                else:
                    self.cpu.publish(move.cpu_slot)
                if move.fill_disk_slot is not None:
                    job.fill_pinned.add(i)
                    continue
            self.cpu.unpin([move.cpu_slot])

    # -- lifecycle -------------------------------------------------------------------------

    def request_finished(self, req_id: str) -> None:
        """Forget a finished request. Its jobs keep their pins until they complete."""
        self._requests.pop(req_id, None)

    def num_pending_jobs(self) -> int:
        """Jobs planned or in flight (loads not yet handed out count too)."""
        return len(self._jobs)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._pending_loads)

    def reset_cpu_tier(self) -> int:
        """Drop unpinned READY CPU entries (vLLM ``reset_prefix_cache(reset_connector=True)``)."""
        return self.cpu.clear_unpinned()

    def _maybe_flush_access(self) -> None:
        now = self._clock()
        if self.disk_enabled and now - self._last_access_flush >= ACCESS_FLUSH_INTERVAL_S:
            self._last_access_flush = now
            with self._disk_guard("flush_access"):
                self.disk.flush_access()

    def _disable_disk(self, reason: str) -> None:
        """Stop using the disk tier for the rest of the run; logs once. In-flight jobs
        still unpin, commit and release what they hold."""
        if not self.disk_enabled:
            return
        self.disk_enabled = False
        logger.error(
            "kv-offload: the disk tier keeps failing (%s); it is disabled for this run and "
            "serving continues from the CPU tier. Fix the store directory (deleted, "
            "read-only, full or failing disk) and restart to use it again.", reason)

    @contextlib.contextmanager
    def _disk_guard(self, what: str):
        """Turn a StoreError of the disk index into _disable_disk (the caller's fallback
        value stands)."""
        try:
            yield
        except StoreError as exc:
            self._disable_disk(f"disk index {what}: {exc}")

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
        if self.disk is not None:
            with self._disk_guard("flush_access"):
                self.disk.flush_access()
            with self._disk_guard("close"):
                self.disk.close()

