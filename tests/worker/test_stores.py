"""WorkerStores: what a store job reports, and when, as its copy and writes end.

The scheduler publishes a chunk in the CPU tier on ``host_stored`` and commits it on disk
on its disk results (``written``); reporting either too early would serve bytes that are not there yet.
Here the engine copy runs behind a gate (as a CUDA copy runs behind the step), and the
wait for it and the I/O tasks run only when the test says so. No write is queued before
its copy ended: an I/O thread waiting for a copy holds up the reads of loads.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from kv_offload.checksum import checksum
from kv_offload.copy import make_copy_engine
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.disk import SlabFile
from kv_offload.disk.io import DiskIO
from kv_offload.jobs import ChunkMove, StoreJob, WorkerReport
from kv_offload.testing.tiers import written_to
from kv_offload.tier_contract import Place
from kv_offload.worker.host_copies import HostCopies
from kv_offload.worker.stores import WorkerStores

NUM_BLOCKS, PLANE_BYTES, BPC = 8, 64, 2
SLOT_BYTES = PLANE_BYTES * BPC


class ManualIO:
    """An I/O pool (or waiter thread) whose tasks run when ``run_all`` is called."""

    def __init__(self) -> None:
        self.tasks: list[tuple[Future, object, tuple]] = []

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self.tasks.append((future, fn, args))
        return future

    def run_all(self) -> None:
        tasks, self.tasks = self.tasks, []
        for future, fn, args in tasks:
            future.set_result(fn(*args))


class GatedEngine:
    """A real engine whose store copies count as done only once ``gate`` is set (the
    bytes are copied at once; ``is_done``/``wait`` follow the gate), or that fails."""

    def __init__(self, engine, *, fail: bool = False) -> None:
        self.unfaulty, self.fail, self.gate = engine, fail, threading.Event()

    def store(self, block_ids, slots):
        if self.fail:
            raise RuntimeError("injected store copy failure")
        return self.unfaulty.store(block_ids, slots)

    def is_done(self, handle) -> bool:
        return self.gate.is_set() and self.unfaulty.is_done(handle)

    def wait(self, handle) -> None:
        assert self.gate.wait(5), "the test never opened the gate"
        self.unfaulty.wait(handle)


@pytest.fixture
def parts(tmp_path):
    gen = torch.Generator().manual_seed(1)
    planes = [torch.randint(0, 256, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.uint8,
                            generator=gen)]
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    slab = SlabFile(tmp_path, namespace_id="cd" * 16, rank=0, num_ranks=1,
                    slot_bytes=SLOT_BYTES)
    yield planes, host, slab
    slab.close()


def make_stores(parts, *, fail: bool = False):
    planes, host, slab = parts
    engine = GatedEngine(make_copy_engine(planes, host, BPC), fail=fail)
    io, waits = ManualIO(), ManualIO()
    disk = DiskIO(slab, slot_bytes=SLOT_BYTES)
    copies = HostCopies(engine, background=False, waiter=waits)
    stores = WorkerStores(rank=0, host=host, copies=copies, tiers={"disk": disk},
                          submit=io.submit, count=lambda _: None, clock=lambda: 0.0)
    return stores, engine, io, waits


JOB = StoreJob(7, (ChunkMove((1, 2), 0, sinks=(Place("disk", 3),)),
                   ChunkMove((5, 4), 1, sinks=(Place("disk", 6),))), req_ids=("r", "r"))


def test_the_host_copy_is_reported_when_done_and_the_disk_once_every_write_ended(parts):
    planes, host, slab = parts
    stores, engine, io, waits = make_stores(parts)
    stores.run([JOB])
    report = WorkerReport()
    stores.collect(report)
    assert not report, "nothing is reported while the copy runs"
    assert len(stores.pending_writes()) == 2
    assert io.tasks == [], "no write is queued while its copy runs"

    engine.gate.set()
    waits.run_all()  # the waiter thread sees the copy end and queues the writes
    assert len(io.tasks) == 1  # both chunks in one task
    stores.collect(report)
    assert report.host_stored == {7: 1} and not written_to(report, "disk"), "writes still queued"

    io.run_all()
    stores.collect(report)
    expected = tuple(checksum(planes[0][list(ids)].numpy().tobytes())
                     for ids in ((1, 2), (5, 4)))
    assert written_to(report, "disk") == {7: {0: expected}}
    buf = np.empty(SLOT_BYTES, np.uint8)
    assert slab.read(6, buf, expected[1]) and bytes(buf) == planes[0][[5, 4]].numpy().tobytes()
    assert len(stores) == 0 and stores.pending_writes() == []


def test_a_failed_copy_is_reported_and_its_disk_slots_come_back_unwritten(parts):
    slab = parts[2]
    stores, _, io, _ = make_stores(parts, fail=True)
    stores.run([JOB])
    report = WorkerReport()
    stores.collect(report)
    assert report.host_failed == {7: 1} and not report.host_stored
    assert io.tasks == [], "nothing is written behind a failed copy"
    stores.collect(report)
    assert written_to(report, "disk") == {7: {0: (None, None)}}
    assert os.path.getsize(slab.path) == 0, "nothing was written"
    assert len(stores) == 0


def test_a_copy_whose_engine_cannot_say_it_ended_settles_its_writes_as_failed():
    """A device error raised by the engine's completion query (``is_done``) left the
    store's writes unsettled: the job was never reported, its slots never released and
    the engine never idle. Now the writes are settled as not written."""
    from kv_offload.copy.base import CopyHandle
    from kv_offload.copy.plan import Direction
    from kv_offload.worker.host_copies import HostCopy

    class BrokenEngine:
        def is_done(self, handle):
            raise RuntimeError("cudaErrorIllegalAddress")

    future: Future = Future()
    future.set_result(CopyHandle(1, Direction.STORE))
    copies = HostCopies(BrokenEngine(), background=False)  # type: ignore[arg-type]
    outcomes: list[bool] = []
    try:
        copies.when_done(HostCopy(BrokenEngine(), future), outcomes.append)  # type: ignore[arg-type]
    finally:
        copies.close()
    assert outcomes == [False]
