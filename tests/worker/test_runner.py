"""OffloadWorker on CPU: real torch copy engine and slab file, jobs as the scheduler sends them.

Regression scenarios: a load that never finishes must not hang the request (timeout),
a slow disk read that ends after the timeout must not write into engine blocks, a broken
store directory must be reported once so the scheduler can stop using it.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent import futures

import numpy as np
import pytest
import torch
from worker_support import drain, wait_until_blocked

from kv_offload.copy import Direction, make_copy_engine
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.disk import SlabFile
from kv_offload.disk.health import DISK_BROKEN_AFTER
from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob, StoreJob
from kv_offload.testing.tiers import tier_ios, written_to
from kv_offload.tier_contract import Place
from kv_offload.worker import OffloadWorker
from kv_offload.worker.loads import WorkerLoad

NUM_BLOCKS, PLANE_BYTES, BPC = 16, 128, 2
SLOT_BYTES = 2 * PLANE_BYTES * BPC  # two planes (layers)
NS = "ab" * 16


def make_worker(planes, slab, *, remote=None, verify_checksums=True, **kwargs):
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    engine = make_copy_engine(planes, host, BPC)
    tiers = tier_ios(slab, remote, slot_bytes=SLOT_BYTES, verify_checksums=verify_checksums)
    return OffloadWorker(rank=0, engine=engine, host=host, tiers=tiers, io_threads=2, **kwargs)


def blocks_of(planes, ids):
    return [p[ids].clone() for p in planes]


def test_store_then_load_from_disk_restores_bytes(planes, tmp_path):
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab)
    original = blocks_of(planes, [3, 7])
    worker.run_stores([StoreJob(1, (ChunkMove((3, 7), 1, sinks=(Place("disk", 5),)),))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    (checksum,) = written_to(next(x for x in reports if written_to(x, "disk")), "disk")[1][0]
    assert any(x.host_stored == {1: 1} for x in reports)
    for p in planes:
        p[[9, 10]] = 0
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 2, Place("disk", 5, (checksum,))),))])
    reports, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert not failed
    for p, orig in zip(planes, original):
        assert torch.equal(p[[9, 10]], orig)
    assert any(x.loaded.get(2) == {0: frozenset()} for x in reports)
    stats = worker.take_stats()
    assert stats["bytes_disk_read"] == SLOT_BYTES and stats["bytes_load"] == SLOT_BYTES
    worker.close()


def test_skip_blocks_are_left_alone_and_cpu_hits_need_no_disk(planes):
    worker = make_worker(planes, None)
    worker.run_stores([StoreJob(1, (ChunkMove((3, 4), 0),))])
    before = blocks_of(planes, [8])
    worker.start_loads([LoadJob(2, "r", (ChunkMove((SKIP_BLOCK, 9), 0),))])
    drain(worker, until=lambda r, f, b: "r" in f)
    assert torch.equal(planes[0][9], planes[0][4]) and torch.equal(planes[1][9], planes[1][4])
    assert torch.equal(planes[0][8], before[0][0])
    worker.close()


def test_corrupt_chunk_is_a_load_error_with_its_blocks(planes, tmp_path):
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab)
    worker.run_stores([StoreJob(1, (ChunkMove((1, 2), 0, sinks=(Place("disk", 0),)),))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    checksum = written_to(next(x for x in reports if written_to(x, "disk")), "disk")[1][0][0]
    with open(slab.path, "r+b") as f:
        f.write(b"\xff\x00\xff")
    target = blocks_of(planes, [11, 12])
    job = LoadJob(2, "r", (ChunkMove((11, 12), 1, Place("disk", 0, (checksum,))), ChunkMove((13, 14), None)))
    worker.start_loads([job])
    reports, finished, failed = drain(worker, until=lambda r, f, b: "r" in f)
    assert failed == {11, 12, 13, 14}
    for p, orig in zip(planes, target):
        assert torch.equal(p[[11, 12]], orig), "bad bytes reached the engine"
    assert any(x.loaded.get(2) == {0: frozenset({0, 1})} for x in reports)
    assert any(x.bad_reads.get(2) == {0: frozenset({0})} for x in reports), "only the damaged"
    stats = worker.take_stats()
    assert stats["checksum_failures"] == 1 and not stats.get("disk_read_errors")
    worker.close()


def test_unreadable_chunk_counts_a_read_error_not_a_checksum_failure(planes, tmp_path):
    """A slab cut short (or missing, or EIO) is a read error: the chunk is recomputed, and
    it is counted in disk_read_errors, not checksum_failures."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab)
    worker.run_stores([StoreJob(1, (ChunkMove((1, 2), 0, sinks=(Place("disk", 0),)),))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    checksum = written_to(next(x for x in reports if written_to(x, "disk")), "disk")[1][0][0]
    worker.take_stats()
    os.truncate(slab.path, 0)
    worker.start_loads([LoadJob(2, "r", (ChunkMove((11, 12), 1, Place("disk", 0, (checksum,))),))])
    _, finished, failed = drain(worker, until=lambda r, f, b: "r" in f)
    assert failed == {11, 12}
    stats = worker.take_stats()
    assert stats["disk_read_errors"] == 1 and not stats.get("checksum_failures")
    worker.close()


def test_store_moved_away_under_the_worker_reports_a_broken_disk(planes, tmp_path):
    """Regression (engine test of a store deleted under a running engine): with the slab
    file system lazily unmounted, or the store moved away, the open slab file keeps its
    link. Its reads must still fail (MISSING) so that DISK_BROKEN_AFTER of them in a row
    report the disk broken and the scheduler disables the tier; they were served from
    the detached file, and the tier stayed on."""
    slab = SlabFile(tmp_path / "store", namespace_id=NS, rank=0, num_ranks=1,
                    slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab)
    worker.run_stores([StoreJob(1, tuple(ChunkMove((2 * i, 2 * i + 1), i, sinks=(Place("disk", i),)) for i in range(4)))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    checksums = written_to(next(x for x in reports if written_to(x, "disk")), "disk")[1][0]
    os.rename(tmp_path / "store", tmp_path / "moved")
    before = blocks_of(planes, [12, 13])
    reports = []
    for job in range(DISK_BROKEN_AFTER):
        slot = job % 4
        load = LoadJob(10 + job, f"r{job}", (ChunkMove((12, 13), slot, Place("disk", slot, (checksums[slot],))),))
        worker.start_loads([load])
        more, _, failed = drain(worker, until=lambda r, f, b, j=job: f"r{j}" in f)
        assert failed == {12, 13}
        reports += more
    reports += drain(worker, until=lambda r, f, b: not worker.has_pending_jobs())[0]
    broken = [x.broken.get("disk") for x in reports if x.broken.get("disk")]
    assert len(broken) == 1 and "MISSING" in broken[0]
    for p, orig in zip(planes, before):
        assert torch.equal(p[[12, 13]], orig)
    worker.close()


class BlockingSlab:
    """A slab whose reads wait for ``release`` (a hung disk) and then succeed."""

    def __init__(self):
        self.release = threading.Event()

    def read(self, slot, buf, expected):
        self.release.wait(60)  # bounds a hang only: longer than any drain
        np.frombuffer(buf, dtype=np.uint8)[:] = 7
        return True

    def close(self):
        pass


def test_load_timeout_fails_request_and_late_read_never_reaches_engine(planes):
    slab = BlockingSlab()
    worker = make_worker(planes, slab, load_timeout_s=0.2)
    before = blocks_of(planes, [5, 6])
    worker.start_loads([LoadJob(1, "slow", (ChunkMove((5, 6), 0, Place("disk", 3, (0,))),))])
    reports, finished, failed = drain(worker, until=lambda r, f, b: "slow" in f)
    assert failed == {5, 6}
    assert not any(x.loaded for x in reports), "slots must stay pinned until the read ends"
    slab.release.set()
    reports, _, _ = drain(worker, until=lambda r, f, b: any(x.loaded for x in r))
    assert next(x for x in reports if x.loaded).loaded[1] == {0: frozenset({0})}
    assert not any(x.bad_reads for x in reports), "a slow read is not a damaged chunk"
    for p, orig in zip(planes, before):
        assert torch.equal(p[[5, 6]], orig)
    worker.close()


class ReadOnlySlab:
    def write(self, slot, buf):
        raise OSError(errno.EROFS, "Read-only file system")

    def close(self):
        pass


def test_repeated_io_errors_report_a_broken_disk_once(planes):
    worker = make_worker(planes, ReadOnlySlab())
    jobs = [StoreJob(i, (ChunkMove((i % 8, i % 8 + 1), i % 4, sinks=(Place("disk", i),)),)) for i in range(10)]
    worker.run_stores(jobs)
    reports, _, _ = drain(worker, until=lambda r, f, b: sum(len(written_to(x, "disk")) for x in r) == 10)
    broken = [x.broken.get("disk") for x in reports if x.broken.get("disk")]
    assert len(broken) == 1 and "Read-only" in broken[0]
    assert all(s == (None,) for x in reports for per in written_to(x, "disk").values()
               for s in per.values())
    worker.close()


def test_verification_off_trusts_the_slab(planes, tmp_path):
    """verify_checksums=False: a damaged chunk is loaded as is (the operator's choice)."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab, verify_checksums=False)
    worker.run_stores([StoreJob(1, (ChunkMove((1, 2), 0, sinks=(Place("disk", 0),)),))])
    drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    with open(slab.path, "r+b") as f:
        f.write(b"\x01\x02\x03")
    worker.start_loads([LoadJob(2, "r", (ChunkMove((11, 12), 1, Place("disk", 0, (12345,))),))])
    _, _, failed = drain(worker, until=lambda r, f, b: "r" in f)
    assert not failed
    assert bytes(planes[0][11][:3].tolist()) == b"\x01\x02\x03"
    worker.close()


def test_a_cpu_tier_load_is_copied_on_the_calling_thread_and_reported_at_the_next_poll(planes):
    """With the CPU backend's synchronous engine, a load that needs no read is copied by
    ``start_loads`` itself (vLLM calls it after the step's forward), so the same step's
    ``get_finished`` reports it and vLLM computes the request one step sooner."""
    worker = make_worker(planes, None)
    assert worker.engine.synchronous
    original = blocks_of(planes, [3, 7])
    worker.run_stores([StoreJob(1, (ChunkMove((3, 7), 1),))])
    drain(worker, until=lambda r, f, b: any(x.host_stored for x in r))
    for p in planes:
        p[[9, 10]] = 0
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),))])
    for p, orig in zip(planes, original):  # before any poll
        assert torch.equal(p[[9, 10]], orig)
    result = worker.poll()
    assert result.finished_req_ids == {"req"} and not result.failed_block_ids
    assert worker.take_report().loaded == {2: {0: frozenset()}}
    assert not worker.has_pending_jobs()


class GatedSlab:
    """A slab whose reads fill the buffer with slot + 1 once ``release`` is set."""

    def __init__(self):
        self.release = threading.Event()
        self.reads = 0

    def read(self, slot, buf, expected):
        self.release.wait(10)
        np.frombuffer(buf, dtype=np.uint8)[:] = slot + 1
        self.reads += 1
        return True

    def close(self):
        pass


def test_a_disk_load_is_copied_by_the_poll_after_its_reads_and_reported_by_it(planes):
    """With the CPU backend's synchronous engine the I/O threads only read; the poll
    (vLLM's ``get_finished``) that finds the reads done copies the chunks on vLLM's
    thread and reports the request at once, not a copy thread's run later."""
    slab = GatedSlab()
    worker = make_worker(planes, slab)
    copied_on = []
    load = worker.engine.load

    def recording_load(slots, block_ids, *, after=None):
        copied_on.append(threading.get_ident())
        return load(slots, block_ids, after=after)

    worker.engine.load = recording_load
    job = LoadJob(1, "req", (ChunkMove((1, 2), 0, Place("disk", 3, (0,))), ChunkMove((5, 6), 1, Place("disk", 4, (0,)))))
    worker.start_loads([job])
    assert worker.poll().finished_req_ids == set()  # still reading
    slab.release.set()
    wait_until(lambda: slab.reads == 2)
    result = worker.poll()
    # One copy, by this poll: a copy thread would have copied it (another ident), or
    # not yet, and then this poll would not report the request.
    assert result.finished_req_ids == {"req"} and not result.failed_block_ids
    assert copied_on == [threading.get_ident()]
    assert all(bool((p[[1, 2]] == 4).all()) and bool((p[[5, 6]] == 5).all()) for p in planes)
    worker.close()


def wait_until(condition, timeout=30.0):
    """Poll ``condition``; ``timeout`` bounds a hang only."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.005)


@pytest.mark.parametrize("copy_thread", [False, True])
def test_a_bug_in_a_load_copy_fails_the_load_not_the_step(planes, monkeypatch, copy_thread):
    """``poll`` runs on vLLM's thread (``get_finished``): whatever goes wrong while it
    copies a load, the request's blocks are reported for recompute and poll returns. On
    the copy thread, a bug before the copy left the load reported as loaded."""
    if copy_thread:
        monkeypatch.setattr("kv_offload.worker.runner.INLINE_LOAD_MAX_BYTES", 0)
    slab = GatedSlab()
    slab.release.set()
    worker = make_worker(planes, slab)

    def broken(*args):
        raise KeyError("a bug")

    monkeypatch.setattr(type(worker.tiers["disk"]), "read", lambda self, place, out: True)
    monkeypatch.setattr("kv_offload.worker.loads.WorkerLoad.sort_rows", broken)
    worker.start_loads([LoadJob(1, "req", (ChunkMove((1, 2), 0, Place("disk", 3, (0,))),))])
    _, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert failed == {1, 2}
    worker.close()


def test_loads_past_the_inline_budget_go_to_the_copy_thread(planes, monkeypatch):
    """A copy on vLLM's thread stalls the step of every running request: past
    INLINE_LOAD_MAX_BYTES in one call, loads are copied on the copy thread instead."""
    monkeypatch.setattr("kv_offload.worker.runner.INLINE_LOAD_MAX_BYTES", 2 * SLOT_BYTES)
    worker = make_worker(planes, None)
    copied_on = {}
    load = worker.engine.load

    def recording_load(slots, block_ids, *, after=None):
        copied_on[len(slots)] = threading.get_ident()
        return load(slots, block_ids, after=after)

    worker.engine.load = recording_load
    worker.start_loads([LoadJob(1, "a", (ChunkMove((1, 2), 0),)),
                        LoadJob(2, "b", (ChunkMove((3, 4), 1), ChunkMove((5, 6), 2))),
                        LoadJob(3, "c", (ChunkMove((7, 8), 0), ChunkMove((9, 10), 1),
                                         ChunkMove((11, 12), 2)))])
    _, finished, failed = drain(worker, until=lambda r, f, b: {"a", "b", "c"} <= f)
    assert not failed
    assert copied_on[1] == threading.get_ident()  # within the budget: the calling thread
    assert copied_on[2] != threading.get_ident()  # within the limit, past what is left of it
    assert copied_on[3] != threading.get_ident()  # past the limit
    worker.close()


def test_a_load_copy_ending_while_a_poll_looks_at_it_is_still_reported_to_vllm(planes,
                                                                               monkeypatch):
    """poll looked at a load's copy twice: is it over, for the request's completion
    (vLLM's finished_recving), then again for the scheduler's report. A copy on the copy
    thread that ended between the two was reported loaded and forgotten, its request never
    finished: vLLM would have waited for that request's KV forever."""
    monkeypatch.setattr("kv_offload.worker.runner.INLINE_LOAD_MAX_BYTES", 0)  # copy thread
    worker = make_worker(planes, None)
    ending, end = threading.Event(), threading.Event()

    def last_step_of_the_copy(mark):  # on the copy thread, after the copy, before its end
        ending.set()
        assert end.wait(30), "the test never let the copy end"

    worker.engine.release_mark = last_step_of_the_copy
    take = WorkerLoad.take_failed_blocks

    def copy_ends_meanwhile(load):
        blocks = take(load)
        if blocks is None and not end.is_set():  # the copy ends right after this look
            end.set()
            futures.wait([load.future], timeout=30)
        return blocks

    monkeypatch.setattr(WorkerLoad, "take_failed_blocks", copy_ends_meanwhile)
    worker.start_loads([LoadJob(1, "req", (ChunkMove((1, 2), 0),))])
    assert ending.wait(30), "the copy thread never copied"
    reports, _, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert not failed and any(x.loaded.get(1) == {0: frozenset()} for x in reports)
    worker.close()


@pytest.mark.parametrize("copy_thread", [False, True])
def test_a_poll_in_a_step_without_forward_reports_a_load_the_moment_its_reads_end(
        planes, monkeypatch, copy_thread):
    """vLLM's only requests wait for loads: rather than return empty and spin through
    empty steps, the idle poll waits for the reads, copies and reports the request. A
    copy on the copy thread (CUDA, loads past the inline budget) wakes it too."""
    if copy_thread:
        monkeypatch.setattr("kv_offload.worker.runner.INLINE_LOAD_MAX_BYTES", 0)
    slab = GatedSlab()
    worker = make_worker(planes, slab)
    worker.idle_wait_s = 10.0
    worker.start_loads([LoadJob(1, "req", (ChunkMove((1, 2), 0, Place("disk", 3, (0,))),))])
    results = []
    poll = threading.Thread(target=lambda: results.append(worker.poll(idle=True)))
    poll.start()
    # Opened once the poll waits (not after a fixed 50 ms, which a busy host could
    # outlast: the reads would end first and the poll find them without waiting).
    wait_until_blocked(poll)
    slab.release.set()
    poll.join(60)  # bounds a hang only
    [result] = results
    assert result.finished_req_ids == {"req"} and not result.failed_block_ids
    assert all(bool((p[[1, 2]] == 4).all()) for p in planes)
    worker.close()


def test_an_idle_poll_waits_at_most_idle_wait_s_and_not_at_all_without_loads(planes):
    """The wait is bounded (a new request may be waiting to be scheduled), and a poll
    with no load in flight, or a poll in a step with a forward, never waits."""
    slab = GatedSlab()
    worker = make_worker(planes, slab)
    worker.idle_wait_s = 3600.0  # a poll that waits at all never returns in this test
    idle_poll = threading.Thread(target=worker.poll, kwargs={"idle": True}, daemon=True)
    idle_poll.start()  # nothing in flight: returns at once
    idle_poll.join(60)  # bounds a hang only
    assert not idle_poll.is_alive(), "an idle poll with no load in flight waited"
    worker.start_loads([LoadJob(1, "req", (ChunkMove((1, 2), 0, Place("disk", 3, (0,))),))])
    # A forward ran: no wait. Had it waited, it would have reported the load, whose
    # read ends only when the test opens the gate (or after its own 10 s).
    assert worker.poll().finished_req_ids == set()
    worker.idle_wait_s = 0.05
    assert worker.poll(idle=True).finished_req_ids == set()  # reads still blocked
    slab.release.set()
    _, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert not failed
    worker.close()


class HalfFullSlab:
    """A real slab on which a write of several chunks at once fails with ENOSPC, and so
    does a write of any odd slot alone: only some chunks of the job fit."""

    def __init__(self, slab):
        self.slab = slab

    def write_many(self, slots, bufs):
        raise OSError(errno.ENOSPC, "No space left on device")

    def write(self, slot, buf):
        if slot % 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.slab.write(slot, buf)

    def read(self, slot, buf, expected):
        return self.slab.read(slot, buf, expected)

    def close(self):
        self.slab.close()


def test_a_failed_multi_chunk_write_stores_each_chunk_that_fits(planes, tmp_path):
    """A store job's chunks go to the slab in one write; when it fails, each chunk is
    written alone, so a disk with room for some of them still stores those."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, HalfFullSlab(slab))
    job = StoreJob(1, tuple(ChunkMove((2 * i, 2 * i + 1), i, sinks=(Place("disk", 10 + i),)) for i in range(4)))
    worker.run_stores([job])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    (sums,) = [written_to(x, "disk")[1][0] for x in reports if written_to(x, "disk")]
    assert [s is not None for s in sums] == [True, False, True, False]
    for i in (0, 2):
        out = np.empty(SLOT_BYTES, np.uint8)
        assert slab.read(10 + i, out, sums[i])
        assert np.array_equal(out, worker.host.slot_view(i))
    worker.close()


def test_a_store_jobs_chunks_reach_the_slab_in_one_write(planes, tmp_path, monkeypatch):
    """Small chunks on consecutive disk slots cost one system call, not one each."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab)
    calls = []
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: calls.append(off) or real(fd, bufs, off))
    worker.run_stores([StoreJob(1, tuple(ChunkMove((2 * i, 2 * i + 1), i, sinks=(Place("disk", 20 + i),))
                                         for i in range(4)))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    assert calls == [20 * SLOT_BYTES]
    assert all(s is not None for x in reports for s in written_to(x, "disk").get(1, {0: ()})[0])
    worker.close()


def test_close_leaves_the_slab_open_while_a_write_outlives_its_deadline(planes, tmp_path,
                                                                        monkeypatch):
    """close() closed the slab under a write stalled past its deadline; the write's next
    pwritev then went to whatever file the process opened next under that descriptor."""
    import kv_offload.disk.slab as slab_module

    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    stalled, release = threading.Event(), threading.Event()
    real = os.pwritev

    def stalling_pwritev(fd, bufs, offset):
        stalled.set()
        release.wait(60)  # bounds a hang only: the test releases it
        return real(fd, bufs, offset)

    monkeypatch.setattr(slab_module.os, "pwritev", stalling_pwritev)
    worker = make_worker(planes, slab)
    worker.run_stores([StoreJob(1, (ChunkMove((3, 7), 1, sinks=(Place("disk", 5),)),))])
    assert stalled.wait(30)
    worker.close(timeout_s=0.1)
    try:
        os.fstat(slab._fd)  # still this slab's descriptor: the late write lands in it
    finally:
        release.set()
    wait_until(lambda: os.path.getsize(slab.path) == 6 * SLOT_BYTES)
    slab.close()


HOLD_S = 60.0  # how long HeldStoreEngine holds at most: longer than any drain below


class HeldStoreEngine:
    """The CPU engine with its store copies held back until ``release`` is set: on the
    store thread (``cpu_background_stores``), or as on a CUDA stream, where ``store``
    returns at once and the handle is done only later."""

    def __init__(self, engine, *, stream: bool) -> None:
        self.unheld, self.stream, self.release = engine, stream, threading.Event()
        self.synchronous = not stream  # on CUDA, loads are copied on the copy thread

    def store(self, block_ids, slots, *, after=None):
        if not self.stream:
            assert self.release.wait(HOLD_S), "the test never released the store copies"
        return self.unheld.store(block_ids, slots)

    def is_done(self, handle) -> bool:
        held = self.stream and handle.direction is Direction.STORE
        return not (held and not self.release.is_set()) and self.unheld.is_done(handle)

    def wait(self, handle) -> None:
        if self.stream and handle.direction is Direction.STORE:
            assert self.release.wait(HOLD_S), "the test never released the store copies"
        self.unheld.wait(handle)

    def __getattr__(self, name):
        return getattr(self.unheld, name)


@pytest.mark.parametrize("stream", [False, True], ids=["store_thread", "cuda_stream"])
def test_a_disk_load_finishes_while_many_store_copies_are_held_back(planes, tmp_path, stream):
    """Issue 27, section 4: a store's slab write waited for its engine copy on an I/O
    thread, and reads for loads queued behind it in the same pool. Store copies run one
    or two forwards behind (a CUDA stream, or the CPU backend's store thread), so a long
    prefill parked every I/O thread and disk hits waited for it: TTFT suffered exactly
    under load. Now a write is queued only once its copy ended, on a lane of its own."""
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    payload = np.arange(SLOT_BYTES, dtype=np.uint64).astype(np.uint8)
    checksum = slab.write(0, payload)
    host = allocate_host_slots(8, SLOT_BYTES, pinned=False)
    engine = HeldStoreEngine(make_copy_engine(planes, host, BPC), stream=stream)
    worker = OffloadWorker(rank=0, engine=engine, host=host, tiers=tier_ios(slab, slot_bytes=host.slot_bytes), io_threads=2,
                           background_stores=not stream)
    stores = [StoreJob(i, (ChunkMove((i, i + 1), i, sinks=(Place("disk", 10 + i),)),)) for i in range(1, 8)]
    worker.run_stores(stores)
    try:
        worker.start_loads([LoadJob(100, "req", (ChunkMove((12, 13), 0, Place("disk", 0, (checksum,))),))])
        # While the copies are held (release is set only below): the drain's deadline
        # only bounds a hang and ends well before HOLD_S.
        _, finished, failed = drain(worker, until=lambda r, f, b: "req" in f, timeout=30.0)
        assert not failed
        assert all(bytes(p[[12, 13]].numpy().tobytes()) == payload[i * 2 * PLANE_BYTES:
                                                                   (i + 1) * 2 * PLANE_BYTES]
                   .tobytes() for i, p in enumerate(planes))
    finally:
        engine.release.set()
    reports, _, _ = drain(worker, until=lambda r, f, b: sum(len(written_to(x, "disk")) for x in r) == 7)
    for job in stores:
        ((move,),) = [job.chunks]
        out = np.empty(SLOT_BYTES, np.uint8)
        (digest,) = written_to(next(x for x in reports if job.job_id in written_to(x, "disk")
                         ), "disk")[job.job_id][0]
        assert slab.read(move.sinks[0].address, out, digest)
        assert np.array_equal(out, worker.host.slot_view(move.cpu_slot))
    worker.close()
