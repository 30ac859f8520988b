"""Worker start-up (plugin/worker_setup.py): the CPU tiers of every local rank fit in the host."""

from __future__ import annotations

import pytest
from vllm.distributed import parallel_state

import kv_offload.copy.host_buffer as host_buffer
import kv_offload.plugin.worker_setup as setup
from kv_offload.copy.host_buffer import InsufficientHostMemoryError
from kv_offload.plugin.worker_setup import local_tensor_parallel_ranks
from kv_offload.testing.scheduler_harness import SchedulerHarness


def test_local_ranks_are_the_tensor_parallel_ranks_over_vllms_node_count(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_node_count", lambda: 2)
    assert local_tensor_parallel_ranks(8) == 4
    assert local_tensor_parallel_ranks(1) == 1


def test_without_vllms_distributed_state_every_rank_counts_as_local(monkeypatch):
    def uninitialised() -> int:
        raise AssertionError("distributed environment is not initialized")

    monkeypatch.setattr(parallel_state, "get_node_count", uninitialised)
    assert local_tensor_parallel_ranks(4) == 4


def test_a_worker_refuses_a_cpu_size_whose_local_ranks_exceed_the_host(tmp_path, monkeypatch):
    """Issue 27, section 5: build_worker checked each rank's CPU tier alone. With 4 ranks
    of 300 KiB each (the harness's 300 slots of 1 KiB) on a host of 1 MiB, start-up now
    fails, naming cpu_size; one such rank alone fits."""
    monkeypatch.setattr(setup, "local_tensor_parallel_ranks", lambda tp_size: 4)
    monkeypatch.setattr(host_buffer, "total_host_memory", lambda: 1 << 20)
    with pytest.raises(InsufficientHostMemoryError, match="4 x 300.0 KiB.*cpu_size is per rank"):
        SchedulerHarness(tmp_path, cpu_slots=300, disk=False)
