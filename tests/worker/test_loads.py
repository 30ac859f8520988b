"""The worker's load state machine (kv_offload.worker.loads), without threads or engines."""

from __future__ import annotations

import functools
import gc
import weakref
from concurrent.futures import Future

import pytest

from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob
from kv_offload.tier_contract import Place
from kv_offload.worker.loads import WorkerLoad, WorkerLoadPhase, when_all_done


def make_load(*, started: float = 0.0) -> WorkerLoad:
    chunks = (ChunkMove((1, 2), 0, Place("disk", 5, (7,))),
              ChunkMove(block_ids=(3, SKIP_BLOCK), cpu_slot=1),
              ChunkMove(block_ids=(4, 6), cpu_slot=None))
    return WorkerLoad(LoadJob(job_id=1, req_id="r", chunks=chunks), started)


def done(value: object) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def test_sort_rows_fails_vanished_chunks_and_bad_reads():
    load = make_load()
    assert load.sort_rows({0: done(False)}, lambda job, slot: True) == [1]
    assert load.failed == {0, 2} and load.bad_reads == {0}


def test_sort_rows_waits_for_a_shared_read():
    chunks = (ChunkMove(block_ids=(1,), cpu_slot=3, after_job=9),)
    load = WorkerLoad(LoadJob(job_id=2, req_id="r", chunks=chunks), 0.0)
    asked = []
    assert load.sort_rows({}, lambda job, slot: asked.append((job, slot)) or False) == []
    assert asked == [(9, 3)] and load.failed == {0} and load.bad_reads == set()


def test_a_load_is_cancelled_only_while_reading():
    load = make_load(started=10.0)
    assert not load.cancel_if_overdue(now=15.0, timeout_s=5.0)  # not past the timeout
    assert load.begin_copy() and load.phase is WorkerLoadPhase.COPYING
    assert not load.cancel_if_overdue(now=100.0, timeout_s=5.0)  # copying: too late
    load.end_copy()
    assert load.phase is WorkerLoadPhase.DONE


def test_a_cancelled_load_never_copies_and_fails_every_block_once():
    load = make_load(started=0.0)
    assert load.cancel_if_overdue(now=6.0, timeout_s=5.0)
    assert load.phase is WorkerLoadPhase.CANCELLED
    assert not load.begin_copy() and load.phase is WorkerLoadPhase.CANCELLED
    assert load.take_failed_blocks() == {1, 2, 3, 4, 6}  # SKIP_BLOCK is no block
    assert load.take_failed_blocks() is None  # reported to vLLM once
    assert load.failed_rows() == frozenset({0, 1, 2})


def test_failed_blocks_of_a_copied_load_are_those_of_its_failed_chunks():
    load = make_load()
    assert load.take_failed_blocks() is None  # still reading: nothing to report
    load.sort_rows({0: done(True)}, lambda job, slot: True)
    load.begin_copy()
    load.future = done(None)
    load.end_copy()
    assert load.copy_ended()
    assert load.take_failed_blocks() == {4, 6}
    assert load.failed_rows() == frozenset({2})


@pytest.mark.parametrize("num_pending", [0, 1, 3])
def test_when_all_done_calls_once_after_the_last(num_pending):
    pending: list[Future] = [Future() for _ in range(num_pending)]
    calls = []
    when_all_done([done(True), *pending], lambda: calls.append(1))
    for future in pending:
        assert calls == []
        future.set_result(True)
    assert calls == [1]


def test_when_all_done_keeps_no_reference_to_its_callback_once_called():
    """Issue 27, section 5: the worker's callback holds the load and its reads, and the
    reads held the callback: a cycle (read -> callback -> partial -> reads -> read), so a
    load, its CUDA compute mark included, outlived its use until the garbage collector
    ran, on whatever thread that was. Reference counting alone frees it now."""
    class Load:  # stands for a WorkerLoad (slotted, so not weakly referable)
        pass

    load = Load()
    freed = weakref.ref(load)
    read: Future = Future()
    when_all_done([read], functools.partial(lambda load, reads: None, load, {0: read}))
    del load
    gc.disable()
    try:
        read.set_result(True)
        assert freed() is None, "the read still holds the load"
    finally:
        gc.enable()
