"""OffloadWorker: the worker-side muscle that executes load and store jobs on one rank.

Owns the rank's host slots, copy engine and the worker halves of the secondary tiers
(``tier_contract.TierIO``: the disk's, the remote's); makes no policy decisions. Reads from
a tier run on a thread pool (the read lane), so the engine never waits on disk (invariant
6); writes run on a pool of their own (the write lane), so a read for a load never queues
behind a store. Engine copies of loads run on one copy thread, or, with a synchronous engine
(the CPU backend) and up to ``INLINE_LOAD_MAX_BYTES`` per call, on vLLM's thread once the
reads they need are done (in ``start_loads`` or the next ``poll``), so the copy is reported
in the same step (same-step loads: ``layer_loads.py``). Store jobs: ``WorkerStores``
(``worker/stores.py``). What it finished is reported through ``poll()``: finished requests
for vLLM, failed blocks, a ``WorkerReport`` for the scheduler.

``pause``/``resume`` follow vLLM taking the KV cache away and giving it back
(``unregister_kv_caches``/``restore_kv_caches``): a pause, not a shutdown. While paused no
copy touches the engine's KV memory; host slots and the secondary tiers keep what they hold,
and their reads and writes go on.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kv_offload.counters import WorkerCounters, WorkerTally
from kv_offload.jobs import ChunkMove, LoadJob, StoreJob, WorkerReport
from kv_offload.tier_contract import TierIO
from kv_offload.worker.affinity import ThreadPlacement
from kv_offload.worker.host_copies import HostCopies
from kv_offload.worker.layer_loads import LayerWaits, Unsettled, audit_failed_rows
from kv_offload.worker.loads import (
    LandedChunks,
    StagedRead,
    WorkerLoad,
    WorkerLoadPhase,
    completed,
    when_all_done,
)
from kv_offload.worker.stores import WorkerStores, all_done, chunk_bytes, results

if TYPE_CHECKING:
    from kv_offload.copy.base import CopyEngine
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.worker.audit import CopyAudit

logger = logging.getLogger(__name__)

__all__ = ["IDLE_STEP_WAIT_S", "INLINE_LOAD_MAX_BYTES", "STAGED_READ_TTL_S",
           "OffloadWorker", "PollResult"]

STAGED_READ_TTL_S = 300.0
INLINE_LOAD_MAX_BYTES = 256 << 20
"""Most load bytes (per rank) a synchronous engine copies on vLLM's thread in one call:
~15-30 ms at this machine's copy speed, a stall of every running request's step that more
would stretch; larger loads, and loads past it, use the copy thread."""
IDLE_STEP_WAIT_S = 0.005
"""Longest an idle ``poll`` (no forward this step) waits for a load in flight, which it then
reports at once; a request arriving meanwhile is scheduled at most this much later."""


@dataclass(slots=True)
class PollResult:
    """What finished since the last poll (owned by the caller)."""

    finished_req_ids: set[str]
    failed_block_ids: set[int]
    finished_sending: set[str] = field(default_factory=set)  # held requests now free
    failed_req_ids: set[str] = field(default_factory=set)  # loads with a failed block


class OffloadWorker:
    """Executes jobs for one rank. Methods are called from vLLM's worker thread only;
    internal threads never call back into vLLM.

    ``engine``: a ``kv_offload.copy.CopyEngine`` over this rank's KV planes and
    ``host`` slots. ``tiers``: this rank's halves of the secondary tiers (the disk's
    ``disk.io.DiskIO``, the remote's ``remote.io.RemoteIO``). ``placement``: which CPUs
    the I/O, copy and store threads run on (``worker.affinity``; default: where they start).
    ``audit``: the runtime audit of a sample of copies (``worker/audit.py``); the worker
    closes it.
    """

    def __init__(
        self,
        *,
        rank: int,
        engine: CopyEngine,
        host: HostSlots,
        tiers: Sequence[TierIO] = (),
        io_threads: int = 4,
        load_timeout_s: float = 30.0,
        background_stores: bool = False,
        placement: ThreadPlacement | None = None,
        audit: CopyAudit | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.engine = engine
        self.host = host
        self.tiers = {tier.name: tier for tier in tiers}
        self.load_timeout_s = load_timeout_s
        self.idle_wait_s = IDLE_STEP_WAIT_S
        self._clock = clock
        self.placement = placement or ThreadPlacement()
        place = self.placement.background
        # Two lanes, so that reads for loads (TTFT) never queue behind writes for stores.
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-offload-io",
                                      initializer=place)
        self._io_writes = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-offload-write",
                                             initializer=place)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-copy",
                                          initializer=place)
        self._audit = audit
        self._copies = HostCopies(engine, background=background_stores, initializer=place,
                                  audit=audit)
        self._lock = threading.Lock()
        self._loads: dict[int, WorkerLoad] = {}
        self._staged: dict[tuple[int, int], StagedRead] = {}
        # load job -> tier -> per chunk, its fill write (the chunk's sinks)
        self._fills: dict[int, dict[str, list[Future[object | None] | None]]] = {}
        self._report = WorkerReport()
        self._tally = WorkerTally()
        for tier in self.tiers.values():
            tier.bind(self._tally.add, clock)
        self._paused = False  # vLLM took the KV cache away (pause): no copy touches it
        self.layer_waits = LayerWaits(lambda: self.engine)  # same-step loads per layer
        self._progress = threading.Event()  # set when a load's reads or copy end
        self._ready: collections.deque[tuple[WorkerLoad, dict[int, Future[bool]]]] = (
            collections.deque())  # loads read, for vLLM's thread to copy (synchronous engine)
        self._landing = LandedChunks(host.slot_bytes)  # synchronous engine: _copy_landed
        self._unsettled = Unsettled()  # a synchronous engine's same-step loads per layer
        self._stores = WorkerStores(
            rank=rank, host=host, copies=self._copies, tiers=self.tiers,
            submit=lambda fn, *args: self._io_writes.submit(fn, *args), count=self._tally.add,
            clock=clock)

    # -- loads -----------------------------------------------------------------------------

    def start_loads(self, jobs: Sequence[LoadJob]) -> bool:
        """Start ``jobs`` in the background: reads from their sources' tiers on the read lane
        (writes to the chunks' sinks, fills, on the write lane once read), then the engine copy of
        each job, once the reads it needs (its own and those of jobs it shares chunks with) are
        done, so a slow disk never holds up the copies of other jobs. Returns at once, except that
        a synchronous engine copies a job that needs no read right here. While paused, each job is
        cancelled at once (its blocks are reported failed by the next poll, vLLM recomputes them);
        its reads still fill the host slots it stages.

        Same-step jobs (``LoadJob.same_step``) are copied, or issued before the forward, here
        (``_load_same_step``). False when one failed: the forward reads wrong KV."""
        now = self._clock()
        all_loaded = self._load_same_step([job for job in jobs if job.same_step], now)
        for job in (job for job in jobs if not job.same_step):
            # Its copy waits for the compute queued before this mark (one per job: each
            # load releases its own once its copy is issued).
            load = WorkerLoad(job, now, None if self._paused else self.engine.compute_mark())
            if self._paused:
                load.cancel()
            reads: dict[int, Future[bool]] = {}
            wake = self._landing.waker(job, self._progress)
            needed: list[Future[bool]] = []
            fills: dict[str, list[Future[object | None] | None]] = {}
            for i, move in enumerate(job.chunks):
                if move.cpu_slot is None:
                    continue
                if move.source is not None:
                    fut = self._io.submit(self._read, move)
                    if self.engine.synchronous:  # vLLM's thread copies a batch once read
                        fut.add_done_callback(wake)
                    reads[i] = fut
                    self._staged[(job.job_id, move.cpu_slot)] = StagedRead(fut)
                    needed.append(fut)
                    for sink in move.sinks:
                        fills.setdefault(sink.tier, [None] * len(job.chunks))[i] = (
                            self._stores.fill_after(fut, move.cpu_slot, sink))
                elif move.after_job is not None:
                    staged = self._staged.get((move.after_job, move.cpu_slot))
                    if staged is not None:
                        needed.append(staged.read)
            with self._lock:
                self._loads[job.job_id] = load
                if fills:
                    self._fills[job.job_id] = fills
                if reads and self.engine.synchronous:
                    self._landing.add(load, reads)
            when_all_done(needed, functools.partial(self._queue_copy, load, reads))
        self._copy_ready()
        return all_loaded

    def _load_same_step(self, jobs: Sequence[LoadJob], now: float) -> bool:
        """Copy ``jobs`` (READY CPU slots) into the engine before this step's forward: a
        synchronous engine copies here, one with streams issues one copy of all of them
        (``_issue_before_forward``). This step's ``poll`` reports failed chunks as load
        errors. False when a chunk failed."""
        loads, issue = [], []
        for job in jobs:
            load = WorkerLoad(job, now)
            loads.append(load)
            with self._lock:
                self._loads[job.job_id] = load
                if self._paused:  # every block is reported failed by this step's poll
                    load.cancel()
                    continue
                load.begin_copy()
            rows = load.same_step_rows()
            if rows and self.engine.synchronous and not self.layer_waits.per_layer:
                self._copy_rows(load, rows)
            elif rows:  # a synchronous engine's copy per layer ends with the forward
                issue.append((load, rows))
        future = self._issue_before_forward(issue) if issue else None  # None: no copy left
        issued = {id(load) for load, _ in issue}
        with self._lock:
            for load in loads:
                ended = future is None or id(load) not in issued
                if ended and load.phase is WorkerLoadPhase.COPYING:
                    load.end_copy()
                load.future = completed() if future is None or ended else future
                load.future.add_done_callback(lambda _: self._progress.set())
        return not any(load.failed or load.phase is WorkerLoadPhase.CANCELLED for load in loads)

    def _issue_before_forward(self, issue: list[tuple[WorkerLoad, list[int]]]) -> Future | None:
        """Issue these same-step copies as one before the compute that reads them (no host wait:
        ``LayerWaits.issue``); the future that ends them (copy thread; CPU: ``Unsettled``), or None."""
        slots, blocks = (np.concatenate(a) for a in zip(*(ld.copy_arrays(r) for ld, r in issue)))
        start, job_ids = self._clock(), [load.job.job_id for load, _ in issue]
        try:
            handle = self.layer_waits.issue(slots, blocks, issue)
        except Exception:
            logger.exception("kv-offload: issuing same-step loads %s failed", job_ids)
            for load, rows in issue:
                load.failed.update(rows)
            return None
        issued_s = self._clock() - start  # a synchronous engine's copies made at issue
        if self._audit is not None and self.engine.synchronous and self.layer_waits.per_layer:
            audit_failed_rows(issue, slots, blocks, self._audit.check_load, last=True)

        def settle() -> None:
            try:
                self.engine.wait(handle)
                seconds = (issued_s + (self.engine.took_s(handle) or 0.0)  # + the layer thread's
                           if self.engine.synchronous else self._clock() - start)  # as it ends
                self._tally.add(WorkerCounters(bytes_load=chunk_bytes(blocks, self.host.slot_bytes),
                                               seconds_load=seconds))
                if self._audit is not None and self.engine.synchronous:
                    audit_failed_rows(issue, slots, blocks, self._audit.check_load, last=False)
            except Exception:  # on a device, too late for this step's load errors
                logger.exception("kv-offload: same-step loads %s failed after their step "
                                 "used them", job_ids)
                for load, rows in issue:
                    load.failed.update(rows)
            with self._lock:
                for load, _ in issue:
                    load.end_copy()

        if self.engine.synchronous:  # its copy per layer ends with the forward: poll settles
            return self._unsettled.add(settle, [load for load, _ in issue])
        try:
            return self._copier.submit(settle)
        except RuntimeError:  # shut down by close(), which waited for the engine
            return None

    def _copy_ready(self) -> None:
        """Copy the loads of a synchronous engine whose reads are done, on vLLM's thread
        (``start_loads``, after the step's forward, and ``poll``): the blocks belong to
        requests vLLM does not schedule until the load is reported, and vLLM's cores are
        idle here. First the read chunks of loads still reading (``_copy_landed``)."""
        budget = INLINE_LOAD_MAX_BYTES - self._copy_landed(INLINE_LOAD_MAX_BYTES)
        while True:
            with self._lock:
                if not self._ready:
                    return
                load, reads = self._ready.popleft()
            size = self._load_bytes(load)
            if size > max(budget, 0):
                self._to_copier(load, reads)
                continue
            budget -= size
            try:
                self._copy_load(load, reads)
            finally:
                with self._lock:
                    load.future = completed()

    def _copy_landed(self, budget: int) -> int:
        """Copy the read chunks of loads still reading into the engine (synchronous
        engine, vLLM's thread, which makes every copy of such a load until ``_copy_ready``
        takes the rest), so the copy overlaps the later reads on the I/O threads' cores.
        Its request is not scheduled before the load is reported; a chunk copied here
        whose load fails later is reported failed with the rest (vLLM recomputes it).
        Copies up to about ``budget`` bytes; returns the bytes copied."""
        if self._paused:  # no copy touches the engine's KV memory
            return 0
        with self._lock:
            landed = self._landing.take(budget)
        for load, rows in landed:
            self._copy_rows(load, rows)
        return sum(len(rows) for _, rows in landed) * self.host.slot_bytes

    def _queue_copy(self, load: WorkerLoad, reads: dict[int, Future[bool]]) -> None:
        """Queue the engine copy of ``load`` (its reads are done; any thread): on the
        copy thread, or with a synchronous engine for vLLM's thread (``_copy_ready``)."""
        if self.engine.synchronous:
            with self._lock:
                self._landing.discard(load.job.job_id)
                self._ready.append((load, reads))
            self._progress.set()
        else:
            self._to_copier(load, reads)

    def _to_copier(self, load: WorkerLoad, reads: dict[int, Future[bool]]) -> None:
        try:
            future = self._copier.submit(self._copy_load, load, reads)
        except RuntimeError:  # shut down by close()
            self._release_mark(load)
            return
        with self._lock:
            load.future = future
        future.add_done_callback(lambda _: self._progress.set())

    def _load_bytes(self, load: WorkerLoad) -> int:
        """Bytes left to copy of ``load`` (chunks copied as they landed excluded)."""
        return (sum(m.cpu_slot is not None for m in load.job.chunks) - len(load.copied)
                ) * self.host.slot_bytes

    def _read(self, move: ChunkMove) -> bool:
        """Read ``move``'s chunk from its source tier into its host slot (read lane);
        whether the slot now holds the verified chunk. Never raises."""
        tier = None if move.source is None else self.tiers.get(move.source.tier)
        if tier is None or move.source is None or move.cpu_slot is None:
            return False
        try:
            return tier.read(move.source, self.host.slot_view(move.cpu_slot))
        except Exception:  # a tier's bug: a miss, vLLM recomputes
            logger.exception("kv-offload: reading a chunk from the %s tier failed", tier.name)
            return False

    def _copy_load(self, load: WorkerLoad, reads: dict[int, Future[bool]]) -> None:
        """``_run_load``, where a bug fails the whole load (its blocks are recomputed)
        instead of leaving it half reported or escaping into vLLM's step."""
        try:
            self._run_load(load, reads)
        except Exception:
            logger.exception("kv-offload: load job %d failed", load.job.job_id)
            with self._lock:
                load.failed.update(range(len(load.job.chunks)))
                if load.phase is WorkerLoadPhase.COPYING:
                    load.end_copy()
        finally:
            self._release_mark(load)

    def _release_mark(self, load: WorkerLoad) -> None:
        """Free the load's compute mark now that no copy is ordered after it: here, on a
        thread of the engine's device, not where the garbage collector runs."""
        try:
            self.engine.release_mark(load.take_mark())
        except Exception:
            logger.exception("kv-offload: releasing the compute mark of load job %d failed",
                             load.job.job_id)

    def _run_load(self, load: WorkerLoad, reads: dict[int, Future[bool]]) -> None:
        """Copy the chunks of ``load`` whose reads succeeded into the engine (those not
        copied as they landed)."""
        ok_rows = [i for i in load.sort_rows(reads, self._wait_staged) if i not in load.copied]
        with self._lock:
            if not load.begin_copy():
                return
        if ok_rows:
            self._copy_rows(load, ok_rows)
        with self._lock:
            load.end_copy()

    def _copy_rows(self, load: WorkerLoad, rows: Sequence[int]) -> None:
        """Copy these chunks of ``load`` into the engine and wait (failures, audit
        mismatches: ``load.failed``)."""
        slots, blocks = load.copy_arrays(rows)
        try:
            start = self._clock()
            self.engine.wait(self.engine.load(slots, blocks, after=load.mark))
            self._tally.add(WorkerCounters(bytes_load=chunk_bytes(blocks, self.host.slot_bytes),
                                           seconds_load=self._clock() - start))
            if self._audit is not None:  # a mismatch: a load error, vLLM recomputes
                load.failed.update(rows[i] for i in self._audit.check_load(blocks, slots))
        except Exception:
            logger.exception("kv-offload: copying job %d into the engine failed",
                             load.job.job_id)
            load.failed.update(rows)

    def _wait_staged(self, job_id: int, cpu_slot: int) -> bool:
        entry = self._staged.get((job_id, cpu_slot))
        return entry is not None and entry.succeeded(self.load_timeout_s)

    # -- stores ----------------------------------------------------------------------------

    def run_stores(self, jobs: Sequence[StoreJob], *, discard: bool = False) -> None:
        """Start copying engine blocks to host slots for ``jobs`` (ordered after this
        step's compute), then queue the writes to their sinks behind each copy
        (``worker/stores.py``). Never waits for a copy: its blocks are protected by
        ``fence`` and ``hold`` (invariant 3). ``discard``: the step's forward read a
        same-step load that failed (``start_loads`` returned False, or ``LayerWaits`` saw
        a layer read before its copy): reported failed uncopied, storing none of that KV."""
        discard = self.layer_waits.take_discard() or discard  # closes the step's layers
        self._stores.run(jobs, discard=self._unsettled.take_spoiled() or discard)

    def fence(self, req_ids: Sequence[str]) -> None:
        """Order this step's forward after the copies of these (preempted) requests'
        blocks, which vLLM freed and may give to this forward. vLLM's thread."""
        self._copies.fence(req_ids)

    def hold(self, req_ids: Sequence[str]) -> None:
        """The scheduler held these finished requests' blocks: ``poll`` reports each in
        ``finished_sending`` once this rank's copies of its blocks are done."""
        self._copies.hold(req_ids)

    # -- pause -----------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    def pause(self) -> None:
        """vLLM takes the KV cache away (``unregister_kv_caches``). Returns once no copy
        can touch the engine's KV memory any more: loads still reading are cancelled
        (the next poll reports their blocks failed; their reads go on into host slots),
        load copies in progress end, and every store copy issued ends (the next poll
        reports held requests sent). Until ``resume``, loads are cancelled and store
        copies refused as they come (reported failed: the scheduler releases their slots);
        tier writes of copied chunks go on. Tells the scheduler side through the next
        report (``WorkerReport.paused``). vLLM's thread; idempotent."""
        if self._paused:
            return
        self._paused = True
        with self._lock:
            cancelled = sum(load.cancel() for load in self._loads.values())
        self._wait_for_load_copies()
        self._copies.pause()
        with self._lock:
            self._report.paused[self.rank] = True
        logger.info("kv-offload worker rank %d: vLLM released the KV cache; %d loads in "
                    "flight will be recomputed; offloading pauses until it is restored "
                    "(the CPU, disk and remote tiers keep their chunks)", self.rank, cancelled)

    def resume(self, *, engine: CopyEngine | None = None, audit: CopyAudit | None = None
               ) -> None:
        """vLLM gave the KV cache back (``restore_kv_caches``): copy again, through
        ``engine`` (and its ``audit``) when the tensors were registered again, else
        through the engine over the same views. The old engine and audit are closed.
        Tells the scheduler side through the next report. vLLM's thread; a no-op when
        not paused."""
        if not self._paused:
            return
        if engine is not None:
            old_engine, old_audit = self.engine, self._audit
            self.engine, self._audit = engine, audit
            self._copies.resume(engine, audit)
            if old_audit is not None:
                old_audit.close()
                self._tally.add(old_audit.take_counts())
            old_engine.close()
        else:
            self._copies.resume()
        self._paused = False
        with self._lock:
            self._report.paused[self.rank] = False
        logger.info("kv-offload worker rank %d: vLLM restored the KV cache; offloading "
                    "resumes", self.rank)

    def _wait_for_load_copies(self) -> None:
        """Block until no load is copying into the engine (the copy thread's; with a
        synchronous engine vLLM's own thread copies, which is the caller)."""
        self._unsettled.settle()
        while True:
            self._progress.clear()  # before looking: a copy ending later sets it again
            with self._lock:
                copying = [load.job.job_id for load in self._loads.values()
                           if load.phase is WorkerLoadPhase.COPYING]
            if not copying:
                return
            if not self._progress.wait(10.0):
                logger.warning("kv-offload worker rank %d: still waiting for the engine "
                               "copies of load jobs %s before vLLM releases the KV cache",
                               self.rank, copying)

    # -- completion ------------------------------------------------------------------------

    def poll(self, *, idle: bool = False) -> PollResult:
        """Collect finished work. Loads past ``load_timeout_s`` that are still reading
        are failed now (their blocks reported for recompute); their slots stay pinned on
        the scheduler side until the reads really end. ``idle``: vLLM runs no forward
        this step; first wait up to ``idle_wait_s`` for a load in flight to end."""
        if idle and self.idle_wait_s > 0:
            self._wait_for_a_load(self.idle_wait_s)
        self._copy_ready()
        finished: set[str] = set()
        failed_blocks: set[int] = self.layer_waits.take_failed_blocks()
        self._unsettled.settle()
        failed_reqs: set[str] = set()
        now = self._clock()
        with self._lock:
            for job_id, load in list(self._loads.items()):
                if load.cancel_if_overdue(now, self.load_timeout_s):
                    logger.warning("kv-offload: load job %d timed out after %.1fs; "
                                   "recomputing", job_id, self.load_timeout_s)
                blocks = load.take_failed_blocks()
                if blocks is not None:
                    failed_blocks.update(blocks)
                    if not load.job.same_step:  # a same-step load's request is running
                        finished.add(load.job.req_id)
                        if blocks:
                            failed_reqs.add(load.job.req_id)
                if load.reported_to_vllm and load.copy_ended():  # a copy may end between looks
                    self._report.loaded[job_id] = {self.rank: load.failed_rows()}
                    if load.bad_reads:
                        self._report.bad_reads[job_id] = {self.rank: frozenset(load.bad_reads)}
                    del self._loads[job_id]
        self._stores.collect(self._report)
        with self._lock:
            for job_id, fills in list(self._fills.items()):
                if job_id not in self._loads and all(all_done(f) for f in fills.values()):
                    self._report.written[job_id] = {tier: {self.rank: results(f)}
                                                    for tier, f in fills.items()}
                    del self._fills[job_id]
        for key, staged in list(self._staged.items()):  # reads others no longer wait for
            if staged.ended is None:
                if staged.read.done():
                    staged.ended = now
            elif now - staged.ended > STAGED_READ_TTL_S:
                del self._staged[key]
        return PollResult(finished, failed_blocks, self._copies.take_sent(), failed_reqs)

    def _wait_for_a_load(self, timeout_s: float) -> None:
        """Block until a load not yet reported to vLLM has ended, there is none, or
        ``timeout_s`` passed; copies a synchronous engine's loads whose reads end."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._progress.clear()  # before looking: a later end sets it again
            self._copy_ready()
            with self._lock:
                waiting = [load for load in self._loads.values() if not load.reported_to_vllm]
                if not waiting or any(load.ended() for load in waiting):
                    return
            left = deadline - time.monotonic()
            if left <= 0 or not self._progress.wait(left):
                return

    def take_report(self) -> WorkerReport | None:
        """The report accumulated since the last call (None when empty)."""
        broken = {name: why for name, tier in self.tiers.items()
                  if (why := tier.take_broken()) is not None}
        with self._lock:
            self._report.broken.update(broken)
            report, self._report = self._report, WorkerReport()
        return report if report else None

    def take_stats(self) -> dict[str, float]:
        """Counter deltas since the last call (fields of ``kv_offload.counters.WorkerCounters``)."""
        counts = self._tally.take()
        if self._audit is not None:
            counts.add(self._audit.take_counts())
        return counts.nonzero()

    def has_pending_jobs(self) -> bool:
        return bool(self._loads or self._stores or self._fills or self._copies.num_pending())

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Finish queued tier writes (bounded by ``timeout_s``), then stop."""
        deadline = self._clock() + timeout_s
        self._unsettled.settle()  # same-step copies per layer end, and their loads
        self._copies.close()  # copies already issued finish (the writes read them)
        pending = self._stores.pending_writes()
        pending += [f for fills in list(self._fills.values()) for per_chunk in fills.values()
                    for f in per_chunk if f is not None]
        for w in pending:
            with contextlib.suppress(Exception):
                w.result(timeout=max(0.0, deadline - self._clock()))
        self._io.shutdown(wait=False, cancel_futures=True)
        self._io_writes.shutdown(wait=False, cancel_futures=True)
        self._copier.shutdown(wait=False, cancel_futures=True)
        running = [f for f in pending + [s.read for s in self._staged.values()]
                   + [load.future for load in self._loads.values() if load.future is not None]
                   if not f.done()]
        if running:  # closing now could let them write into a reused descriptor number
            logger.warning("kv-offload: %d tier or copy tasks still run after %.0f s; "
                           "their files and buffers are left to the process's exit",
                           len(running), timeout_s)
            return
        for tier in self.tiers.values():
            tier.close()
        if self._audit is not None:
            self._audit.close()
        self.engine.close()

