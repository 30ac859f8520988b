"""Where the worker's threads run when vLLM binds the model's OpenMP threads to cores.

Regression scenario: vLLM's CPU backend binds the model's main thread to one core
(``GOMP_CPU_AFFINITY=0``) and reserves the others; threads started afterwards inherit that
core, so kv-offload's disk I/O, loads and background stores queued behind the forward on
core 0 while core 1 idled (store-heavy throughput 0.87x plain vLLM with engine processes).
"""

from __future__ import annotations

import os

import pytest
import torch
from worker_support import drain

from kv_offload.copy import make_copy_engine
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.jobs import ChunkMove, LoadJob, StoreJob
from kv_offload.worker import OffloadWorker
from kv_offload.worker.affinity import ThreadPlacement, openmp_cpus, parse_cpu_list

NUM_BLOCKS, PLANE_BYTES, BPC = 8, 64, 2


@pytest.mark.parametrize(("text", "cpus"), [
    ("0", {0}), ("0 2 4-6", {0, 2, 4, 5, 6}), ("0,1", {0, 1}), ("8-14:2", {8, 10, 12, 14}),
])
def test_cpu_lists_parse(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "3-1", "1-4:0"])
def test_bad_cpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        parse_cpu_list(text)


@pytest.mark.parametrize(("environ", "cpus"), [
    ({"GOMP_CPU_AFFINITY": "0 1 2"}, {0, 1, 2}),  # vLLM with libgomp preloaded
    ({"OMP_PLACES": "{4,5,6}", "OMP_PROC_BIND": "true"}, {4, 5, 6}),  # neither preloaded
    ({"OMP_PLACES": "{0:3}", "OMP_PROC_BIND": "close"}, {0, 1, 2}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,3]"}, {2, 3}),  # libiomp
    ({"OMP_PLACES": "{0,1}"}, None),  # places without binding bind nothing
    ({"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"}, None),  # abstract: unknown cores
    ({"GOMP_CPU_AFFINITY": "x"}, None),
    ({}, None),
])
def test_the_model_cores_come_from_the_openmp_binding(environ, cpus):
    assert openmp_cpus(environ) == (None if cpus is None else frozenset(cpus))


def test_background_threads_avoid_the_model_cores():
    placement = ThreadPlacement.for_worker({"GOMP_CPU_AFFINITY": "0 1"},
                                           allowed=frozenset(range(4)))
    assert placement.background_cpus == {2, 3}
    assert placement.engine_cpus == {0, 1, 2, 3}
    assert "offload threads on 2,3" in placement.describe()


def test_a_model_on_every_core_leaves_threads_free_to_move():
    placement = ThreadPlacement.for_worker({"GOMP_CPU_AFFINITY": "0-3"},
                                           allowed=frozenset(range(4)))
    assert placement.background_cpus == {0, 1, 2, 3}  # not stuck on the main thread's core


def test_without_a_binding_threads_stay_where_they_start():
    placement = ThreadPlacement.for_worker({}, allowed=frozenset(range(4)))
    assert placement.background_cpus is None and placement.engine_cpus is None
    assert placement.describe() == "threads unbound"


class RecordingEngine:
    """A copy engine that notes the CPUs of the thread each copy runs on. It presents
    itself as asynchronous (as a streamed engine is), so that loads go through the copy
    thread; a synchronous engine copies CPU-tier loads on vLLM's thread instead."""

    synchronous = False

    def __init__(self, inner):
        self._inner = inner
        self.cpus: dict[str, set[int]] = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def store(self, *args, **kwargs):
        self.cpus["store"] = os.sched_getaffinity(0)
        return self._inner.store(*args, **kwargs)

    def load(self, *args, **kwargs):
        self.cpus["load"] = os.sched_getaffinity(0)
        return self._inner.load(*args, **kwargs)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell them apart")
def test_loads_and_background_stores_run_on_the_background_cpus():
    here = os.sched_getaffinity(0)
    background = frozenset({max(here)})
    placement = ThreadPlacement(background_cpus=background, engine_cpus=frozenset(here))
    planes = [torch.arange(NUM_BLOCKS * PLANE_BYTES, dtype=torch.uint8).view(NUM_BLOCKS, -1)
              for _ in range(2)]
    host = allocate_host_slots(4, 2 * PLANE_BYTES * BPC, pinned=False)
    engine = RecordingEngine(make_copy_engine(planes, host, BPC))
    worker = OffloadWorker(rank=0, engine=engine, host=host, io_threads=1,
                           background_stores=True, placement=placement)
    try:
        worker.run_stores([StoreJob(1, (ChunkMove((1, 2), 0),), req_ids=("a",))])
        worker.start_loads([LoadJob(2, "b", (ChunkMove((3, 4), 1),))])
        drain(worker, until=lambda *_: len(engine.cpus) == 2)  # bounds a hang only
        assert engine.cpus == {"store": background, "load": background}
        assert os.sched_getaffinity(0) == here  # vLLM's thread is left alone
    finally:
        worker.close()
