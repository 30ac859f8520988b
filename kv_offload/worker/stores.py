"""WorkerStores: one rank's store jobs, from the engine copy to the last tier write.

A store job's engine -> host copy is issued through ``HostCopies`` (never waited for in the
step); its slab writes (``SlabWrites``) and remote writes queue behind that copy on the
worker's I/O threads. ``collect`` moves what ended into the scheduler's ``WorkerReport``:
the host copy first (the CPU tier can serve the chunk), then each tier's results once all
of the job's writes are done. vLLM's worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from kv_offload.jobs import SKIP_BLOCK, ChunkMove, StoreJob, WorkerReport

if TYPE_CHECKING:
    from kv_offload.host_buffer import HostSlots
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
    remote_writes: list[Future[bool] | None]
    host_reported: bool = False


class WorkerStores:
    """The store jobs of one rank in flight. ``submit(fn, *args)`` queues I/O work (the
    worker's I/O pool); ``count(**deltas)`` adds to the worker's counters."""

    def __init__(self, *, rank: int, host: HostSlots, copies: HostCopies,
                 writes: SlabWrites | None, remote: RemoteTier | None,
                 submit: Callable[..., Future[Any]], count: Callable[..., None],
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

    def run(self, jobs: Sequence[StoreJob]) -> None:
        """Issue each job's engine copy (ordered after this step's compute) and queue its
        slab and remote writes behind it. Never waits for a copy."""
        for job in jobs:
            slots = np.array([m.cpu_slot for m in job.chunks], dtype=np.int64)
            blocks = np.array([m.block_ids for m in job.chunks], dtype=np.int64)
            start = self._clock()
            handle = self._copies.issue(blocks, slots, job.req_ids)
            # Issue time (the copy runs in the background, or inline on a sync engine).
            self._count(bytes_store=chunk_bytes(blocks, self.host.slot_bytes),
                        seconds_store=self._clock() - start)
            writes = self._queue_disk_writes(handle, job.chunks)
            # Remote writes queue behind the local ones: never in the step's critical path.
            remote_writes = [None if m.remote_key is None or self.remote is None
                             else self._submit(self._write_remote, handle, m)
                             for m in job.chunks]
            self._stores[job.job_id] = _Store(job, handle, writes, remote_writes)

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

    def _queue_disk_writes(self, handle: HostCopy, chunks: Sequence[ChunkMove]
                           ) -> list[Future[int | None] | None]:
        """Queue the slab writes of a job's chunks behind its engine copy, in tasks of
        ``SlabWrites.chunks_per_task``; one future per chunk (None: no disk slot), its
        checksum or None when the write failed."""
        writes: list[Future[int | None] | None] = [None] * len(chunks)
        if self._writes is None:
            return writes
        rows = [(i, (m.cpu_slot, m.disk_slot)) for i, m in enumerate(chunks)
                if m.cpu_slot is not None and m.disk_slot is not None]
        per_task = self._writes.chunks_per_task()
        for start in range(0, len(rows), per_task):
            task = rows[start : start + per_task]
            futures: list[Future[int | None]] = [Future() for _ in task]
            for (i, _), future in zip(task, futures):
                writes[i] = future
            self._submit(self._writes.write_after_copy, handle, [p for _, p in task], futures)
        return writes

    def _write_remote(self, handle: HostCopy, move: ChunkMove) -> bool:
        """Write one chunk to the remote tier (I/O thread); False when it failed or the
        tier is backing off (a skipped store, counted)."""
        try:
            handle.wait()
        except Exception:
            return False
        if self.remote is None or move.cpu_slot is None or move.remote_key is None:
            return False  # never queued so
        view = self.host.slot_view(move.cpu_slot)
        start = self._clock()
        if not self.remote.write(move.remote_key, self.rank, view):
            self._count(remote_skipped_stores=1)
            return False
        self._count(bytes_remote_write=len(view), seconds_remote_write=self._clock() - start)
        return True


def _log_store_failure(job_id: int, copy: HostCopy) -> None:
    try:
        copy.wait()
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
