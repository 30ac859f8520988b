"""What a running ``vllm.LLM`` can tell a test: its counters, ours, and the connector's state.

Read inside the engine's process (``engine_server``). The connector's state is only
reachable when vLLM's engine core runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
with the usual multi-process layout ``connector_state`` returns None.
"""

from __future__ import annotations

import time
from typing import Any

VLLM_COUNTERS = {  # short name -> vLLM metric
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "external_hits": "vllm:external_prefix_cache_hits",
    "external_queries": "vllm:external_prefix_cache_queries",
    "preemptions": "vllm:num_preemptions",
    "spec_drafts": "vllm:spec_decode_num_drafts",
}
SOURCE_METRIC = "vllm:prompt_tokens_cached_by_source"
SOURCES = ("host", "disk", "device", "external_unspecified")  # hits_<source>


class EngineStateError(RuntimeError):
    """A question the engine cannot answer in its layout (e.g. drain without in-process)."""


def metric_totals(llm: Any) -> dict[str, float]:
    """vLLM's counters by short name, totals since start summed over engines; prompt
    tokens served from each cache source as ``hits_<source>``."""
    out = dict.fromkeys(VLLM_COUNTERS, 0.0)
    out.update({f"hits_{s}": 0.0 for s in SOURCES})
    for metric in llm.get_metrics():
        if not hasattr(metric, "value"):
            continue
        for short, name in VLLM_COUNTERS.items():
            if metric.name == name:
                out[short] += float(metric.value)
        if metric.name == SOURCE_METRIC and f"hits_{metric.labels.get('source')}" in out:
            out[f"hits_{metric.labels['source']}"] += float(metric.value)
    return out


def kv_offload_samples() -> dict[str, float]:
    """Every kv_offload_* Prometheus sample of this process, as 'name{tier/direction}'
    (``kv_offload.plugin.metrics.read_metrics`` keyed by sample)."""
    from kv_offload.counters import spec
    from kv_offload.plugin.metrics import read_metrics

    return {spec(name).sample(): value for name, value in read_metrics().items()}


def scheduler_connector(llm: Any) -> Any | None:
    """The scheduler-side KVOffloadConnector of an in-process engine, else None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return None if core is None else core.scheduler.connector


def connector_state(llm: Any) -> dict[str, Any] | None:
    """Both connector halves of an in-process engine (None otherwise): CPU-index counts,
    pending jobs on either side, scheduler counters, disk-index stats, namespace."""
    conn = scheduler_connector(llm)
    if conn is None:
        return None
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    from kv_offload.plugin.connector import KVOffloadConnector

    sched = conn._scheduler  # the connector has no public accessor; read-only use
    group = get_kv_transfer_group()
    worker = group._worker if isinstance(group, KVOffloadConnector) else None
    return {
        "counters": sched.counters.snapshot(),
        "cpu": sched.cpu.counts(),
        "pending_jobs": sched.num_pending_jobs(),
        "pending_work": sched.has_pending_work(),
        "worker_pending_jobs": worker.has_pending_jobs() if worker is not None else None,
        "persistent": conn.persistent,
        "disk_enabled": sched.disk_enabled,
        "disk": _disk_stats(sched),
        "namespace": conn.namespace,
        "slot_bytes": conn.layout.slot_bytes,
    }


def kv_cache_state(llm: Any) -> dict[str, Any]:
    """What vLLM planned for the device KV cache: blocks, the tokens and the concurrency at
    max_model_len it logs, whether its hybrid KV cache manager is on, and (in-process
    only, else None) its KV cache groups as ``kv_capacity.describe_groups`` names them."""
    from kv_offload.testing.kv_capacity import describe_groups

    config = llm.llm_engine.vllm_config
    cache, core = config.cache_config, getattr(llm.llm_engine.engine_core, "engine_core", None)
    return {
        "num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
        "kv_cache_size_tokens": cache.kv_cache_size_tokens,
        "max_concurrency": cache.kv_cache_max_concurrency,
        "max_model_len": config.model_config.max_model_len,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "hybrid_manager": not config.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": None if core is None else list(describe_groups(core.scheduler.kv_cache_config)),
    }


def kv_events_sent(llm: Any, timeout_s: float) -> int:
    """How many batches vLLM's ZMQ KV event publisher has sent (sequence numbers 0 to
    n - 1), once it has sent every batch queued so far; 0 without a ZMQ publisher.

    A subscriber that has seen sequence number n - 1 has every event published before
    this call: a barrier, where waiting for a quiet period would be a guess a loaded
    machine can outlast. Reads the publisher's queue and replay buffer (vLLM has no
    public accessor; read-only use). Raises EngineStateError for a multi-process
    engine and TimeoutError when the queue is not empty after ``timeout_s``."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise EngineStateError("kv_events_sent needs vLLM's engine core in this process: "
                               "start the engine with in_process=True")
    publisher: Any = getattr(core.scheduler, "kv_event_publisher", None)
    queued = getattr(publisher, "_event_queue", None)
    if queued is None:  # events off (vLLM's null publisher)
        return 0
    deadline = time.monotonic() + timeout_s
    while queued.unfinished_tasks:  # task_done comes after the send and the buffer append
        if time.monotonic() > deadline:
            raise TimeoutError(f"KV event batches still queued after {timeout_s:.0f} s")
        time.sleep(0.005)
    sent = publisher._buffer  # (sequence number, payload) of the batches sent, in order
    return sent[-1][0] + 1 if sent else 0


def drain(llm: Any, timeout_s: float) -> None:
    """Step an in-process engine until the connector has no job in flight.

    Raises EngineStateError for a multi-process engine (its core steps on its own and
    its connector is out of reach) and TimeoutError after ``timeout_s``."""
    if getattr(llm.llm_engine.engine_core, "engine_core", None) is None:
        raise EngineStateError("drain needs vLLM's engine core in this process: start the "
                               "engine with in_process=True")
    conn = scheduler_connector(llm)
    deadline = time.monotonic() + timeout_s
    while conn is not None and conn.has_pending_push_work():
        if time.monotonic() > deadline:
            raise TimeoutError(f"connector jobs still pending {timeout_s:.0f} s after the "
                               "requests finished")
        llm.llm_engine.step()
        time.sleep(0.005)


def _disk_stats(sched: Any) -> dict | None:
    """The disk index's stats, also once the tier is off (None without a disk tier)."""
    disk = sched.tier("disk")
    index = getattr(disk, "index", None)
    return None if index is None else index.stats()
