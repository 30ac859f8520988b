"""Same-step loads on a worker (issue 29): a ``LoadJob`` with ``same_step`` is copied by
``start_loads`` itself, before vLLM's forward, and reported to vLLM only through its
load errors of this step: the request is running, so it is never a finished receive."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_runner import SLOT_BYTES, blocks_of, make_worker
from worker_support import drain

from kv_offload.copy import cpu_kernel, make_copy_engine
from kv_offload.copy.base import CopyEngine, CopyHandle
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.copy.layers import PlaneLayers
from kv_offload.jobs import SKIP_BLOCK, ChunkMove, LoadJob, StoreJob
from kv_offload.testing.tiers import tier_ios
from kv_offload.worker import OffloadWorker
from kv_offload.worker.audit import build_audit


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


# -- the CPU backend copies a same-step load layer by layer ----------------------------------

LAYERS = ("model.layers.0.attn", "model.layers.1.attn")  # the fixture's two planes


def _per_layer(worker) -> None:
    """The step's forward waits per layer, as vLLM's attention layers do
    (``wait_for_layer_load``), with the worker's two planes as two layers."""
    worker.layer_waits.layers = PlaneLayers.from_counts(LAYERS, [1, 1])
    worker.layer_waits.expect(SimpleNamespace(attn_metadata=object(), ubatch_slices=None,
                                              cudagraph_runtime_mode=None))


@pytest.fixture
def gated_layers(monkeypatch):
    """Holds the layer thread's copy of layer 1 until ``release`` is set (layer 0 goes
    through); ``raise_on`` makes the copy of that layer raise instead."""
    gate = SimpleNamespace(release=threading.Event(), raise_on=None, copied=[])
    real = cpu_kernel.copy_pieces

    def copy_pieces(store, stream, ids, slot_addr, table, lo, hi):
        layer = len(gate.copied)
        if threading.current_thread().name.startswith("kv-copy-layers"):
            gate.copied.append(layer)
            if layer == gate.raise_on:
                raise RuntimeError("copy failed")
            if layer == 1:
                assert gate.release.wait(10)
        return real(store, stream, ids, slot_addr, table, lo, hi)

    monkeypatch.setattr(cpu_kernel, "copy_pieces", copy_pieces)
    return gate


def test_a_cpu_same_step_load_lands_each_layer_before_that_layer_waits(planes, gated_layers):
    """Issue 29 on the CPU backend: a same-step load is copied on a thread of its own, one
    layer after the other, and each attention layer waits for its own layer only: layer 0
    is read while layer 1 is still copying (the overlap), and every byte is in place when
    its layer reads it. The load's last block, which the forward writes into, is copied
    whole before the forward."""
    worker = make_worker(planes, None)
    original = _stored(worker, planes, (3, 7), 1)
    for p in planes:
        p[[9, 10]] = 0
    _per_layer(worker)
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    worker.layer_waits.wait(LAYERS[0])
    assert torch.equal(planes[0][[9, 10]], original[0][[0, 1]])
    assert torch.equal(planes[1][10], original[1][1])  # the last block: before the forward
    assert torch.count_nonzero(planes[1][9]) == 0  # layer 1 still copying
    gated_layers.release.set()
    worker.layer_waits.wait(LAYERS[1])
    assert torch.equal(planes[1][[9, 10]], original[1][[0, 1]])
    result = worker.poll()
    assert result.failed_block_ids == set() and result.finished_req_ids == set()
    assert worker.take_report().loaded == {2: {0: frozenset()}}
    assert worker.take_stats()["bytes_load"] == SLOT_BYTES
    worker.close()


def test_a_cpu_copy_per_layer_that_fails_is_a_load_error_of_its_step_and_spoils_its_stores(
        planes, gated_layers):
    """The layer thread's copy raises after the forward started: the step's ``poll``
    reports the load's blocks failed (vLLM recomputes them), and the stores of that step,
    computed on them, are discarded (reported failed, never published)."""
    worker = make_worker(planes, None)
    _stored(worker, planes, (3, 7), 1)
    gated_layers.raise_on = 1
    _per_layer(worker)
    assert worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    for name in LAYERS:
        worker.layer_waits.wait(name)  # a layer whose copy raised does not wait for ever
    worker.run_stores([StoreJob(5, (ChunkMove((9, 10), 2),))])
    result = worker.poll()
    assert result.failed_block_ids == {9, 10} and result.finished_req_ids == set()
    reports, _, _ = drain(worker, until=lambda r, f, b: any(x.host_failed for x in r))
    assert any(x.loaded.get(2) == {0: frozenset({0})} for x in reports)
    assert all(5 not in x.host_stored for x in reports)
    worker.close()


def test_without_per_layer_waits_the_cpu_copies_before_the_forward(planes, gated_layers):
    """A forward whose layers will not wait (no attention metadata, e.g.) gets the whole
    load before ``start_loads`` returns, on vLLM's thread, as before."""
    worker = make_worker(planes, None)
    original = _stored(worker, planes, (3, 7), 1)
    for p in planes:
        p[[9, 10]] = 0
    worker.layer_waits.layers = PlaneLayers.from_counts(LAYERS, [1, 1])
    worker.layer_waits.expect(SimpleNamespace(attn_metadata=None))
    worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    for p, orig in zip(planes, original):
        assert torch.equal(p[[9, 10]], orig)
    assert gated_layers.copied == []  # no layer thread
    assert worker.poll().failed_block_ids == set()
    worker.close()


@pytest.mark.parametrize("corrupt", ["", "rest", "last"])
def test_the_audit_of_a_cpu_copy_per_layer_skips_the_block_the_forward_writes(planes, corrupt):
    """The runtime audit re-reads a same-step copy per layer: each load's last block right
    after its copy, before the forward writes its next tokens into it, the other blocks
    after the forward (so the forward's writes are no false mismatch); a loaded block that
    differs from its host slot fails the chunk in that step and spoils the step's stores."""
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    engine = make_copy_engine(planes, host, 2)
    worker = OffloadWorker(rank=0, engine=engine, host=host, io_threads=2,
                           tiers=tier_ios(None, slot_bytes=SLOT_BYTES),
                           audit=build_audit(planes, host, 2, engine=engine, rate=1.0))
    _stored(worker, planes, (3, 7), 1)
    _per_layer(worker)
    real_load = engine.load

    def load(slots, block_ids, **kwargs):  # the last block's copy flips a bit
        handle = real_load(slots, block_ids, **kwargs)
        if corrupt == "last" and (np.asarray(block_ids) == 10).any():
            planes[0][10, 3] ^= 1
        return handle

    engine.load = load
    ok = worker.start_loads([LoadJob(2, "req", (ChunkMove((9, 10), 1),), same_step=True)])
    assert ok == (corrupt != "last")  # a mismatch before the forward: start_loads says so
    for name in LAYERS:
        worker.layer_waits.wait(name)
    for p in planes:  # the forward writes the hit's next tokens into its last block
        p[10, -8:] = 255 - p[10, -8:]
    if corrupt == "rest":
        planes[1][9, 0] ^= 1
    worker.run_stores([StoreJob(5, (ChunkMove((11, 12), 2),))], discard=not ok)
    result = worker.poll()
    assert result.failed_block_ids == ({9, 10} if corrupt else set())
    reports, _, _ = drain(worker, until=lambda r, f, b: any(
        x.host_failed or x.host_stored for x in r))
    assert any(5 in (x.host_failed if corrupt else x.host_stored) for x in reports)
    assert worker.take_stats()["audit_chunks"] >= 1
    worker.close()


def test_a_layer_never_waited_for_reports_every_failed_chunk_of_the_load(planes):
    """Review of the per-layer CPU path: a load whose first chunk vanished from the CPU
    tier (a failed move) and whose second is copied per layer, in a step where layer 1
    never waits. ``end_forward`` fails the load and reports it to vLLM itself: every
    failed chunk's blocks must be among this step's load errors, the vanished chunk's
    too. Else vLLM truncates the request at the first block reported (chunk 1) and keeps
    chunk 0's never-loaded blocks as computed KV (and in its prefix cache)."""
    worker = make_worker(planes, None)
    _stored(worker, planes, (3, 7), 1)
    _per_layer(worker)
    assert not worker.start_loads([LoadJob(2, "req", (
        ChunkMove((9, 10), None), ChunkMove((11, 12), 1)), same_step=True)])
    worker.layer_waits.wait(LAYERS[0])  # layer 1 never waits
    result = worker.poll()
    assert result.failed_block_ids == {9, 10, 11, 12}
    assert worker.take_report().loaded == {2: {0: frozenset({0, 1})}}
    worker.close()


def test_the_load_bandwidth_of_a_cpu_copy_per_layer_counts_its_copies_not_the_forward(
        planes):
    """``bytes_load / seconds_load`` sizes the same-step budget: the seconds of a copy per
    layer are those of its copies, the last block's made before the forward included,
    and never the forward's (a load whose only block is its last one has nothing to copy
    per layer)."""
    worker = make_worker(planes, None)
    _stored(worker, planes, (3, 7), 1)
    worker.take_stats()
    _per_layer(worker)
    worker.start_loads([LoadJob(2, "a", (ChunkMove((SKIP_BLOCK, 10), 1),), same_step=True)])
    for name in LAYERS:
        worker.layer_waits.wait(name)
    time.sleep(0.3)  # the forward
    assert worker.poll().failed_block_ids == set()
    stats = worker.take_stats()
    assert stats["bytes_load"] == SLOT_BYTES // 2
    assert stats["seconds_load"] < 0.3

    real_load = worker.engine.load

    def slow_load(slots, block_ids, **kwargs):  # the last block's copy, on vLLM's thread
        time.sleep(0.2)
        return real_load(slots, block_ids, **kwargs)

    worker.engine.load = slow_load
    _per_layer(worker)
    worker.start_loads([LoadJob(3, "b", (ChunkMove((11, 12), 1),), same_step=True)])
    for name in LAYERS:
        worker.layer_waits.wait(name)
    assert worker.poll().failed_block_ids == set()
    stats = worker.take_stats()
    assert stats["bytes_load"] == SLOT_BYTES and stats["seconds_load"] >= 0.2
    worker.close()
