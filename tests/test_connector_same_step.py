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
