"""Faults below the engine: OffloadScheduler and OffloadWorker wired as the connector wires
them (``Rig``), with real torch copies, a real LMDB index and real or fake slab files.

Each test ends by asserting the connector is idle: no pinned, STORING or STAGING CPU
entry, no job in flight on either side, no disk pin or reservation. Worker-only
contracts (load timeout, a late read never reaching the engine, EROFS reported once)
are in tests/worker/test_runner.py and not repeated here.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import pytest
import torch
from reliability_support import (
    RIG_CHUNK,
    Rig,
    open_rig_index,
    open_rig_slab,
    rig_request,
    rig_tokens,
)

from kv_offload.disk import StorePathError
from kv_offload.scheduler import SlotState

TOKENS = 4 * RIG_CHUNK + 1  # 4 full chunks and one token to compute


@pytest.fixture
def stored(tmp_path):
    """A store holding request "w" (4 chunks), written through a first rig; returns
    (root, request tokens, the engine bytes of its blocks)."""
    root = tmp_path / "store"
    index, slab = open_rig_index(root), open_rig_slab(root)
    rig = Rig(disk_index=index, slab=slab)
    req = rig_request("w", rig_tokens(1, TOKENS))
    rig.admit(req)
    rig.run_step([("w", TOKENS)])
    rig.drain()
    assert index.stats()["num_entries"] == 4
    expected = [p[rig.block_ids("w")[:8]].clone() for p in rig.kv]
    rig.close()
    index.close()
    return root, rig_tokens(1, TOKENS), expected


HANG_S = 60.0  # how long a GatedSlab read waits for its release at most


class GatedSlab:
    """Wraps a slab; reads wait until ``release`` is set (a slow disk), or raise ``exc``."""

    def __init__(self, slab, *, exc: BaseException | None = None) -> None:
        self.slab, self.exc, self.release = slab, exc, threading.Event()
        self.reads = 0

    def read(self, slot, buf, expected):
        self.reads += 1
        if self.exc is not None:
            raise self.exc
        # Longer than any deadline below: those bound a hang, this one too.
        assert self.release.wait(HANG_S), "the test never released the read"
        return self.slab.read(slot, buf, expected)

    def write(self, slot, buf):
        return self.slab.write(slot, buf)

    def close(self):
        self.slab.close()


def restarted_rig(root, **kw):
    """A fresh scheduler and worker on the store (the CPU tier is empty): a restart."""
    index = open_rig_index(root)
    slab = GatedSlab(open_rig_slab(root), **kw)
    return Rig(disk_index=index, slab=slab), index, slab


def test_abort_while_loading_from_disk_releases_every_pin(stored):
    """Two requests wait on one staged disk read (the second shares it); both are aborted
    before the read ends. Pins are held until the worker reports, then all released; the
    read chunks are published in the CPU tier, bytes intact."""
    root, tokens, expected = stored
    rig, index, slab = restarted_rig(root)
    x, y = rig_request("x", tokens), rig_request("y", tokens)
    assert rig.admit(x) == rig.admit(y) == 4 * RIG_CHUNK
    rig.run_step()  # hands both loads to the worker; the reads block
    rig.sched.request_finished("x")  # vLLM aborts both while they are loading
    rig.sched.request_finished("y")
    counts = rig.sched.cpu.counts()
    assert counts["staging"] == 4 and counts["pinned"] == 4
    assert index.stats()["pinned"] == 4, "a slot being read must stay pinned"
    slab.release.set()
    rig.drain()
    assert rig.loads_finished == {"x", "y"} and not rig.failed_blocks
    assert slab.reads == 4, "the shared chunks were read once"
    for p, want in zip(rig.kv, expected):
        assert torch.equal(p[rig.block_ids("y")[:8]], want)
    assert rig.sched.cpu.counts()["ready"] == 4
    assert rig.idle_problems() == []
    rig.close()
    index.close()


def test_abort_before_the_load_is_handed_out_still_releases(stored):
    """vLLM aborts a request between plan_load and the next plan_step: the queued load is
    still executed (vLLM keeps its blocks until the worker reports) and releases its pins."""
    root, tokens, _ = stored
    rig, index, slab = restarted_rig(root)
    slab.release.set()
    rig.admit(rig_request("x", tokens))
    rig.sched.request_finished("x")
    rig.drain()
    assert rig.loads_finished == {"x"}
    assert rig.idle_problems() == []
    rig.close()
    index.close()


def test_abort_while_storing_commits_the_right_bytes_and_releases(tmp_path):
    """Aborted right after the step that planned its stores, its blocks reused at once:
    the engine -> host copy was complete when the step ended (invariant 3), so what is
    committed, and loaded after a restart, is the request's KV, not the reuser's."""
    root = tmp_path / "store"
    index, slab = open_rig_index(root), open_rig_slab(root)
    rig = Rig(disk_index=index, slab=slab)
    rig.admit(rig_request("s", rig_tokens(2, TOKENS)))
    original = [p[rig.block_ids("s")[:8]].clone() for p in rig.kv]
    plan = rig.sched.plan_step([("s", TOKENS)])
    rig.worker.run_stores(plan.stores)
    rig.sched.request_finished("s")  # vLLM frees the blocks now...
    for p in rig.kv:
        p[rig.block_ids("s")] = 0  # ...and another request overwrites them
    rig.drain()
    assert index.stats()["num_entries"] == 4 and rig.idle_problems() == []
    rig.close()
    index.close()
    again, index, slab = restarted_rig(root)
    slab.release.set()
    again.admit(rig_request("filler", rig_tokens(9, 9)))  # different blocks than "s"
    assert again.admit(rig_request("t", rig_tokens(2, TOKENS))) == 4 * RIG_CHUNK
    again.drain()
    for p, want in zip(again.kv, original):
        assert torch.equal(p[again.block_ids("t")[:8]], want)
    assert again.idle_problems() == []
    again.close()
    index.close()


def test_preempted_while_storing_never_loads_incomplete_chunks(tmp_path):
    """Preempted while its chunks are STORING, the request is rescheduled: the lookup stops
    at the STORING chunk (0 hit tokens, it recomputes) and nothing is stored twice."""
    rig = Rig()
    req = rig_request("p", rig_tokens(3, TOKENS))
    rig.admit(req)
    plan = rig.sched.plan_step([("p", TOKENS)])
    assert rig.sched.cpu.counts()["storing"] == 4
    assert rig.admit(req) == 0  # rescheduled after preemption: num_computed_tokens = 0
    assert not rig.sched.plan_step([("p", TOKENS)]).stores
    rig.worker.run_stores(plan.stores)
    rig.drain()
    assert rig.sched.cpu.counts()["ready"] == 4
    assert rig.admit(rig_request("q", rig_tokens(3, TOKENS))) == 4 * RIG_CHUNK
    rig.drain()
    assert rig.idle_problems() == []
    rig.close()


@pytest.mark.parametrize("exc", [RuntimeError("injected"), MemoryError(), KeyError("slot")],
                         ids=["RuntimeError", "MemoryError", "KeyError"])
def test_unexpected_exception_from_a_slab_read_is_a_load_error(stored, exc):
    """A slab read raising something no one planned for is a miss: both requests (one
    reading, one sharing the read) get their blocks reported for recompute, the entries
    are dropped from both tiers, every pin is released, nothing crashes."""
    root, tokens, _ = stored
    rig, index, _ = restarted_rig(root, exc=exc)
    rig.admit(rig_request("x", tokens))
    rig.admit(rig_request("y", tokens))
    rig.drain()
    assert rig.loads_finished == {"x", "y"}
    assert rig.failed_blocks == set(rig.block_ids("x")[:8]) | set(rig.block_ids("y")[:8])
    assert rig.sched.counters.load_errors >= 4
    assert index.stats()["num_entries"] == 0 and len(rig.sched.cpu) == 0
    assert rig.idle_problems() == []
    rig.close()
    index.close()


class RaisingWriteSlab:
    """A slab whose writes raise ``exc`` (not an OSError)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def write(self, slot, buf):
        raise self.exc

    def read(self, slot, buf, expected):
        raise AssertionError("no read expected")

    def close(self):
        pass


@pytest.mark.parametrize("exc", [
    RuntimeError("injected"),
    StorePathError("cannot create disk store directory /x: Read-only file system"),
], ids=["RuntimeError", "StorePathError"])
def test_unexpected_exception_from_a_slab_write_is_a_failed_store(tmp_path, exc):
    index = open_rig_index(tmp_path)
    rig = Rig(disk_index=index, slab=RaisingWriteSlab(exc))
    rig.admit(rig_request("s", rig_tokens(4, TOKENS)))
    rig.run_step([("s", TOKENS)])
    rig.drain()
    assert index.stats()["num_entries"] == 0
    assert rig.sched.cpu.counts()["ready"] == 4, "the CPU tier still serves the chunks"
    assert rig.idle_problems() == []
    rig.close()
    index.close()


class FlakyFullSlab:
    """Delegates to a real slab, except while ``full`` is set: writes raise ENOSPC."""

    def __init__(self, slab) -> None:
        self.slab, self.full = slab, False

    def write(self, slot, buf):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.slab.write(slot, buf)

    def read(self, slot, buf, expected):
        return self.slab.read(slot, buf, expected)

    def close(self):
        self.slab.close()


def store_requests(rig: Rig, seed: int, count: int) -> None:
    for i in range(count):
        rid = f"r{seed}-{i}"
        rig.admit(rig_request(rid, rig_tokens(seed + i, TOKENS)))
        rig.run_step([(rid, TOKENS)])
        rig.sched.request_finished(rid)
    rig.drain()


def test_enospc_burst_is_counted_logged_once_and_never_breaks_the_tier(tmp_path, caplog):
    index = open_rig_index(tmp_path, num_slots=64)
    slab = FlakyFullSlab(open_rig_slab(tmp_path))
    rig = Rig(disk_index=index, slab=slab, num_cpu_slots=64)
    slab.full = True
    with caplog.at_level(logging.WARNING, logger="kv_offload"):
        store_requests(rig, 10, 5)  # 20 chunks, 20 failed writes (more than DISK_BROKEN_AFTER)
    warnings = [r for r in caplog.records if "disk write failed" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert rig.stats["disk_write_errors"] == 20
    assert rig.sched.disk_enabled, "ENOSPC is per chunk, it must not disable the tier"
    assert index.stats()["num_entries"] == 0 and index.stats()["reserved"] == 0
    assert rig.sched.cpu.counts()["ready"] == 20, "the CPU tier still serves the chunks"
    slab.full = False
    store_requests(rig, 40, 2)
    assert index.stats()["num_entries"] == 8, "stores resume once space is back"
    assert index.check() == []
    assert rig.idle_problems() == []
    rig.close()
    index.close()


def test_a_second_enospc_burst_after_recovery_is_logged_again(tmp_path, caplog):
    index = open_rig_index(tmp_path, num_slots=64)
    slab = FlakyFullSlab(open_rig_slab(tmp_path))
    rig = Rig(disk_index=index, slab=slab, num_cpu_slots=64)
    with caplog.at_level(logging.WARNING, logger="kv_offload"):
        for seed, full in ((10, True), (20, False), (30, True)):
            slab.full = full
            store_requests(rig, seed, 2)
    warnings = [r for r in caplog.records if "disk write failed" in r.getMessage()]
    assert len(warnings) == 2
    rig.close()
    index.close()


def test_disk_broken_mid_flight_releases_everything_and_stops_disk_use(stored, caplog):
    """The worker reports the disk broken while a staged load and stores are in flight:
    the scheduler logs once, stops using the disk, and still releases every disk pin and
    reservation as the in-flight jobs complete."""
    from kv_offload.jobs import WorkerReport

    root, tokens, _ = stored
    rig, index, slab = restarted_rig(root)
    rig.admit(rig_request("x", tokens))
    rig.admit(rig_request("new", rig_tokens(5, TOKENS)))
    rig.run_step([("new", TOKENS)])  # a staged load (blocked) and a disk store in flight
    assert index.stats()["reserved"] == 4 and index.stats()["pinned"] == 4
    with caplog.at_level(logging.ERROR, logger="kv_offload"):
        rig.sched.on_report(WorkerReport(broken={"disk": "rank 0: injected"}))
        rig.sched.on_report(WorkerReport(broken={"disk": "rank 0: injected again"}))
    assert [r.getMessage().count("keeps failing") for r in caplog.records] == [1]
    slab.release.set()
    rig.drain()
    assert not rig.sched.disk_enabled
    assert rig.admit(rig_request("z", tokens)) == 4 * RIG_CHUNK  # the CPU tier still hits
    rig.admit(rig_request("other", rig_tokens(6, TOKENS)))
    before = index.stats()["counters"]["hits"] + index.stats()["counters"]["misses"]
    rig.run_step([("other", TOKENS)])
    rig.drain()
    after = index.stats()
    assert after["counters"]["hits"] + after["counters"]["misses"] == before, "disk was used"
    assert after["reserved"] == 0 and after["pinned"] == 0
    assert rig.idle_problems() == []
    rig.close()
    index.close()


def test_a_hung_disk_read_does_not_stall_cpu_tier_loads(stored):
    root, tokens, _ = stored
    rig, index, slab = restarted_rig(root)
    rig.worker.load_timeout_s = 2 * HANG_S  # "x" neither times out nor ends: it hangs
    cpu_only = rig_request("c", rig_tokens(7, TOKENS))
    rig.admit(cpu_only)
    rig.run_step([("c", TOKENS)])
    rig.drain()  # "c" is in the CPU tier now
    rig.admit(rig_request("x", tokens))  # its read hangs
    rig.run_step()
    rig.admit(rig_request("c2", rig_tokens(7, TOKENS)))
    deadline = time.monotonic() + HANG_S / 2  # bounds a hang only
    while "c2" not in rig.loads_finished and time.monotonic() < deadline:
        rig.run_step()
        time.sleep(0.01)
    slab.release.set()
    try:
        assert "c2" in rig.loads_finished and not rig.failed_blocks, \
            "a CPU-tier load waited on an unrelated disk read"
    finally:
        rig.drain()
        rig.close()
        index.close()


def test_load_timeout_releases_pins_only_when_the_read_ends(stored):
    """Planner side of the load timeout: vLLM is told at once (blocks failed, request
    finished) but the slots stay pinned until the slow read really returns."""
    root, tokens, _ = stored
    rig, index, slab = restarted_rig(root)
    rig.worker.load_timeout_s = 0.2
    rig.admit(rig_request("x", tokens))
    deadline = time.monotonic() + HANG_S / 2  # bounds a hang only: the read hangs longer
    while "x" not in rig.loads_finished and time.monotonic() < deadline:
        rig.run_step()
        time.sleep(0.02)
    assert "x" in rig.loads_finished and len(rig.failed_blocks) == 8
    assert index.stats()["pinned"] == 4 and rig.sched.cpu.counts()["pinned"] == 4
    slab.release.set()
    rig.drain()
    assert rig.idle_problems() == []
    assert rig.sched.cpu.state(rig_request("x", tokens).block_hashes[1]) in (
        None, SlotState.READY)
    rig.close()
    index.close()


def test_idle_rig_has_no_stray_state():
    """Guard for the helper itself: a fresh rig is idle and idle_problems() sees a pin."""
    rig = Rig()
    assert rig.idle_problems() == [] and rig.sched.cpu.counts()["free"] == 16
    req = rig_request("a", rig_tokens(8, TOKENS))
    rig.admit(req)
    rig.sched.plan_step([("a", TOKENS)])  # stores planned, never executed
    assert rig.idle_problems() != []
    rig.close()
