"""A synchronous engine (the CPU backend) copies a disk load's chunks as their reads land.

Issue 29: a disk hit read its chunks on the I/O threads and then copied all of them into
the engine, one after the other, while vLLM's core sat idle in the step's wait: the copy
now overlaps the later reads (``OffloadWorker._copy_landed``). Regression scenarios: a
chunk copied early whose load later fails, times out or is paused must still be reported
(vLLM recomputes it), and no read that ends late may reach the engine.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_runner import blocks_of, make_worker, wait_until
from worker_support import drain

from kv_offload.disk.slab import ReadResult
from kv_offload.jobs import ChunkMove, LoadJob
from kv_offload.tier_contract import Place


class SlotGatedSlab:
    """A slab whose read of slot ``s`` fills the buffer with ``s + 1``: at once, or for
    the slots in ``gated`` once ``release`` is set; the slots in ``damaged`` then fail
    their checksum."""

    def __init__(self, gated=(), damaged=()):
        self.gated, self.damaged = set(gated), set(damaged)
        self.release = threading.Event()
        self.read_slots: set[int] = set()
        self._lock = threading.Lock()

    def read(self, slot, buf, expected):
        if slot in self.gated:
            self.release.wait(60)  # bounds a hang only
        np.frombuffer(buf, dtype=np.uint8)[:] = slot + 1
        with self._lock:
            self.read_slots.add(slot)
        return ReadResult.CHECKSUM_MISMATCH if slot in self.damaged else ReadResult.OK

    def close(self):
        pass


def job_of_three():
    """Chunks at disk slots 3, 4 and 6 into blocks (1, 2), (5, 6) and (8, 9)."""
    return LoadJob(1, "req", tuple(
        ChunkMove(blocks, cpu_slot, Place("disk", slot, (0,)))
        for blocks, cpu_slot, slot in (((1, 2), 0, 3), ((5, 6), 1, 4), ((8, 9), 2, 6))))


def holds(planes, blocks, value):
    return all(bool((p[list(blocks)] == value).all()) for p in planes)


def test_chunks_read_are_in_the_engine_while_the_load_still_reads(planes):
    """The poll after two reads ended copies those two chunks, not waiting for the
    third read; the request is reported once the third chunk is copied too."""
    slab = SlotGatedSlab(gated={6})
    worker = make_worker(planes, slab)
    worker.start_loads([job_of_three()])
    wait_until(lambda: {3, 4} <= slab.read_slots)
    assert worker.poll().finished_req_ids == set()  # the third chunk still reads
    assert holds(planes, (1, 2), 4) and holds(planes, (5, 6), 5)
    slab.release.set()
    _, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert not failed
    assert holds(planes, (8, 9), 7)
    worker.close()


def test_a_chunk_that_fails_after_others_were_copied_is_the_only_one_recomputed(planes):
    slab = SlotGatedSlab(gated={6}, damaged={6})
    worker = make_worker(planes, slab)
    worker.start_loads([job_of_three()])
    wait_until(lambda: {3, 4} <= slab.read_slots)
    worker.poll()  # copies the first two
    slab.release.set()
    reports, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert failed == {8, 9}
    assert holds(planes, (1, 2), 4) and holds(planes, (5, 6), 5)
    loaded = [x.loaded[1] for x in reports if 1 in x.loaded]
    assert loaded == [{0: frozenset({2})}]
    assert [x.bad_reads[1] for x in reports if 1 in x.bad_reads] == [{0: frozenset({2})}]
    worker.close()


@pytest.mark.parametrize("ending", ["timeout", "pause"])
def test_a_load_cut_short_after_a_copy_reports_every_block_and_copies_no_more(
        planes, ending):
    """Timed out, or vLLM took the KV cache away, while its last read ran: every block
    of the request is reported failed, the chunk already copied included (vLLM
    recomputes them all), and the read that ends later never reaches the engine."""
    slab = SlotGatedSlab(gated={6})
    worker = make_worker(planes, slab, load_timeout_s=0.2 if ending == "timeout" else 30.0)
    before = blocks_of(planes, [8, 9])
    worker.start_loads([job_of_three()])
    wait_until(lambda: {3, 4} <= slab.read_slots)
    worker.poll()  # copies the first two
    assert holds(planes, (1, 2), 4)
    if ending == "pause":
        worker.pause()
    _, finished, failed = drain(worker, until=lambda r, f, b: "req" in f)
    assert failed == {1, 2, 5, 6, 8, 9}
    slab.release.set()
    reports, _, _ = drain(worker, until=lambda r, f, b: any(1 in x.loaded for x in r))
    assert [x.loaded[1] for x in reports if 1 in x.loaded] == [{0: frozenset({0, 1, 2})}]
    for p, orig in zip(planes, before):
        assert torch.equal(p[[8, 9]], orig)
    worker.close()
