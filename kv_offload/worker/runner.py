"""OffloadWorker: the worker-side muscle that executes load and store jobs on one rank.

Owns the rank's host slots, copy engine and slab file; makes no policy decisions.
Disk I/O runs on a thread pool and engine copies of loads on one copy thread, so the
engine never waits on disk (invariant 6). Everything it finished is reported back
through ``poll()``: finished requests for vLLM, failed blocks, and a ``WorkerReport``
for the scheduler side.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob, StoreJob, WorkerReport
from kv_offload.remote.values import ValueCheck
from kv_offload.worker.host_copies import HostCopies, HostCopy

logger = logging.getLogger(__name__)

STAGED_READ_TTL_S = 300.0
DISK_BROKEN_AFTER = 8  # consecutive I/O errors (not checksum mismatches) before giving up
_BROKEN_ERRNOS = {errno.ENOENT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EBADF,
                  errno.ENOTDIR, errno.ESTALE}
_READING, _COPYING, _DONE, _CANCELLED = "reading", "copying", "done", "cancelled"


@dataclass(slots=True)
class _Load:
    job: LoadJob
    started: float
    stream: Any = None  # the compute stream current when vLLM handed the job out
    future: Future | None = None
    state: str = _READING
    failed: set[int] = field(default_factory=set)
    bad_reads: set[int] = field(default_factory=set)  # disk reads that failed verification
    reported_to_vllm: bool = False


@dataclass(slots=True)
class _Store:
    job: StoreJob
    copy: HostCopy
    writes: list[Future | None]
    remote_writes: list[Future | None]
    host_reported: bool = False


@dataclass(slots=True)
class PollResult:
    """What finished since the last poll (owned by the caller)."""

    finished_req_ids: set[str]
    failed_block_ids: set[int]
    finished_sending: set[str] = field(default_factory=set)  # held requests now free


class OffloadWorker:
    """Executes jobs for one rank. Methods are called from vLLM's worker thread only;
    internal threads never call back into vLLM.

    ``engine``: a ``kv_offload.copy.CopyEngine`` over this rank's KV planes and
    ``host`` slots. ``slab``: this rank's ``kv_offload.disk.SlabFile`` or None.
    ``remote``: a ``kv_offload.remote.RemoteTier`` or None.
    """

    def __init__(
        self,
        *,
        rank: int,
        engine: Any,
        host: Any,
        slab: Any | None,
        remote: Any | None = None,
        io_threads: int = 4,
        load_timeout_s: float = 30.0,
        verify_checksums: bool = True,
        background_stores: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = rank
        self.engine = engine
        self.host = host
        self.slab = slab
        self.remote = remote
        self.load_timeout_s = load_timeout_s
        self.verify_checksums = verify_checksums
        self._clock = clock
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="kv-offload-io")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-copy")
        self._copies = HostCopies(engine, background=background_stores)
        self._lock = threading.Lock()
        self._loads: dict[int, _Load] = {}
        self._stores: dict[int, _Store] = {}
        self._staged: dict[tuple[int, int], tuple[Future, float]] = {}
        self._fills: dict[int, list[Future | None]] = {}  # load job -> fill_disk_slot writes
        self._remote_misses = 0
        self._report = WorkerReport()
        self._write_errors = 0
        self._write_burst = False  # the last write failed (a failure burst is logged once)
        self._read_failures = 0
        self._io_errors_in_a_row = 0
        self._disk_broken_reported = False
        self._stats: dict[str, float] = {}

    # -- loads -----------------------------------------------------------------------------

    def start_loads(self, jobs: Sequence[LoadJob]) -> None:
        """Start ``jobs`` in the background: disk and remote reads on the I/O pool (and
        the disk fills of remote chunks behind them), then one engine
        copy per job on the copy thread, queued only once the reads it needs (its own and
        those of jobs it shares chunks with) are done, so a slow disk never holds up the
        copies of other jobs. Returns at once."""
        now = self._clock()
        for job in jobs:
            load = _Load(job, now, self.engine.current_stream())
            reads: dict[int, Future] = {}
            needed: list[Future] = []
            fills: list[Future | None] = []
            for i, move in enumerate(job.chunks):
                fills.append(None)
                if move.cpu_slot is None:
                    continue
                if move.disk_slot is not None or move.remote_key is not None:
                    read = self._read_chunk if move.disk_slot is not None else self._read_remote
                    fut = self._io.submit(read, move)
                    reads[i] = fut
                    self._staged[(job.job_id, move.cpu_slot)] = (fut, now)
                    needed.append(fut)
                    if move.fill_disk_slot is not None:
                        # Queued behind its read, so a busy pool cannot deadlock on it.
                        fills[i] = self._io.submit(self._fill_disk, fut, move)
                elif move.after_job is not None:
                    staged = self._staged.get((move.after_job, move.cpu_slot))
                    if staged is not None:
                        needed.append(staged[0])
            with self._lock:
                self._loads[job.job_id] = load
                if any(f is not None for f in fills):
                    self._fills[job.job_id] = fills
            _when_all_done(needed, lambda load=load, reads=reads: self._queue_copy(load, reads))

    def _queue_copy(self, load: _Load, reads: dict[int, Future]) -> None:
        """Queue the engine copy of ``load`` (its reads are done); any thread."""
        try:
            future = self._copier.submit(self._run_load, load, reads)
        except RuntimeError:  # shut down by close()
            return
        with self._lock:
            load.future = future

    def _read_chunk(self, move: ChunkMove) -> bool:
        if self.slab is None or move.checksums is None:
            return False
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        try:
            expected = move.checksums[self.rank] if self.verify_checksums else None
            result = self.slab.read(move.disk_slot, view, expected)
        except Exception as exc:  # any I/O failure is a miss; vLLM recomputes
            result = exc
        self._count(bytes_disk_read=len(view), seconds_disk_read=self._clock() - start)
        self._note_io(ok=bool(result) and not isinstance(result, Exception),
                      io_error=isinstance(result, Exception)
                      or getattr(result, "name", "") in ("IO_ERROR", "MISSING"),
                      what=str(result))
        if not result or isinstance(result, Exception):
            self._read_failures += 1
            if getattr(result, "name", "") == "CHECKSUM_MISMATCH":
                self._count(checksum_failures=1)
            else:  # I/O error, slab file missing or cut short
                self._count(disk_read_errors=1)
            if self._read_failures == 1 or self._read_failures % 1000 == 0:
                logger.warning(
                    "kv-offload: disk chunk in slot %d could not be read (%s); its tokens "
                    "are recomputed and the entry is dropped (%d failures so far)",
                    move.disk_slot, result, self._read_failures)
            return False
        return True

    def _read_remote(self, move: ChunkMove) -> bool:
        """Fetch a chunk from the remote tier into its host slot (I/O thread)."""
        if self.remote is None:
            return False
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        result = self.remote.read_into(move.remote_key, self.rank, view,
                                       verify_checksum=self.verify_checksums)
        if result is ValueCheck.OK:
            self._count(bytes_remote_read=len(view), seconds_remote_read=self._clock() - start)
            return True
        if isinstance(result, Exception):
            self._count(remote_errors=1)  # logged once per burst by RemoteHealth
            return False
        self._count(remote_misses=1)
        with self._lock:
            self._remote_misses += 1
            misses = self._remote_misses
        if misses == 1 or misses % 1000 == 0:
            logger.warning(
                "kv-offload: remote chunk unusable (%s: evicted since the lookup, or "
                "written by another format or layout); its tokens are recomputed "
                "(%d so far)", result.value, misses)
        return False

    def _fill_disk(self, read: Future, move: ChunkMove) -> int | None:
        """Write a chunk fetched from the remote tier to its disk slot once ``read``
        succeeded (I/O thread); its checksum, or None."""
        try:
            ok = read.result()
        except Exception:
            ok = False
        if not ok or self.slab is None:
            return None
        return self._write_slot(move.cpu_slot, move.fill_disk_slot)

    def _run_load(self, load: _Load, reads: dict[int, Future]) -> None:
        job = load.job
        ok_rows: list[int] = []
        for i, move in enumerate(job.chunks):
            if move.cpu_slot is None:
                load.failed.add(i)
            elif i in reads:
                if not _succeeded(reads[i]):
                    load.failed.add(i)
                    load.bad_reads.add(i)  # disk or remote: the staged slot is invalid
                else:
                    ok_rows.append(i)
            elif move.after_job is not None:
                if self._wait_staged(move.after_job, move.cpu_slot):
                    ok_rows.append(i)
                else:
                    load.failed.add(i)
            else:
                ok_rows.append(i)
        with self._lock:
            if load.state == _CANCELLED:
                return
            load.state = _COPYING
        if ok_rows:
            slots = np.array([job.chunks[i].cpu_slot for i in ok_rows], dtype=np.int64)
            blocks = np.array([job.chunks[i].block_ids for i in ok_rows], dtype=np.int64)
            try:
                start = self._clock()
                after = {} if load.stream is None else {"after": load.stream}
                self.engine.wait(self.engine.load(slots, blocks, **after))
                self._count(bytes_load=self._chunk_bytes(blocks),
                            seconds_load=self._clock() - start)
            except Exception:
                logger.exception("kv-offload: copying job %d into the engine failed", job.job_id)
                load.failed.update(ok_rows)
        with self._lock:
            load.state = _DONE

    def _wait_staged(self, job_id: int, cpu_slot: int) -> bool:
        entry = self._staged.get((job_id, cpu_slot))
        if entry is None:
            return False
        try:
            return bool(entry[0].result(timeout=self.load_timeout_s))
        except Exception:
            return False

    # -- stores ----------------------------------------------------------------------------

    def run_stores(self, jobs: Sequence[StoreJob]) -> None:
        """Start copying engine blocks to host slots for ``jobs`` (ordered after this
        step's compute), then queue slab and remote writes behind each copy. Never waits
        for a copy: its blocks are protected by ``fence`` and ``hold`` (invariant 3)."""
        for job in jobs:
            slots = np.array([m.cpu_slot for m in job.chunks], dtype=np.int64)
            blocks = np.array([m.block_ids for m in job.chunks], dtype=np.int64)
            start = self._clock()
            handle = self._copies.issue(blocks, slots, job.req_ids)
            # Issue time (the copy runs in the background, or inline on a sync engine).
            self._count(bytes_store=self._chunk_bytes(blocks), seconds_store=self._clock() - start)
            writes: list[Future | None] = []
            for move in job.chunks:
                if move.disk_slot is None or self.slab is None:
                    writes.append(None)
                else:
                    writes.append(self._io.submit(self._write_chunk, handle, move))
            # Remote writes queue behind the local ones: never in the step's critical path.
            remote_writes = [None if m.remote_key is None or self.remote is None
                             else self._io.submit(self._write_remote, handle, m)
                             for m in job.chunks]
            self._stores[job.job_id] = _Store(job, handle, writes, remote_writes)

    def fence(self, req_ids: Sequence[str]) -> None:
        """Order this step's forward after the copies of these (preempted) requests'
        blocks, which vLLM freed and may give to this forward. vLLM's thread."""
        self._copies.fence(req_ids)

    def hold(self, req_ids: Sequence[str]) -> None:
        """The scheduler held these finished requests' blocks: ``poll`` reports each in
        ``finished_sending`` once this rank's copies of its blocks are done."""
        self._copies.hold(req_ids)

    def _write_remote(self, handle: HostCopy, move: ChunkMove) -> bool:
        """Write one chunk to the remote tier (I/O thread); False when it failed or the
        tier is backing off (a skipped store, counted)."""
        try:
            handle.wait()
        except Exception:
            return False
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        if not self.remote.write(move.remote_key, self.rank, view):
            self._count(remote_skipped_stores=1)
            return False
        self._count(bytes_remote_write=len(view), seconds_remote_write=self._clock() - start)
        return True

    def _write_chunk(self, handle: HostCopy, move: ChunkMove) -> int | None:
        """Write one chunk to the slab once its engine copy is done (I/O thread)."""
        try:
            handle.wait()
        except Exception as exc:
            logger.warning("kv-offload: engine copy of a stored chunk failed: %s", exc)
            return None
        return self._write_slot(move.cpu_slot, move.disk_slot)

    def _write_slot(self, cpu_slot: int, disk_slot: int) -> int | None:
        """Write a host slot to a slab slot (I/O thread); its checksum, or None if it
        failed. Any exception is a failed store: a full disk (ENOSPC) only for this
        chunk, any other error also counts towards DISK_BROKEN_AFTER."""
        try:
            view = self.host.slot_view(cpu_slot)
            start = self._clock()
            checksum = self.slab.write(disk_slot, view)
            self._count(bytes_disk_write=len(view), seconds_disk_write=self._clock() - start)
            self._note_io(ok=True, io_error=False, what="")
            with self._lock:
                self._write_burst = False
            return checksum
        except Exception as exc:  # OSError, StorePathError (directory re-creation)...
            per_chunk = isinstance(exc, OSError) and exc.errno not in _BROKEN_ERRNOS
            self._note_io(ok=False, io_error=not per_chunk, what=str(exc))
            with self._lock:
                self._write_errors += 1
                first_of_burst, self._write_burst = not self._write_burst, True
            self._count(disk_write_errors=1)
            if first_of_burst:
                logger.warning(
                    "kv-offload: disk write failed (%s); %d failures so far; the chunk "
                    "stays in the CPU tier only (logged again after writes recover)",
                    exc, self._write_errors)
            return None

    # -- completion ------------------------------------------------------------------------

    def poll(self) -> PollResult:
        """Collect finished work. Loads past ``load_timeout_s`` that are still reading
        are failed now (their blocks reported for recompute); their slots stay pinned on
        the scheduler side until the reads really end."""
        finished: set[str] = set()
        failed_blocks: set[int] = set()
        now = self._clock()
        with self._lock:
            for job_id, load in list(self._loads.items()):
                if load.state == _READING and now - load.started > self.load_timeout_s:
                    load.state = _CANCELLED
                    logger.warning("kv-offload: load job %d timed out after %.1fs; "
                                   "recomputing", job_id, self.load_timeout_s)
                if load.state == _CANCELLED and not load.reported_to_vllm:
                    load.reported_to_vllm = True
                    finished.add(load.job.req_id)
                    failed_blocks.update(_blocks_of(load.job.chunks))
                if load.future is not None and load.future.done():
                    if not load.reported_to_vllm:
                        finished.add(load.job.req_id)
                        failed_blocks.update(
                            _blocks_of(load.job.chunks[i] for i in load.failed))
                    failed = set(range(len(load.job.chunks))) if (
                        load.state == _CANCELLED) else load.failed
                    self._report.loaded[job_id] = {self.rank: frozenset(failed)}
                    if load.bad_reads:
                        self._report.bad_reads[job_id] = {self.rank: frozenset(load.bad_reads)}
                    del self._loads[job_id]
        for job_id, store in list(self._stores.items()):
            if not store.host_reported and store.copy.done():
                store.host_reported = True
                if store.copy.failed():
                    self._log_store_failure(job_id, store.copy)
                    self._report.host_failed[job_id] = 1
                else:
                    self._report.host_stored[job_id] = 1
            if store.host_reported and _all_done(store.writes + store.remote_writes):
                if any(w is not None for w in store.writes):
                    self._report.disk_stored[job_id] = {self.rank: _results(store.writes)}
                if any(w is not None for w in store.remote_writes):
                    self._report.remote_stored[job_id] = {
                        self.rank: tuple(bool(r) for r in _results(store.remote_writes))}
                del self._stores[job_id]
        with self._lock:
            for job_id, fills in list(self._fills.items()):
                if job_id not in self._loads and _all_done(fills):
                    self._report.disk_stored[job_id] = {self.rank: _results(fills)}
                    del self._fills[job_id]
        self._prune_staged(now)
        return PollResult(finished, failed_blocks, self._copies.take_sent())

    def _log_store_failure(self, job_id: int, copy: HostCopy) -> None:
        try:
            copy.wait()
        except Exception:
            logger.exception("kv-offload: copying store job %d to the CPU tier failed; its "
                             "chunks are not stored", job_id)

    def take_report(self) -> WorkerReport | None:
        """The report accumulated since the last call (None when empty)."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return report if report else None

    def _note_io(self, *, ok: bool, io_error: bool, what: str) -> None:
        """Track consecutive I/O errors; past DISK_BROKEN_AFTER the disk is reported broken.
        Checksum mismatches and a full disk (ENOSPC) do not count: they are per chunk."""
        with self._lock:
            if ok:
                self._io_errors_in_a_row = 0
                return
            if not io_error:
                return
            self._io_errors_in_a_row += 1
            if self._io_errors_in_a_row >= DISK_BROKEN_AFTER and not self._disk_broken_reported:
                self._disk_broken_reported = True
                self._report.disk_broken = f"rank {self.rank}: {what}"

    def take_stats(self) -> dict[str, float]:
        """Counter deltas since the last call (names of ``kv_offload.metrics.COUNTERS``)."""
        with self._lock:
            stats, self._stats = self._stats, {}
        return stats

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._stats[name] = self._stats.get(name, 0) + value

    def has_pending_jobs(self) -> bool:
        return bool(self._loads or self._stores or self._fills or self._copies.num_pending())

    def _prune_staged(self, now: float) -> None:
        for key, (fut, t0) in list(self._staged.items()):
            if fut.done() and now - t0 > STAGED_READ_TTL_S:
                del self._staged[key]

    def _chunk_bytes(self, blocks: np.ndarray) -> int:
        per_block = self.host.slot_bytes // max(1, blocks.shape[1]) if blocks.size else 0
        return int((blocks != SKIP_BLOCK).sum()) * per_block

    def close(self, *, timeout_s: float = 30.0) -> None:
        """Finish queued disk and remote writes (bounded by ``timeout_s``), then stop."""
        deadline = self._clock() + timeout_s
        self._copies.close()  # copies already issued finish (the writes read them)
        pending = [w for s in list(self._stores.values()) for w in s.writes + s.remote_writes]
        pending += [f for fills in list(self._fills.values()) for f in fills]
        for w in pending:
            if w is not None:
                with contextlib.suppress(Exception):
                    w.result(timeout=max(0.0, deadline - self._clock()))
        self._io.shutdown(wait=False, cancel_futures=True)
        self._copier.shutdown(wait=False, cancel_futures=True)
        if self.slab is not None:
            self.slab.close()
        if self.remote is not None:
            self.remote.close()
        self.engine.close()


def _when_all_done(futures: Sequence[Future], fn: Callable[[], None]) -> None:
    """Call ``fn()`` once every future is done: at once if none is pending, else on the
    thread that completes the last one."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        fn()
        return
    left, lock = [len(pending)], threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            fn()

    for future in pending:
        future.add_done_callback(one_done)


def _succeeded(read: Future) -> bool:
    """Whether a done read future returned success (an exception is a failed read)."""
    try:
        return bool(read.result())
    except Exception:
        return False


def _all_done(futures: Sequence[Future | None]) -> bool:
    return all(f is None or f.done() for f in futures)


def _results(futures: Sequence[Future | None]) -> tuple:
    """Results of done futures, None for absent ones (their functions never raise)."""
    return tuple(None if f is None else f.result() for f in futures)


def _blocks_of(moves: Any) -> set[int]:
    return {b for m in moves for b in m.block_ids if b != SKIP_BLOCK}
