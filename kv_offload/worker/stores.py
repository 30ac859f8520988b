"""WorkerStores: one rank's store jobs, from the engine copy to the last tier write.

A store job's engine -> host copy is issued through ``HostCopies`` (never waited for in the
step); once it has ended (``HostCopies.when_done``), its writes to its chunks' sinks
(``tier_contract.TierIO``, in batches of each tier's ``write_batch``) are queued on the
worker's write lane, so that no I/O thread waits for a device copy and no read for a load
waits behind a store. ``collect`` moves what ended
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
from kv_offload.tier_contract import Place, TierIO
from kv_offload.worker.host_copies import ComputedOnFailedLoadError, KVCacheReleasedError
from kv_offload.worker.loads import succeeded

if TYPE_CHECKING:
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.worker.host_copies import HostCopies, HostCopy

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class _Store:
    job: StoreJob
    copy: HostCopy
    writes: dict[str, list[Future[object | None] | None]]  # tier -> per chunk (None: no sink)
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
                 tiers: dict[str, TierIO], submit: Callable[..., Future[Any]],
                 count: Callable[[WorkerCounters], None], clock: Callable[[], float]) -> None:
        self.rank = rank
        self.host = host
        self.tiers = tiers
        self._copies = copies
        self._submit = submit
        self._count = count
        self._clock = clock
        self._stores: dict[int, _Store] = {}

    def __len__(self) -> int:
        return len(self._stores)

    def run(self, jobs: Sequence[StoreJob], *, discard: bool = False) -> None:
        """Issue each job's engine copy (ordered after this step's compute); its writes to
        its sinks' tiers are queued once the copy has ended. Never waits for a copy.
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
            tasks, writes = self.write_tasks(job.chunks)
            self._stores[job.job_id] = _Store(job, handle, writes)
            if tasks:
                self._copies.when_done(handle, functools.partial(self._queue_writes, tasks))

    def collect(self, report: WorkerReport) -> None:
        """Add what ended since the last call to ``report``: host copies done or failed,
        then, once all of a job's writes ended, each tier's results."""
        for job_id, store in list(self._stores.items()):
            if not store.host_reported and store.copy.done():
                store.host_reported = True
                if store.copy.failed():
                    _log_store_failure(job_id, store.copy)
                    report.host_failed[job_id] = 1
                else:
                    report.host_stored[job_id] = 1
            if store.host_reported and all(all_done(w) for w in store.writes.values()):
                if store.writes:
                    report.written[job_id] = {tier: {self.rank: results(w)}
                                              for tier, w in store.writes.items()}
                del self._stores[job_id]

    def pending_writes(self) -> list[Future[Any]]:
        """The tier writes not yet collected (``close`` lets them finish)."""
        return [w for s in list(self._stores.values()) for ws in s.writes.values() for w in ws
                if w is not None]

    def write_tasks(self, chunks: Sequence[ChunkMove]
                    ) -> tuple[list[_WriteTask], dict[str, list[Future[object | None] | None]]]:
        """The writes of a job's chunks to their sinks, per tier in tasks of its
        ``write_batch`` chunks (in the order of the job's sinks: the disk's before the
        remote's), and per tier one future per chunk (None: no sink there): the tier's
        result, or None when it was not written. A sink of a tier this rank lacks is
        reported not written."""
        writes: dict[str, list[Future[object | None] | None]] = {}
        tasks: list[_WriteTask] = []
        names = list(dict.fromkeys(p.tier for m in chunks for p in m.sinks))
        for name in names:
            per_chunk: list[Future[object | None] | None] = [None] * len(chunks)
            rows = [(i, m.cpu_slot, p.address) for i, m in enumerate(chunks)
                    for p in m.sinks if p.tier == name and m.cpu_slot is not None]
            tier = self.tiers.get(name)
            batch = tier.write_batch if tier is not None else max(1, len(rows))
            for start in range(0, len(rows), batch):
                task = rows[start:start + batch]
                futures: list[Future[object | None]] = [Future() for _ in task]
                for (i, _, _), future in zip(task, futures):
                    per_chunk[i] = future
                if tier is None:
                    _settle(futures, None)
                    continue
                tasks.append(_WriteTask(self.write_to, (tier, [r[1] for r in task],
                                                      [r[2] for r in task]), list(futures)))
            writes[name] = per_chunk
        return tasks, writes

    def write_to(self, tier: TierIO, cpu_slots: list[int], addresses: list[Any]
                 ) -> list[object | None]:
        """Write host slots to a tier (write lane, their copy done)."""
        return tier.write(addresses, [self.host.slot_view(c) for c in cpu_slots])

    def fill_after(self, read: Future[bool], cpu_slot: int, sink: Place
                   ) -> Future[object | None]:
        """Write a chunk read from a later tier to ``sink`` (an earlier tier, e.g. the
        local disk): queued on the write lane once ``read`` succeeded (no thread waits
        for the read). Its future: the tier's result, or None when it was not written."""
        fill: Future[object | None] = Future()
        tier = self.tiers.get(sink.tier)

        def written(done: Future[list[object | None]]) -> None:
            results = [] if done.cancelled() or done.exception() else list(done.result())
            fill.set_result(results[0] if len(results) == 1 else None)

        def queue(ended: Future[bool]) -> None:
            if tier is None or not succeeded(ended):
                fill.set_result(None)
                return
            try:
                self._submit(self.write_to, tier, [cpu_slot],
                             [sink.address]).add_done_callback(written)
            except RuntimeError:  # shut down by close()
                fill.set_result(None)

        read.add_done_callback(queue)
        return fill

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


def _spread(futures: list[Future[Any]], done: Future[Sequence[Any]]) -> None:
    """Give each of ``futures`` its result of the write-lane task ``done`` (None for all
    when it raised or was cancelled)."""
    values: Sequence[Any] = [None] * len(futures)
    if not done.cancelled():  # cancelled: close() went past its deadline
        try:
            values = list(done.result())
        except Exception:  # a bug: these chunks are not written, nothing else is affected
            logger.exception("kv-offload: a write of stored chunks failed")
    if len(values) != len(futures):  # a tier's bug: no result is trusted
        logger.error("kv-offload: a tier answered %d results for %d written chunks; they "
                     "count as not written", len(values), len(futures))
        values = [None] * len(futures)
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
