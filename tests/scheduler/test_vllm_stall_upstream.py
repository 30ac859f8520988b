"""vLLM 0.32's stall after a failed asynchronous load, without kv-offload (docs/vllm-bugs.md).

An upstream reproduction: a connector that reports an asynchronous hit for every request,
a load that fails from its first block, and a block pool smaller than twice the
request's need. The request is never scheduled again. This test passes while vLLM has
the bug; when it fails, vLLM fixed it and kv-offload's workaround (a given-up load is
answered "later", then a miss: OffloadScheduler.num_matched_tokens) can go.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

BLOCK = 16


class AlwaysAsyncHitConnector(KVConnectorBase_V1):
    """Scheduler side of a connector that always has every full block but the last."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        hit = (request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        return max(hit, 0), hit > 0

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None


def test_vllm_stalls_a_request_whose_async_load_failed_from_its_first_block():
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager

    from kv_offload.testing.scheduler_harness import build_kv_cache_config
    from kv_offload.testing.tiny_model import make_tiny_model
    from kv_offload.testing.vllm_compat import (
        create_engine_config,
        model_runner_output,
        requests_with_reserved_blocks,
    )

    transfer = KVTransferConfig(kv_connector="AlwaysAsyncHitConnector",
                                kv_connector_module_path=__name__, kv_role="kv_both",
                                kv_load_failure_policy="recompute")
    config = create_engine_config(EngineArgs(
        model=str(make_tiny_model()), block_size=BLOCK, max_model_len=512,
        enable_prefix_caching=True, kv_transfer_config=transfer))
    num_blocks = 12  # 11 usable; the request needs 7, and twice 7 does not fit
    config.cache_config.num_gpu_blocks = num_blocks
    scheduler = Scheduler(vllm_config=config,
                          kv_cache_config=build_kv_cache_config(num_blocks, BLOCK),
                          structured_output_manager=StructuredOutputManager(config),
                          block_size=BLOCK)
    init_none_hash(sha256)
    request = Request("a", list(range(100, 200)), SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    scheduler.add_request(request)

    output = scheduler.schedule()  # the async load starts
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = set(scheduler.kv_cache_manager.get_block_ids("a")[0])
    failed = KVConnectorOutput(finished_recving={"a"}, invalid_block_ids=blocks)
    scheduler.update_from_output(output, model_runner_output([], [], failed))

    for _ in range(20):  # the load failed from its first block: vLLM recomputes it... never
        output = scheduler.schedule()
        assert output.total_num_scheduled_tokens == 0
        scheduler.update_from_output(output, model_runner_output([], []))
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    # The cause: freed blocks, but still counted as an in-flight prefill needing them all
    # (0.32: in _inflight_prefills; 0.34: its parked load's reservation is kept).
    assert scheduler.kv_cache_manager.get_block_ids("a")[0] == []
    assert request in requests_with_reserved_blocks(scheduler)
