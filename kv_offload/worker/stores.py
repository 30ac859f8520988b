"""WorkerStores: one rank's store jobs, from the engine copy to the last tier write.

A store job's engine -> host copy is issued through ``HostCopies`` (never waited for in the
step); once it has ended (``HostCopies.when_done``), its slab writes (``SlabWrites``) and
remote writes are queued on the worker's write lane, so that no I/O thread waits for a
device copy and no read for a load waits behind a store. ``collect`` moves what ended
into the scheduler's ``WorkerReport``: the host copy first (the CPU tier can serve the
chunk), then each tier's results once all of the job's writes are done. vLLM's worker
thread only, except the ``when_done`` callbacks (the store or waiter thread).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kv_offload.counters import WorkerCounters
from kv_offload.jobs import SKIP_BLOCK, ChunkMove, StoreJob, WorkerReport
from kv_offload.worker.host_copies import ComputedOnFailedLoadError, KVCacheReleasedError

if TYPE_CHECKING:
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.remote.tier import RemoteTier
    from kv_offload.worker.host_copies import HostCopies, HostCopy
    from kv_offload.worker.writes import SlabWrites

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Store:
    job: StoreJob
    copy: HostCopy
    writes: list[Future[int | None] | None]  # slab writes: checksum or None
    remote_writes: list[Future[bool | None] | None]  # None: not written
    host_reported: bool = False


@dataclass(frozen=True, slots=True)
class _WriteTask:
    """One write-lane task of a store job: ``fn(*args)`` returns one result per future."""

    fn: Callable[..., Sequence[Any]]
    args: tuple[Any, ...]
    futures: list[Future[Any]]


class WorkerStores:
    """The store jobs of one rank in flight. ``submit(fn, *args)`` queues write work (the
    worker's write lane; called from the store or waiter thread too); ``count(deltas)``
    adds to the worker's counters (``kv_offload.counters.WorkerCounters``)."""

    def __init__(self, *, rank: int, host: HostSlots, copies: HostCopies,
                 writes: SlabWrites | None, remote: RemoteTier | None,
                 submit: Callable[..., Future[Any]], count: Callable[[WorkerCounters], None],
                 clock: Callable[[], float]) -> None:
        self.rank = rank
        self.host = host
        self.remote = remote
        self._copies = copies
        self._writes = writes
        self._submit = submit
        self._count = count
        self._clock = clock
        self._stores: dict[int, _Store] = {}

    def __len__(self) -> int:
        return len(self._stores)

    def run(self, jobs: Sequence[StoreJob], *, discard: bool = False) -> None:
        """Issue each job's engine copy (ordered after this step's compute); its slab and
        remote writes are queued once the copy has ended. Never waits for a copy.
        ``discard``: the step's forward read a same-step load that failed; each job fails
        at once without reading a block (reported failed: never published)."""
        for job in jobs:
            slots = np.array([m.cpu_slot for m in job.chunks], dtype=np.int64)
            blocks = np.array([m.block_ids for m in job.chunks], dtype=np.int64)
            start = self._clock()
            handle = (self._copies.refused(ComputedOnFailedLoadError(
                "this step's forward read a same-step load that failed")) if discard
                else self._copies.issue(blocks, slots, job.req_ids, audited=job.audited))
            if not discard:  # issue time (the copy runs in the background, or inline)
                self._count(WorkerCounters(
                    bytes_store=chunk_bytes(blocks, self.host.slot_bytes),
                    seconds_store=self._clock() - start))
            tasks, writes = self._disk_write_tasks(job.chunks)
            remote_writes: list[Future[bool | None] | None] = [None] * len(job.chunks)
            for i, move in enumerate(job.chunks):  # queued behind the local ones
                if move.remote_key is not None and self.remote is not None:
                    future: Future[bool | None] = Future()
                    remote_writes[i] = future
                    tasks.append(_WriteTask(self._write_remote, (move,), [future]))
            self._stores[job.job_id] = _Store(job, handle, writes, remote_writes)
            if tasks:
                self._copies.when_done(handle, functools.partial(self._queue_writes, tasks))

    def collect(self, report: WorkerReport) -> None:
        """Add what ended since the last call to ``report``: host copies done or failed,
        then, once all of a job's writes ended, its disk checksums and remote results."""
        for job_id, store in list(self._stores.items()):
            if not store.host_reported and store.copy.done():
                store.host_reported = True
                if store.copy.failed():
                    _log_store_failure(job_id, store.copy)
                    report.host_failed[job_id] = 1
                else:
                    report.host_stored[job_id] = 1
            if store.host_reported and all_done(store.writes + store.remote_writes):
                if any(w is not None for w in store.writes):
                    report.disk_stored[job_id] = {self.rank: results(store.writes)}
                if any(w is not None for w in store.remote_writes):
                    report.remote_stored[job_id] = {
                        self.rank: tuple(bool(r) for r in results(store.remote_writes))}
                del self._stores[job_id]

    def pending_writes(self) -> list[Future[Any]]:
        """The tier writes not yet collected (``close`` lets them finish)."""
        return [w for s in list(self._stores.values()) for w in s.writes + s.remote_writes
                if w is not None]

    def _disk_write_tasks(self, chunks: Sequence[ChunkMove]
                          ) -> tuple[list[_WriteTask], list[Future[int | None] | None]]:
        """The slab writes of a job's chunks, in tasks of ``SlabWrites.chunks_per_task``,
        and one future per chunk (None: no disk slot): its checksum, or None when it was
        not written."""
        writes: list[Future[int | None] | None] = [None] * len(chunks)
        tasks: list[_WriteTask] = []
        if self._writes is None:
            return tasks, writes
        rows = [(i, (m.cpu_slot, m.disk_slot)) for i, m in enumerate(chunks)
                if m.cpu_slot is not None and m.disk_slot is not None]
        per_task = self._writes.chunks_per_task()
        for start in range(0, len(rows), per_task):
            task = rows[start : start + per_task]
            futures: list[Future[int | None]] = [Future() for _ in task]
            for (i, _), future in zip(task, futures):
                writes[i] = future
            tasks.append(_WriteTask(self._writes.write_chunks, ([p for _, p in task],),
                                    list(futures)))
        return tasks, writes

    def _queue_writes(self, tasks: list[_WriteTask], copied: bool) -> None:
        """Queue ``tasks`` on the write lane now that their copy has ended (vLLM's, the
        store or the waiter thread); a failed copy, or a lane shut down, writes nothing."""
        for task in tasks:
            if not copied:
                _settle(task.futures, None)
                continue
            try:
                done = self._submit(task.fn, *task.args)
            except RuntimeError:  # the lane was shut down (close() past its deadline)
                _settle(task.futures, None)
                continue
            done.add_done_callback(functools.partial(_spread, task.futures))

    def _write_remote(self, move: ChunkMove) -> list[bool]:
        """Write one chunk to the remote tier (write lane, its copy done); [False] when it
        failed or the tier is backing off (a skipped store, counted)."""
        if self.remote is None or move.cpu_slot is None or move.remote_key is None:
            return [False]  # never queued so
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        if not self.remote.write(move.remote_key, self.rank, view):
            self._count(WorkerCounters(remote_skipped_stores=1))
            return [False]
        self._count(WorkerCounters(bytes_remote_write=len(view),
                                   seconds_remote_write=self._clock() - start))
        return [True]


def _spread(futures: list[Future[Any]], done: Future[Sequence[Any]]) -> None:
    """Give each of ``futures`` its result of the write-lane task ``done`` (None for all
    when it raised or was cancelled)."""
    values: Sequence[Any] = [None] * len(futures)
    if not done.cancelled():  # cancelled: close() went past its deadline
        try:
            values = done.result()
        except Exception:  # a bug: these chunks are not written, nothing else is affected
            logger.exception("kv-offload: a write of stored chunks failed")
    for future, value in zip(futures, values):
        if not future.done():
            future.set_result(value)


def _settle(futures: list[Future[Any]], value: Any) -> None:
    for future in futures:
        if not future.done():
            future.set_result(value)


def _log_store_failure(job_id: int, copy: HostCopy) -> None:
    try:
        copy.wait()
    except KVCacheReleasedError:  # planned before the scheduler learned of the pause
        logger.debug("kv-offload: store job %d came while vLLM had released the KV cache; "
                     "its chunks are not stored", job_id)
    except ComputedOnFailedLoadError:
        logger.info("kv-offload: store job %d not stored: this step's forward read a "
                    "same-step load that failed (vLLM recomputes those tokens)", job_id)
    except Exception:
        logger.exception("kv-offload: copying store job %d to the CPU tier failed; its "
                         "chunks are not stored", job_id)


def chunk_bytes(blocks: np.ndarray, slot_bytes: int) -> int:
    """Bytes of the engine blocks in ``blocks`` (chunks x blocks; SKIP_BLOCK not counted)."""
    per_block = slot_bytes // max(1, blocks.shape[1]) if blocks.size else 0
    return int((blocks != SKIP_BLOCK).sum()) * per_block


def all_done(futures: Sequence[Future | None]) -> bool:
    return all(f is None or f.done() for f in futures)


def results(futures: Sequence[Future[T] | None]) -> tuple[T | None, ...]:
    """Results of done futures, None for absent ones (their functions never raise)."""
    return tuple(None if f is None else f.result() for f in futures)
