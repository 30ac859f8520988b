"""Builds a rank's OffloadWorker from the engine's KV tensors (worker start-up)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kv_offload.config import OffloadConfig
from kv_offload.engine_info import UnsupportedEngineError
from kv_offload.layout import KVLayout
from kv_offload.worker.runner import OffloadWorker

logger = logging.getLogger(__name__)


def tensor_parallel_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed run)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (unit tests, single process)
        return 0


def build_worker(
    *,
    tensors: Sequence[Any],
    layout: KVLayout,
    config: OffloadConfig,
    num_blocks: int,
    namespace: str,
    persistent: bool,
) -> OffloadWorker:
    """Check the engine's tensors against ``layout`` and wire host slots, copy engine
    and slab. Raises UnsupportedEngineError with the observed shapes on a mismatch."""
    from kv_offload.connector import num_cpu_slots
    from kv_offload.copy import make_copy_engine, planes_from_kv_tensor
    from kv_offload.host_buffer import allocate_host_slots

    planes = []
    for index, tensor in enumerate(tensors):
        try:
            layer_planes = planes_from_kv_tensor(tensor, num_blocks)
        except ValueError as exc:
            raise UnsupportedEngineError(
                f"kv-offload cannot read the KV tensor of layer {index} "
                f"(shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}, "
                f"dtype {tensor.dtype}): {exc}") from None
        layer_bytes = sum(int(p.shape[1]) for p in layer_planes)
        if layer_bytes != layout.page_bytes:
            raise UnsupportedEngineError(
                f"kv-offload: layer {index} holds {layer_bytes} bytes per block but vLLM's "
                f"KV cache spec says {layout.page_bytes}; unsupported KV cache layout "
                f"(shape {tuple(tensor.shape)})")
        planes.extend(layer_planes)
    rank = tensor_parallel_rank()
    on_cuda = planes[0].device.type == "cuda"
    host = allocate_host_slots(num_cpu_slots(config, layout), layout.slot_bytes, pinned=on_cuda)
    engine = make_copy_engine(planes, host, layout.blocks_per_chunk)
    slab = None
    if persistent:
        from kv_offload.disk import SlabFile

        slab = SlabFile(config.disk_path, namespace_id=namespace, rank=rank,
                        num_ranks=layout.tp_size, slot_bytes=layout.slot_bytes,
                        fsync=config.disk_fsync,
                        allow_unsafe_permissions=config.disk_allow_unsafe_permissions)
    remote = None
    if config.remote_enabled:
        from kv_offload.remote import remote_tier_for

        remote = remote_tier_for(config, layout, namespace=namespace,
                                 timeout_s=config.remote_timeout_s, who=f"worker rank {rank}")
    logger.info("kv-offload worker rank %d: %d planes, %d host slots, engine %s",
                rank, len(planes), host.num_slots, type(engine).__name__)
    return OffloadWorker(rank=rank, engine=engine, host=host, slab=slab, remote=remote,
                         io_threads=config.io_threads, load_timeout_s=config.load_timeout_s,
                         verify_checksums=config.verify_checksums)
