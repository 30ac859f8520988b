"""The runtime audit (kv_offload.worker.audit) on the CPU, with the torch engine: a copy
that writes wrong bytes is caught on stores and loads, the chunk is discarded (a store
reported failed and never written to disk, a load reported as a load error), the engine
falls back to its plainest path, and the check keeps the blocks it re-reads protected."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from worker_support import drain

from kv_offload.copy import make_copy_engine
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.copy.plan import SlotLayout
from kv_offload.counters import WorkerCounters
from kv_offload.disk import SlabFile
from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob, StoreJob
from kv_offload.testing.tiers import tier_ios, written_to
from kv_offload.tier_contract import Place
from kv_offload.worker import OffloadWorker
from kv_offload.worker.audit import AUDIT_SCRATCH_SLOTS, CopyAudit, build_audit
from kv_offload.worker.host_copies import HostCopies

NUM_BLOCKS, PLANE_BYTES, BPC = 16, 128, 2
SLOT_BYTES = 2 * PLANE_BYTES * BPC


class CorruptingEngine:
    """A real engine whose copies flip a byte of what they wrote (a stream race, a wrong
    layout), until ``fall_back_to_plainest``; ``gate``: store copies count as done only
    once it is set; ``held`` is set once someone asked about a copy the gate holds."""

    def __init__(self, engine, host, planes, *, corrupt: str) -> None:
        self.unfaulty, self.host, self.planes, self.corrupt = engine, host, planes, corrupt
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()
        self.fell_back = 0

    def __getattr__(self, name):
        return getattr(self.unfaulty, name)

    @property
    def copy_path(self) -> str:
        return "plainest" if self.fell_back else "fast"

    def fall_back_to_plainest(self):
        self.fell_back += 1
        return "plainest" if self.fell_back == 1 else None

    def store(self, block_ids, slots, *, after=None):
        handle = self.unfaulty.store(block_ids, slots)
        if self.corrupt == "store" and not self.fell_back:
            self.host.as_tensor()[int(slots[0]), 7] ^= 0xFF
        return handle

    def load(self, slots, block_ids, *, after=None):
        handle = self.unfaulty.load(slots, block_ids)
        if self.corrupt == "load" and not self.fell_back:
            self.planes[1][int(block_ids[0][1]), 3] ^= 0xFF
        return handle

    def is_done(self, handle):
        if not self.gate.is_set():
            self.held.set()
            return False
        return self.unfaulty.is_done(handle)

    def wait(self, handle):
        if not self.gate.is_set():
            self.held.set()
        assert self.gate.wait(30), "the test never opened the gate"


@pytest.fixture
def planes():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.uint8, generator=gen)
            for _ in range(2)]


def make_worker(planes, *, corrupt="", rate=1.0, slab=None):
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    engine = CorruptingEngine(make_copy_engine(planes, host, BPC), host, planes,
                              corrupt=corrupt)
    audit = build_audit(planes, host, BPC, engine=engine, rate=rate)
    worker = OffloadWorker(rank=0, engine=engine, host=host,
                           tiers=tier_ios(slab, slot_bytes=host.slot_bytes), io_threads=2,
                           audit=audit)
    return worker, engine, host


def test_a_store_copy_writing_wrong_bytes_is_caught_and_never_published_nor_written(
        planes, tmp_path, caplog):
    """Regression scenario: the engine -> host copy flips a byte. Without the audit the
    chunk was published in the CPU tier and committed on disk with a checksum of the
    wrong bytes; now the job fails, its disk slot is reported unwritten, the mismatch is
    logged and counted, and the engine falls back to its plainest copy path."""
    slab = SlabFile(tmp_path, namespace_id="cd" * 16, rank=0, num_ranks=1,
                    slot_bytes=SLOT_BYTES)
    worker, engine, _ = make_worker(planes, corrupt="store", slab=slab)
    worker.run_stores([StoreJob(1, (ChunkMove((3, 7), 1, sinks=(Place("disk", 5),)),), req_ids=("r",))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "disk") for x in r))
    assert any(x.host_failed == {1: 1} for x in reports)
    assert not any(x.host_stored for x in reports)
    assert written_to(next(x for x in reports if written_to(x, "disk")), "disk") == {1: {0: (None,)}}
    assert engine.fell_back == 1
    assert "kv-offload AUDIT MISMATCH" in caplog.text and "copy path fast" in caplog.text
    stats = worker.take_stats()
    assert stats["audit_mismatches"] == 1 and stats["audit_chunks"] == 1
    # the next store copies right (the plainest path) and passes its audit
    worker.run_stores([StoreJob(2, (ChunkMove((4, 8), 2),), req_ids=("s",))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(x.host_stored for x in r))
    assert reports[-1].host_stored == {2: 1}
    worker.close()


def test_a_load_copy_writing_wrong_bytes_is_a_load_error(planes):
    worker, engine, host = make_worker(planes, corrupt="load")
    host.as_tensor()[2].copy_(torch.arange(SLOT_BYTES) % 251)
    worker.start_loads([LoadJob(3, "req", (ChunkMove((9, 10), 2),))])
    reports, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert failed == {9, 10}  # vLLM recomputes the chunk
    assert any(x.loaded.get(3) == {0: frozenset({0})} for x in reports)
    assert engine.fell_back == 1 and worker.take_stats()["audit_mismatches"] == 1
    worker.close()


def test_right_copies_pass_and_are_counted(planes):
    worker, engine, host = make_worker(planes)
    worker.run_stores([StoreJob(1, (ChunkMove((3, 7), 1), ChunkMove((2, SKIP_BLOCK), 3)),
                                req_ids=("r", "r"))])
    reports, _, _ = drain(worker, until=lambda r, f, b: any(x.host_stored for x in r))
    assert reports[-1].host_stored == {1: 1} and not engine.fell_back
    worker.start_loads([LoadJob(2, "req", (ChunkMove((11, 12), 1),))])
    _, _, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert not failed
    assert worker.take_stats()["audit_chunks"] == 3 and engine.fell_back == 0
    worker.close()


def audit_parts(planes, *, rate=1.0, rng=None):
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    engine = CorruptingEngine(make_copy_engine(planes, host, BPC), host, planes, corrupt="")
    scratch = allocate_host_slots(AUDIT_SCRATCH_SLOTS, SLOT_BYTES, pinned=False)
    reader = CorruptingEngine(make_copy_engine(planes, scratch, BPC), scratch, planes,
                              corrupt="")
    audit = CopyAudit(engine=engine, reader=reader, host=host, scratch=scratch,
                      layout=SlotLayout.packed([PLANE_BYTES] * 2, BPC), rate=rate, rng=rng)
    return engine, reader, audit


def test_a_held_request_waits_for_the_check_and_a_fence_stops_it(planes):
    """Invariant 3 for the audit's re-read: a finished (held) request is reported sent
    only once the re-read of its blocks ended; a preempted request's fence waits for a
    re-read in flight and stops the check, so no re-read touches blocks vLLM reuses."""
    engine, reader, audit = audit_parts(planes)
    copies = HostCopies(engine, background=False, audit=audit)
    reader.gate.clear()  # the re-read is in flight until the gate opens
    copy = copies.issue(np.array([[3, 7]]), np.array([1]), ["held"])
    copies.hold(["held"])
    assert reader.held.wait(30), "the re-read never started"
    assert not copy.done() and copies.take_sent() == set()
    reader.gate.set()
    copy.wait()
    assert copies.take_sent() == {"held"}

    engine.gate.clear()  # the store copy itself runs: the check has not re-read yet
    fenced = copies.issue(np.array([[4, 8]]), np.array([2]), ["preempted"])
    copies.fence(["preempted"])
    engine.gate.set()
    fenced.wait()  # ends without a re-read: nothing compared, nothing failed
    assert not fenced.failed() and audit.take_counts() == WorkerCounters(audit_chunks=1)
    copies.close()
    audit.close()


def test_the_sample_follows_the_rate(planes):
    engine, _, audit = audit_parts(planes, rate=0.25, rng=random.Random(1))
    ids, slots = np.array([[1, 2]] * 4), np.arange(4)
    engine.store(ids, slots)  # the copies the checks check
    checks = [audit.check_store(lambda: None, ids, slots) for _ in range(200)]
    sampled = sum(c is not None for c in checks)
    assert 120 < sampled < 200  # P(some of 4 chunks) = 1 - 0.75**4 = 0.68
    for check in checks:
        if check is not None:
            check.wait()
    audit.close()
    host = allocate_host_slots(2, SLOT_BYTES, pinned=False)
    assert build_audit(planes, host, BPC, engine=engine, rate=0) is None
