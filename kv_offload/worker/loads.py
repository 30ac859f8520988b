"""One load job on a worker: its phase (reading, copying, done or cancelled) and results.

A load is READING while its disk and remote reads (and the reads of jobs it shares
chunks with) run; its engine copy moves it to COPYING, then DONE. A load still READING
past the worker's timeout, or when vLLM takes the KV cache away (the worker's pause), is
CANCELLED: all its blocks are reported failed at once and its copy never runs. The
worker changes a load's phase under its own lock only. With a synchronous engine (the CPU
backend) the chunks already read of a READING load may be copied before the rest
(``copied``); the copy then takes the others.
"""

from __future__ import annotations

import enum
import itertools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob

LANDED_COPY_MIN_BYTES = 4 << 20
"""Fewest bytes of read chunks (or a quarter of the load's reads, if less) a synchronous
engine copies while their load still reads (``LandedChunks``): fewer copy calls, each of
which holds the GIL the I/O threads need between their reads."""


class WorkerLoadPhase(enum.Enum):
    """Where a load job is on one rank (the planner's ``LoadPhase`` is another machine)."""

    READING = "reading"  # disk / remote reads in flight; the engine copy is not queued
    COPYING = "copying"  # the engine copy runs on the copy thread
    DONE = "done"  # the copy ended (well or not): ``failed`` is final
    CANCELLED = "cancelled"  # timed out or paused while reading: every chunk failed, no copy


@dataclass(slots=True)
class WorkerLoad:
    """A load job in flight on one rank."""

    job: LoadJob
    started: float  # worker clock when the job was handed out
    mark: object | None = None  # engine.compute_mark() when vLLM handed it out: copy after it
    future: Future[None] | None = None  # the engine copy on the copy thread, once queued
    phase: WorkerLoadPhase = WorkerLoadPhase.READING
    failed: set[int] = field(default_factory=set)  # chunk indexes not loaded
    bad_reads: set[int] = field(default_factory=set)  # staged reads that failed
    copied: set[int] = field(default_factory=set)  # copied while the job still read
    reported_to_vllm: bool = False

    def sort_rows(self, reads: dict[int, Future[bool]],
                  wait_staged: Callable[[int, int], bool]) -> list[int]:
        """The chunk indexes to copy into the engine, once this job's reads are done;
        marks the others failed (and failed reads bad). ``wait_staged(job, slot)``
        waits for the read of a job this one shares a chunk with. Copy thread."""
        ok_rows: list[int] = []
        for i, move in enumerate(self.job.chunks):
            if move.cpu_slot is None:
                self.failed.add(i)
            elif i in reads:
                if succeeded(reads[i]):
                    ok_rows.append(i)
                else:
                    self.failed.add(i)
                    self.bad_reads.add(i)  # disk or remote: the staged slot is invalid
            elif move.after_job is not None and not wait_staged(move.after_job, move.cpu_slot):
                self.failed.add(i)
            else:
                ok_rows.append(i)
        return ok_rows

    def same_step_rows(self) -> list[int]:
        """The chunk indexes a same-step load copies (in a CPU slot, nothing to read);
        marks the others failed."""
        chunks = self.job.chunks
        rows = [i for i, m in enumerate(chunks)
                if m.cpu_slot is not None and m.source is None]
        self.failed.update(set(range(len(chunks))) - set(rows))
        return rows

    def landed_rows(self, reads: dict[int, Future[bool]], at_least: int = 1) -> list[int]:
        """The chunk indexes whose own read succeeded and that were not copied yet, while
        the job still reads others, if there are ``at_least`` of them; marks them copied
        (the caller copies them now)."""
        if self.phase is not WorkerLoadPhase.READING:
            return []
        rows = [i for i, read in reads.items()
                if i not in self.copied and read.done() and succeeded(read)]
        if len(rows) < at_least:
            return []
        self.copied.update(rows)
        return rows

    def copy_arrays(self, rows: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Host slots and engine blocks of these chunks, for ``CopyEngine.load``."""
        chunks = self.job.chunks
        return (np.array([chunks[i].cpu_slot for i in rows], dtype=np.int64),
                np.array([chunks[i].block_ids for i in rows], dtype=np.int64))

    def take_mark(self) -> object | None:
        """The compute mark, for ``CopyEngine.release_mark`` (None from then on)."""
        mark, self.mark = self.mark, None
        return mark

    def begin_copy(self) -> bool:
        """READING -> COPYING; False (no change) when the load was cancelled meanwhile."""
        if self.phase is WorkerLoadPhase.CANCELLED:
            return False
        self.phase = WorkerLoadPhase.COPYING
        return True

    def end_copy(self) -> None:
        """COPYING -> DONE: the engine copy ended (its failures are in ``failed``)."""
        self.phase = WorkerLoadPhase.DONE

    def cancel(self) -> bool:
        """READING -> CANCELLED (its copy will never run); whether it was cancelled now."""
        if self.phase is WorkerLoadPhase.READING:
            self.phase = WorkerLoadPhase.CANCELLED
            return True
        return False

    def cancel_if_overdue(self, now: float, timeout_s: float) -> bool:
        """READING -> CANCELLED when the load has read for more than ``timeout_s``;
        whether it was cancelled now."""
        return now - self.started > timeout_s and self.cancel()

    def copy_ended(self) -> bool:
        """The copy thread is finished with this load (copied, failed or cancelled)."""
        return self.future is not None and self.future.done()

    def ended(self) -> bool:
        """Copied, failed or cancelled: ``take_failed_blocks`` has an answer."""
        return self.phase is WorkerLoadPhase.CANCELLED or self.copy_ended()

    def take_failed_blocks(self) -> set[int] | None:
        """The engine blocks to report failed to vLLM with the request's completion, once:
        all of them when cancelled, those of failed chunks when the copy ended; None
        before either, and after they were taken."""
        if self.reported_to_vllm:
            return None
        if self.phase is WorkerLoadPhase.CANCELLED:
            moves: Iterable[ChunkMove] = self.job.chunks
        elif self.copy_ended():
            moves = (self.job.chunks[i] for i in self.failed)
        else:
            return None
        self.reported_to_vllm = True
        return {b for m in moves for b in m.block_ids if b != SKIP_BLOCK}

    def failed_rows(self) -> frozenset[int]:
        """The chunk indexes reported to the scheduler as not loaded (all when cancelled)."""
        if self.phase is WorkerLoadPhase.CANCELLED:
            return frozenset(range(len(self.job.chunks)))
        return frozenset(self.failed)


class LandedChunks:
    """The loads still reading whose chunks a synchronous engine copies as their reads
    land (``OffloadWorker._copy_landed``). Not thread-safe: the worker's lock guards it."""

    def __init__(self, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self._batch = max(1, LANDED_COPY_MIN_BYTES // slot_bytes)
        self._loads: dict[int, tuple[WorkerLoad, dict[int, Future[bool]]]] = {}

    def batch(self, num_reads: int) -> int:
        """How many read chunks of a load of ``num_reads`` reads are copied at once."""
        return min(self._batch, max(1, num_reads // 4))

    def waker(self, job: LoadJob, progress: threading.Event) -> Callable[[Future], None]:
        """A done-callback for ``job``'s reads (any thread) that sets ``progress`` at each
        batch of them, not at every read: each wake-up takes the GIL from the I/O threads."""
        every = self.batch(sum(m.source is not None and m.cpu_slot is not None
                               for m in job.chunks))
        landed = itertools.count(1)  # next() is atomic under the GIL

        def wake(_: Future) -> None:
            if next(landed) % every == 0:
                progress.set()
        return wake

    def add(self, load: WorkerLoad, reads: dict[int, Future[bool]]) -> None:
        self._loads[load.job.job_id] = (load, reads)

    def discard(self, job_id: int) -> None:
        """The load's reads are all done: its copy takes the rest."""
        self._loads.pop(job_id, None)

    def take(self, budget: int) -> list[tuple[WorkerLoad, list[int]]]:
        """The chunks to copy now, up to about ``budget`` bytes: of each load, those read
        and not copied yet, once there are ``LANDED_COPY_MIN_BYTES`` of them or a quarter
        of the load's reads; marks them copied."""
        out: list[tuple[WorkerLoad, list[int]]] = []
        size = 0
        for load, reads in self._loads.values():
            if size >= budget:
                break
            if rows := load.landed_rows(reads, self.batch(len(reads))):
                out.append((load, rows))
                size += len(rows) * self.slot_bytes
        return out


def completed() -> Future[None]:
    """A future that is already done (for a copy made on the calling thread)."""
    done: Future[None] = Future()
    done.set_result(None)
    return done


def when_all_done(futures: Sequence[Future], fn: Callable[[], None]) -> None:
    """Call ``fn()`` once every future is done: at once if none is pending, else on the
    thread that completes the last one. The futures keep no reference to ``fn`` after
    it ran: it usually holds them (a load's reads), and such a cycle would leave the load,
    its compute mark (a CUDA event) included, to the garbage collector."""
    pending = [f for f in futures if not f.done()]
    if not pending:
        fn()
        return
    lock = threading.Lock()
    left: int = len(pending)
    call: Callable[[], None] | None = fn

    def one_done(_: Future) -> None:
        nonlocal left, call
        with lock:
            left -= 1
            run, call = (call, None) if left == 0 else (None, call)
        if run is not None:
            run()

    for future in pending:
        future.add_done_callback(one_done)


def succeeded(read: Future[bool]) -> bool:
    """Whether a done read future returned success (an exception is a failed read)."""
    try:
        return bool(read.result())
    except Exception:
        return False


@dataclass(slots=True)
class StagedRead:
    """A read into a host slot that later jobs sharing the chunk wait for (``after_job``);
    the worker keeps it until ``STAGED_READ_TTL_S`` after the first poll that saw it end."""

    read: Future[bool]
    ended: float | None = None

    def succeeded(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the read; whether it filled the slot."""
        try:
            return bool(self.read.result(timeout=timeout_s))
        except Exception:  # failed, or still reading
            return False
