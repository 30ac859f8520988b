"""When the connector lets hits load in the step that schedules them (issue 29): on with
vLLM's synchronous scheduler (the CPU backend's), off where vLLM cannot take them back
safely (async scheduling) or where they would wait for a batch slot (vLLM 0.34's
--max-num-inflight-kv-loads)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kv_offload import OffloadConfig
from kv_offload.plugin.connector import KVOffloadConnector
from kv_offload.testing.scheduler_harness import build_kv_cache_config, build_vllm_config

BLOCK = 8


@pytest.mark.parametrize("setting, expected_s", [
    ({}, 0.02), ({"sync_load_budget_ms": 5}, 0.005), ({"sync_load_budget_ms": 0}, None),
    ({"async_scheduling": True}, None), ({"max_num_inflight_kv_loads": 2}, None)])
def test_same_step_loads_follow_the_option_and_vllms_scheduler(setting, expected_s):
    setting = dict(setting)
    budget_ms = setting.pop("sync_load_budget_ms", 20.0)
    offload = OffloadConfig(cpu_size=64 * 2 * 2 * BLOCK * 4 * 4 * 4, chunk_tokens=2 * BLOCK,
                            sync_load_budget_ms=budget_ms)
    vllm_config = build_vllm_config(offload, block_size=BLOCK, max_num_batched_tokens=64,
                                    max_num_seqs=8)
    for name, value in setting.items():  # max_num_inflight_kv_loads: vLLM 0.34's option
        object.__setattr__(vllm_config.scheduler_config, name, value)
    conn = KVOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER,
                              build_kv_cache_config(64, BLOCK))
    try:
        budget = conn._sched.same_step
        assert (None if budget is None else budget.budget_s) == expected_s
    finally:
        conn.shutdown()


def _scheduler_connector() -> KVOffloadConnector:
    offload = OffloadConfig(cpu_size=64 * 2 * 2 * BLOCK * 4 * 4 * 4, chunk_tokens=2 * BLOCK)
    vllm_config = build_vllm_config(offload, block_size=BLOCK, max_num_batched_tokens=64,
                                    max_num_seqs=8)
    return KVOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER,
                              build_kv_cache_config(64, BLOCK))


def test_same_step_loads_are_off_where_vllm_cannot_evict_cached_blocks(monkeypatch):
    """A failed same-step load's blocks must leave vLLM's prefix cache (docs/vllm-bugs.md):
    without ``KVCacheManager.evict_blocks`` every hit loads asynchronously."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.delattr(KVCacheManager, "evict_blocks")
    conn = _scheduler_connector()
    try:
        assert conn._sched.same_step is None
    finally:
        conn.shutdown()


def test_failed_blocks_leave_vllms_prefix_cache_or_an_error_is_logged_once(caplog):
    """The failed block and, in each request's table, the blocks after it are evicted;
    a KV cache manager without ``evict_blocks`` logs an error once and raises nothing."""
    from types import SimpleNamespace

    from vllm.v1.outputs import KVConnectorOutput

    conn = _scheduler_connector()
    try:
        evicted: list[set[int]] = []
        tables = {"a": [4, 5, 6, 7], "b": [4, 5, 9], "c": [1, 2]}
        conn._kv_cache_manager = SimpleNamespace(  # what bind_kv_cache_manager sets
            get_block_ids=lambda req_id: (tables.get(req_id, []),),
            evict_blocks=evicted.append)
        for req_id, table in tables.items():
            conn.get_num_new_matched_tokens(SimpleNamespace(
                request_id=req_id, block_hashes=[], num_tokens=len(table) * BLOCK,
                num_prompt_tokens=len(table) * BLOCK, sampling_params=None), 0)
        conn.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))
        assert evicted == [{5, 6, 7, 9}]
        conn._kv_cache_manager = SimpleNamespace(get_block_ids=lambda req_id: ([],))
        for _ in range(2):
            conn.update_connector_output(KVConnectorOutput(invalid_block_ids={5}))
        assert [r.levelname for r in caplog.records if "evict_blocks" in r.message] == ["ERROR"]
    finally:
        conn.shutdown()
