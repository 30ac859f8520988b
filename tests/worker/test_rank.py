"""The worker's tensor-parallel rank: never guessed.

Regression: ``tensor_parallel_rank()`` returned 0 on any exception, so with TP > 1 every
rank would write rank 0's slab file and remote keys (rank 0 could then load rank 1's KV).
"""

from __future__ import annotations

import pytest
from vllm.distributed import parallel_state

from kv_offload.plugin.engine_info import UnsupportedEngineError
from kv_offload.plugin.worker_setup import tensor_parallel_rank


def fake_state(monkeypatch, *, initialised: bool, rank: int = 0, world: int = 1,
               broken: bool = False):
    def rank_of() -> int:
        if broken:
            raise AssertionError("tensor model parallel group is not initialized")
        return rank

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: initialised)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", rank_of)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: world)


def test_single_process_without_parallel_state_is_rank_0(monkeypatch):
    fake_state(monkeypatch, initialised=False)
    assert tensor_parallel_rank(1) == 0


def test_unknown_rank_with_tp_above_1_fails_start_up(monkeypatch):
    fake_state(monkeypatch, initialised=False)
    with pytest.raises(UnsupportedEngineError, match="tensor_parallel_size=2"):
        tensor_parallel_rank(2)


def test_the_initialised_rank_is_used(monkeypatch):
    fake_state(monkeypatch, initialised=True, rank=1, world=2)
    assert tensor_parallel_rank(2) == 1


def test_a_failing_parallel_state_is_an_error_not_rank_0(monkeypatch):
    fake_state(monkeypatch, initialised=True, world=2, broken=True)
    with pytest.raises(UnsupportedEngineError, match="cannot read this worker's"):
        tensor_parallel_rank(2)


def test_a_group_size_other_than_the_config_is_refused(monkeypatch):
    fake_state(monkeypatch, initialised=True, rank=0, world=4)
    with pytest.raises(UnsupportedEngineError, match="group of 4.*tensor_parallel_size=2"):
        tensor_parallel_rank(2)
