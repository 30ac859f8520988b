"""OffloadWorker.pause/resume: vLLM takes the KV cache away and gives it back (issue 32).

vLLM 0.33+ calls ``unregister_kv_caches`` before it releases the KV cache memory and
``restore_kv_caches`` once it is back. Regression scenarios: the worker used to close
itself on the first, so copies in flight could still touch released memory, loads in
flight were never reported and held requests never sent. Now ``pause`` returns only once
no copy can touch that memory, and what was in flight is reported by the next polls.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_runner import (
    NS,
    NUM_BLOCKS,
    PLANE_BYTES,
    SLOT_BYTES,
    GatedSlab,
    HeldStoreEngine,
    blocks_of,
    make_worker,
    wait_until,
)
from worker_support import drain, wait_until_blocked

from kv_offload.copy import make_copy_engine
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.disk import SlabFile
from kv_offload.jobs import ChunkMove, LoadJob, StoreJob
from kv_offload.testing.tiers import tier_ios, written_to
from kv_offload.tier_contract import Place
from kv_offload.worker import OffloadWorker


@pytest.fixture
def planes():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.uint8, generator=gen)
            for _ in range(2)]


def pause_in_background(worker: OffloadWorker) -> threading.Thread:
    thread = threading.Thread(target=worker.pause, name="test-pause")
    thread.start()
    return thread


def count_calls(engine, name: str) -> list[int]:
    """Count the calls of ``engine.<name>`` (the list grows by one per call)."""
    calls: list[int] = []
    real = getattr(engine, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    setattr(engine, name, counted)
    return calls


@pytest.mark.parametrize("stream", [False, True], ids=["store_thread", "cuda_stream"])
def test_pause_returns_once_the_store_copies_in_flight_have_ended(planes, tmp_path, stream):
    """A store copy held back (the CPU backend's store thread, or a CUDA stream) when
    vLLM releases the KV cache: pause waits for it, the held request is sent at the next
    poll, and the chunk's disk write goes on while paused."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    engine = HeldStoreEngine(make_copy_engine(planes, host, 2), stream=stream)
    worker = OffloadWorker(rank=0, engine=engine, host=host,
                           tiers=tier_ios(slab, slot_bytes=host.slot_bytes), io_threads=2,
                           background_stores=not stream)
    worker.run_stores([StoreJob(1, (ChunkMove((3, 4), 0, sinks=(Place("disk", 2),)),), ("held",))])
    worker.hold(["held"])
    try:
        pausing = pause_in_background(worker)
        wait_until_blocked(pausing)
        assert pausing.is_alive(), "pause returned while a store copy could still run"
    finally:
        engine.release.set()
    pausing.join(30)  # bounds a hang only
    assert not pausing.is_alive()
    assert worker.paused
    result = worker.poll()
    assert result.finished_sending == {"held"}
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    assert any(x.host_stored == {1: 1} for x in reports)
    assert any(x.paused == {0: True} for x in reports)
    out = np.empty(SLOT_BYTES, np.uint8)
    (digest,) = written_to(next(x for x in reports if written_to(x, "disk")), "disk")[1][0]
    assert slab.read(2, out, digest)
    assert np.array_equal(out, worker.host.slot_view(0))
    assert not worker.has_pending_jobs()
    worker.resume()  # the slot holds blocks 3 and 4: loaded into 9 and 10
    worker.start_loads([LoadJob(2, "again", (ChunkMove((9, 10), 0),))])
    _, _, failed = drain(worker, until=lambda r, f, b: "again" in f)
    assert not failed
    assert all(torch.equal(p[[9, 10]], p[[3, 4]]) for p in planes)
    worker.close()


def test_a_paused_worker_refuses_store_copies_and_resume_copies_again(planes, tmp_path):
    """A store job planned before the scheduler learned of the pause reaches a paused
    worker: it copies nothing and reports the job failed (its disk slot unwritten), so the
    scheduler side releases its slots. After resume, stores copy again."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab)
    stores = count_calls(worker.engine, "store")
    worker.pause()
    worker.run_stores([StoreJob(1, (ChunkMove((3, 4), 0, sinks=(Place("disk", 2),)),), ("a",))])
    worker.hold(["a"])
    result = worker.poll()
    assert result.finished_sending == {"a"}
    report = worker.take_report()
    assert report.host_failed == {1: 1} and written_to(report, "disk") == {1: {0: (None,)}}
    assert report.paused == {0: True}
    assert not stores and not worker.has_pending_jobs()
    worker.resume()
    assert not worker.paused and worker.take_report().paused == {0: False}
    worker.run_stores([StoreJob(2, (ChunkMove((3, 4), 1, sinks=(Place("disk", 3),)),))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    assert any(x.host_stored == {2: 1} for x in reports) and len(stores) == 1
    worker.close()


@pytest.mark.parametrize("copy_thread", [False, True])
def test_pause_cancels_loads_still_reading_and_their_reads_still_fill_host_slots(
        planes, monkeypatch, copy_thread):
    """A disk load still reading when vLLM releases the KV cache: its blocks are reported
    failed (vLLM recomputes them), its copy never runs, and its read ends in the host
    slot, reported intact so the scheduler side can keep the chunk."""
    if copy_thread:
        monkeypatch.setattr("kv_offload.worker.runner.INLINE_LOAD_MAX_BYTES", 0)
    slab = GatedSlab()
    worker = make_worker(planes, slab)
    loads = count_calls(worker.engine, "load")
    before = blocks_of(planes, [1, 2])
    worker.start_loads([LoadJob(1, "req", (ChunkMove((1, 2), 0, Place("disk", 3, (0,))),))])
    worker.pause()
    result = worker.poll()
    assert result.finished_req_ids == {"req"} and result.failed_block_ids == {1, 2}
    slab.release.set()
    reports, _, _ = drain(worker, until=lambda r, f, b: any(x.loaded for x in r))
    assert next(x for x in reports if x.loaded).loaded == {1: {0: frozenset({0})}}
    assert not any(x.bad_reads for x in reports)
    assert set(bytes(worker.host.slot_view(0))) == {4}
    assert not loads
    for p, orig in zip(planes, before):
        assert torch.equal(p[[1, 2]], orig)
    assert not worker.has_pending_jobs()
    worker.close()


def test_pause_waits_for_a_load_copy_in_progress(planes, monkeypatch):
    """A load being copied into the engine on the copy thread (as on CUDA) when vLLM
    releases the KV cache: pause returns only after that copy, which is reported loaded."""
    monkeypatch.setattr("kv_offload.worker.runner.INLINE_LOAD_MAX_BYTES", 0)
    worker = make_worker(planes, None)
    worker.run_stores([StoreJob(1, (ChunkMove((3, 4), 0),))])
    copying, release = threading.Event(), threading.Event()
    real_load = worker.engine.load

    def gated_load(slots, block_ids, *, after=None):
        copying.set()
        assert release.wait(60), "the test never released the load copy"
        return real_load(slots, block_ids, after=after)

    worker.engine.load = gated_load
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 0),))])
    assert copying.wait(30)
    try:
        pausing = pause_in_background(worker)
        wait_until_blocked(pausing)
        assert pausing.is_alive(), "pause returned while a load copy was running"
    finally:
        release.set()
    pausing.join(30)  # bounds a hang only
    assert not pausing.is_alive()
    _, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert not failed
    assert torch.equal(planes[0][9], planes[0][3]) and torch.equal(planes[1][10], planes[1][4])
    worker.close()


def test_loads_handed_to_a_paused_worker_fail_without_touching_the_engine(planes):
    """Loads planned before the scheduler learned of the pause: every block is reported
    failed at once, no copy runs, and a disk chunk's read still fills its staging slot."""
    slab = GatedSlab()
    slab.release.set()
    worker = make_worker(planes, slab)
    loads = count_calls(worker.engine, "load")
    worker.pause()
    worker.start_loads([LoadJob(1, "cpu", (ChunkMove((1, 2), 0),)),
                        LoadJob(2, "disk", (ChunkMove((5, 6), 1, Place("disk", 4, (0,))),))])
    _, finished, failed = drain(worker, until=lambda r, f, b: {"cpu", "disk"} <= f)
    assert failed == {1, 2, 5, 6}
    wait_until(lambda: slab.reads == 1)
    reports, _, _ = drain(worker, until=lambda r, f, b: not worker.has_pending_jobs())
    assert not loads
    assert set(bytes(worker.host.slot_view(1))) == {5}
    worker.close()
