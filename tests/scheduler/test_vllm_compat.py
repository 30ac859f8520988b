"""kv_offload/testing/vllm_compat.py on the installed vLLM (0.32 in make test, 0.34 in
make test-vllm-next): each helper gives the same thing on both."""

from __future__ import annotations

import pytest

from kv_offload.testing import vllm_compat
from kv_offload.testing.scheduler_harness import NUM_LAYERS, SchedulerHarness


def test_a_model_runner_output_takes_the_fields_the_installed_vllm_has():
    from vllm.v1.outputs import KVConnectorOutput

    out = vllm_compat.model_runner_output(["a", "b"], [[7], []],
                                          KVConnectorOutput(finished_sending={"a"}))
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[7], []]
    assert out.kv_connector_output.finished_sending == {"a"}
    if hasattr(out, "req_id_to_index"):  # vLLM 0.32-0.33
        assert out.req_id_to_index == {"a": 0, "b": 1}


def test_a_kv_cache_config_is_built_from_groups_wherever_vllm_keeps_the_builder(tmp_path):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    harness = SchedulerHarness(tmp_path, disk=False)
    try:
        spec = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=4,
                                 dtype=torch.float32)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
        config = vllm_compat.get_kv_cache_config_from_groups(
            harness.vllm_config, [KVCacheGroupSpec(names, spec)],
            10 * NUM_LAYERS * spec.page_size_bytes)
    finally:
        harness.close()
    assert config.num_blocks == 10
    assert [g.layer_names for g in config.kv_cache_groups] == [names]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_requests_resumed_after_preemption_reach_the_fake_runner_with_their_tokens(
        tmp_path, async_scheduling):
    """A block pool too small for both requests makes vLLM preempt one; vLLM 0.32 resumes
    it in scheduled_cached_reqs (resumed_req_ids; all_token_ids with async scheduling),
    0.34 re-sends it in scheduled_new_reqs with its output so far. Either way the fake
    runner goes on with the right tokens: every token is checked against its KV as it is
    computed, and the outputs are those of a run with blocks enough."""
    def run(num_blocks: int) -> tuple[list[list[int]], int]:
        harness = SchedulerHarness(tmp_path / f"blocks{num_blocks}", disk=False,
                                   num_blocks=num_blocks, async_scheduling=async_scheduling)
        try:
            harness.add("a", list(range(3, 30)), max_tokens=12)  # 39 tokens: 5 blocks
            harness.add("b", list(range(100, 120)), max_tokens=12)  # 32 tokens: 4 blocks
            harness.run()
            assert harness.check_idle() == []
            return ([list(r.output_token_ids) for r in harness.requests.values()],
                    sum(r.num_preemptions for r in harness.requests.values()))
        finally:
            harness.close()

    outputs, preemptions = run(num_blocks=8)  # 7 usable
    assert preemptions >= 1
    assert outputs == run(num_blocks=64)[0]
