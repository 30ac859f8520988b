"""Same-step loads on a worker (issue 29): a ``LoadJob`` with ``same_step`` is copied by
``start_loads`` itself, before vLLM's forward, and reported to vLLM only through its
load errors of this step: the request is running, so it is never a finished receive."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from test_runner import blocks_of, make_worker
from worker_support import drain

from kv_offload.copy.base import CopyEngine, CopyHandle
from kv_offload.jobs import ChunkMove, LoadJob, StoreJob


def _stored(worker, planes, blocks, slot):
    """Store ``blocks`` into host ``slot``; returns their bytes."""
    original = blocks_of(planes, list(blocks))
    worker.run_stores([StoreJob(100 + slot, (ChunkMove(tuple(blocks), slot),))])
    drain(worker, until=lambda r, f, b: any(x.host_stored for x in r))
    return original


def test_a_same_step_load_is_in_the_engine_when_start_loads_returns(planes):
    worker = make_worker(planes, None)
    original = _stored(worker, planes, (3, 7), 1)
    for p in planes:
        p[[9, 10]] = 0
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    for p, orig in zip(planes, original):  # what the forward that follows reads
        assert torch.equal(p[[9, 10]], orig)
    result = worker.poll()
    assert result.finished_req_ids == set() and not result.failed_block_ids
    assert worker.take_report().loaded == {2: {0: frozenset()}}  # the scheduler unpins
    assert not worker.has_pending_jobs()
    worker.close()


def test_a_failed_same_step_chunk_is_a_load_error_of_the_same_step_not_a_receive(planes):
    """A chunk without a CPU slot (it vanished between lookup and plan) and a copy that
    raises both fail in the step that runs the request: vLLM truncates its computed tokens
    at the first failed block and recomputes, before it uses the step's output."""
    worker = make_worker(planes, None)
    _stored(worker, planes, (3, 7), 1)
    worker.start_loads([LoadJob(2, "a", (ChunkMove((9, 10), 1), ChunkMove((11, 12), None)),
                                same_step=True)])
    result = worker.poll()
    assert result.failed_block_ids == {11, 12} and result.finished_req_ids == set()
    assert result.failed_req_ids == set()  # failed_recving is for waiting requests only
    assert worker.take_report().loaded == {2: {0: frozenset({1})}}

    def broken(*args, **kwargs):
        raise RuntimeError("copy failed")

    worker.engine.load = broken
    worker.start_loads([LoadJob(3, "b", (ChunkMove((13, 14), 1),), same_step=True)])
    result = worker.poll()
    assert result.failed_block_ids == {13, 14} and result.finished_req_ids == set()
    worker.close()


def test_a_same_step_load_while_paused_fails_every_block_and_copies_nothing(planes):
    worker = make_worker(planes, None)
    _stored(worker, planes, (3, 7), 1)
    before = blocks_of(planes, [9, 10])
    worker.pause()
    worker.take_report()  # the pause itself
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    assert worker.poll().failed_block_ids == {9, 10}
    assert all(torch.equal(p[[9, 10]], b) for p, b in zip(planes, before))
    # ... and the job is reported, so the scheduler releases its pins (review, issue 29)
    assert worker.take_report().loaded == {2: {0: frozenset({0})}}
    assert not worker.has_pending_jobs()
    worker.close()


class _StreamEngine(CopyEngine):
    """An engine with streams, recorded: which thread issued each call, and fences."""

    def __init__(self, inner):
        self.inner, self.calls, self.release = inner, [], threading.Event()

    def store(self, block_ids, slots, *, after=None):
        return self.inner.store(block_ids, slots, after=after)

    def load(self, slots, block_ids, *, after=None):
        self.calls.append(("load", threading.get_ident(), after))
        return self.inner.load(slots, block_ids, after=after)

    def fence(self, handle):
        self.calls.append(("fence", threading.get_ident(), None))

    def is_done(self, handle: CopyHandle) -> bool:
        return self.release.is_set()

    def wait(self, handle):
        self.calls.append(("wait", threading.get_ident(), None))
        assert self.release.wait(10)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("fail_after", [False, True])
def test_an_engine_with_streams_orders_the_forward_after_the_copy_without_waiting(
        planes, fail_after):
    """On CUDA the copy is issued and fenced on vLLM's thread (the forward waits for it on
    the device, the host does not); its completion is awaited on the copy thread, and
    only then is the job reported to the scheduler (which unpins the slots)."""
    worker = make_worker(planes, None)
    _stored(worker, planes, (3, 7), 1)
    engine = _StreamEngine(worker.engine)
    worker.engine = engine
    if fail_after:
        def wait(handle):
            engine.calls.append(("wait", threading.get_ident(), None))
            engine.release.wait(10)
            raise RuntimeError("device error")
        engine.wait = wait
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    me = threading.get_ident()
    assert [(c[0], c[1] == me) for c in engine.calls[:2]] == [("load", True), ("fence", True)]
    assert worker.poll().failed_block_ids == set()  # the copy has not ended yet
    assert worker.take_report() is None  # slots stay pinned until it has
    engine.release.set()
    reports, finished, failed = drain(worker, until=lambda r, f, b: any(x.loaded for x in r))
    assert engine.calls[2][0] == "wait" and engine.calls[2][1] != me
    assert finished == set()
    loaded = [x.loaded for x in reports if x.loaded][0]
    assert loaded == {2: {0: frozenset({0} if fail_after else ())}}
    worker.close()


def test_async_and_same_step_jobs_in_one_call_each_take_their_path(planes):
    worker = make_worker(planes, None)
    original = _stored(worker, planes, (3, 7), 1)
    worker.start_loads([LoadJob(2, "sync", (ChunkMove((9, 10), 1),), same_step=True),
                        LoadJob(3, "async", (ChunkMove((11, 12), 1),))])
    result = worker.poll()
    assert result.finished_req_ids == {"async"} and not result.failed_block_ids
    for p, orig in zip(planes, original):
        assert torch.equal(p[[9, 10]], orig) and torch.equal(p[[11, 12]], orig)
    assert np.array_equal(sorted(worker.take_report().loaded), [2, 3])
    worker.close()
