"""Builds a rank's OffloadWorker from the engine's KV tensors (worker start-up), and its
copy engine again when vLLM gives the KV cache back elsewhere (``restore_kv_caches``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_offload.config import OffloadConfig
from kv_offload.layout import KVLayout, num_cpu_slots
from kv_offload.plugin.engine_info import UnsupportedEngineError
from kv_offload.tier_plugins import TierContext, build_tiers
from kv_offload.worker.affinity import ThreadPlacement
from kv_offload.worker.audit import CopyAudit, build_audit
from kv_offload.worker.runner import OffloadWorker

if TYPE_CHECKING:
    import torch

    from kv_offload.copy.base import CopyEngine
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.copy.layers import PlaneLayers
    from kv_offload.tier_contract import TierIO

KVPlacement = tuple[tuple[object, ...], ...]
"""Per KV tensor: address, shape, stride, dtype and device (``kv_placement``)."""

logger = logging.getLogger(__name__)


def tensor_parallel_rank(tp_size: int) -> int:
    """This worker's tensor-parallel rank, checked against ``tp_size``.

    0 only when ``tp_size`` is 1 and vLLM's parallel state is not initialised (a single
    process). Anything else that cannot be told raises UnsupportedEngineError: a wrong rank
    would make ranks write each other's slab files and remote keys."""
    try:
        from vllm.distributed import parallel_state as ps

        initialised = bool(ps.model_parallel_is_initialized())
        rank = int(ps.get_tensor_model_parallel_rank()) if initialised else None
        world = int(ps.get_tensor_model_parallel_world_size()) if initialised else None
    except Exception as exc:
        raise UnsupportedEngineError(
            f"kv-offload cannot read this worker's tensor-parallel rank from vLLM "
            f"({type(exc).__name__}: {exc}); run a vLLM version kv-offload supports (see "
            f"the README)") from exc
    if rank is None:
        if tp_size == 1:
            return 0
        raise UnsupportedEngineError(
            f"kv-offload: vLLM's parallel state is not initialised in this worker, so its "
            f"rank among tensor_parallel_size={tp_size} is unknown; the connector must be "
            f"built by a vLLM worker after distributed start-up")
    if world != tp_size or not 0 <= rank < tp_size:
        raise UnsupportedEngineError(
            f"kv-offload: this worker is rank {rank} of a tensor-parallel group of {world}, "
            f"but the engine config says tensor_parallel_size={tp_size}")
    return rank


def local_tensor_parallel_ranks(tp_size: int) -> int:
    """How many of the ``tp_size`` tensor-parallel ranks run on this host (each allocates a
    CPU tier): ``tp_size`` spread over vLLM's node count, all of them when vLLM's
    distributed state does not say (a single process, or a vLLM without it)."""
    try:
        from vllm.distributed import parallel_state as ps

        nodes = max(1, int(ps.get_node_count()))
    except Exception:
        nodes = 1
    return max(1, -(-int(tp_size) // nodes))


def check_page_order(tensors: Sequence[torch.Tensor], layout: KVLayout, num_blocks: int) -> None:
    """UnsupportedEngineError unless every KV tensor stores its blocks in the byte order
    that ``layout`` (and so the namespace) names."""
    from kv_offload.copy.planes import page_order_of

    for index, tensor in enumerate(tensors):
        try:
            actual = page_order_of(tensor, num_blocks)
        except ValueError as exc:
            raise UnsupportedEngineError(
                f"kv-offload cannot tell the byte order of layer {index}'s KV tensor "
                f"(shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}): {exc}; "
                f"run a vLLM version kv-offload supports (see the README)") from None
        if actual != layout.page_order:
            raise UnsupportedEngineError(
                f"kv-offload: layer {index}'s KV blocks hold their bytes in the order "
                f"{actual} (shape {tuple(tensor.shape)}, stride {tuple(tensor.stride())}), "
                f"but the namespace was computed for {layout.page_order} (vLLM's resolved "
                f"KV cache layout). Chunks would be loaded scrambled, so the connector "
                f"refuses to start. When vLLM splits blocks into kernel blocks under a "
                f"heads-outer layout (S before H), set --block-size to the kernel block "
                f"size or VLLM_KV_CACHE_LAYOUT=LBNHC.")


def kv_placement(tensors: Sequence[torch.Tensor]) -> KVPlacement:
    """Where each tensor's bytes are and how they are laid out. Equal placements mean
    views of the same memory: byte planes cut from the first still address the second."""
    return tuple((int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), str(t.dtype),
                  str(t.device)) for t in tensors)


def kv_planes(tensors: Sequence[torch.Tensor], layout: KVLayout, num_blocks: int
              ) -> list[torch.Tensor]:
    """The byte planes of the engine's KV tensors, once they passed the start-up checks
    (byte order, bytes per block); UnsupportedEngineError with the observed shapes on a
    mismatch."""
    return [p for layer in kv_planes_by_layer(tensors, layout, num_blocks) for p in layer]


def kv_planes_by_layer(tensors: Sequence[torch.Tensor], layout: KVLayout, num_blocks: int
                       ) -> list[list[torch.Tensor]]:
    """``kv_planes``, one list per tensor (layer)."""
    from kv_offload.copy import planes_from_kv_tensor

    check_page_order(tensors, layout, num_blocks)
    planes = []
    for index, tensor in enumerate(tensors):
        try:
            layer_planes = planes_from_kv_tensor(tensor, num_blocks, block_dim=0)
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
        planes.append(layer_planes)
    return planes


def plane_layers(names: Sequence[str], planes: Sequence[Sequence[torch.Tensor]]
                 ) -> PlaneLayers | None:
    """Which planes belong to which attention layer (``names[i]`` holds ``planes[i]``),
    in the order vLLM registered them, which is the order its forward runs the layers
    (``engine_info.layer_names``: the first KV cache group's layers, in the order of the
    model's attention modules); None when the names do not match the tensors (every
    same-step load is then fenced whole)."""
    from kv_offload.copy.layers import PlaneLayers

    if not names:
        return None
    try:
        return PlaneLayers.from_counts(names, [len(p) for p in planes])
    except ValueError:
        logger.warning("kv-offload: %d layer names for %d KV tensors; same-step loads are "
                       "fenced whole, not per layer", len(names), len(planes))
        return None


def build_copy_engine(planes: list[torch.Tensor], host: HostSlots, *, layout: KVLayout,
                      config: OffloadConfig, placement: ThreadPlacement
                      ) -> tuple[CopyEngine, CopyAudit | None]:
    """The copy engine between ``planes`` and ``host``, and its runtime audit (None when
    ``audit_rate`` is 0). The caller closes both."""
    from kv_offload.copy import make_copy_engine

    engine = make_copy_engine(planes, host, layout.blocks_per_chunk,
                              thread_initializer=placement.anywhere,
                              layer_thread_initializer=placement.background,
                              copy_mode=config.copy_mode)
    try:
        audit = build_audit(planes, host, layout.blocks_per_chunk, engine=engine,
                            rate=config.audit_rate)
    except BaseException:
        engine.close()  # nobody else holds it yet
        raise
    return engine, audit


def start_populating(host: HostSlots, placement: ThreadPlacement) -> threading.Thread:
    """Map the host slots' pages on a background thread (``HostSlots.populate``), so
    that first stores run at copy speed; returns the started daemon thread."""
    def run() -> None:
        placement.background()
        host.populate()

    thread = threading.Thread(target=run, name="kv-offload-populate", daemon=True)
    thread.start()
    return thread


def build_worker(
    *,
    tensors: Sequence[torch.Tensor],
    names: Sequence[str] = (),
    layout: KVLayout,
    config: OffloadConfig,
    num_blocks: int,
    namespace: str,
    persistent: bool,
    extra_tiers: Sequence[str] = (),
) -> OffloadWorker:
    """Check the engine's tensors against ``layout`` and wire host slots, copy engine
    and slab. ``names``: the attention layer of each tensor (``plane_layers``). Raises
    UnsupportedEngineError with the observed shapes on a mismatch."""
    from kv_offload.copy.host_buffer import allocate_host_slots, check_local_ranks_fit

    by_layer = kv_planes_by_layer(tensors, layout, num_blocks)
    planes = [p for layer in by_layer for p in layer]
    rank = tensor_parallel_rank(layout.tp_size)
    on_cuda = planes[0].device.type == "cuda"
    num_slots = num_cpu_slots(config, layout)
    check_local_ranks_fit(num_slots * layout.slot_bytes, local_tensor_parallel_ranks(layout.tp_size))
    host = allocate_host_slots(num_slots, layout.slot_bytes, pinned=on_cuda)
    placement = ThreadPlacement.for_worker()
    start_populating(host, placement)
    engine, audit = build_copy_engine(planes, host, layout=layout, config=config,
                                      placement=placement)
    tiers: list[TierIO] = []  # the secondary tiers, in the scheduler's order
    if persistent and config.disk_path is not None:
        from kv_offload.disk import SlabFile
        from kv_offload.disk.io import DiskIO

        slab = SlabFile(config.disk_path, namespace_id=namespace, rank=rank,
                        num_ranks=layout.tp_size, slot_bytes=layout.slot_bytes,
                        fsync=config.disk_fsync,
                        allow_unsafe_permissions=config.disk_allow_unsafe_permissions)
        tiers.append(DiskIO(slab, slot_bytes=layout.slot_bytes, rank=rank,
                            verify_checksums=config.verify_checksums))
    if config.remote_enabled:
        from kv_offload.remote import remote_tier_for
        from kv_offload.remote.io import RemoteIO

        remote = remote_tier_for(config, layout, namespace=namespace, who=f"worker rank {rank}")
        tiers.append(RemoteIO(remote, rank=rank, verify_checksums=config.verify_checksums))
    tiers += build_tiers(extra_tiers, TierContext(
        "worker", namespace, layout.tp_size, rank, layout.slot_bytes, config))
    logger.info("kv-offload worker rank %d: %d planes, %d host slots, engine %s (%s), "
                "audit rate %g, %s", rank, len(planes), host.num_slots, type(engine).__name__,
                engine.describe(), config.audit_rate, placement.describe())
    worker = OffloadWorker(rank=rank, engine=engine, host=host, tiers=tiers,
                           io_threads=config.io_threads, load_timeout_s=config.load_timeout_s,
                           background_stores=config.cpu_background_stores and not on_cuda,
                           placement=placement, audit=audit)
    worker.layer_waits.layers = plane_layers(names, by_layer)
    return worker
