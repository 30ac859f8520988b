"""vLLM glue of the tiers' KV events (``scheduler/events.py``): on only when vLLM's
KV events are (``--kv-events-config '{"enable_kv_cache_events": true, ...}'``), and
``TierEvent`` values turned into vLLM's ``BlockStored``/``BlockRemoved``.

The events cover the KV cache groups vLLM's GPU events describe with the same block
hashes: full-attention groups whose block size is vLLM's hash block size (every group of
a model without sliding windows). A chunk's event is repeated for each such group.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kv_offload.scheduler.events import TierEvent, TierEvents

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from kv_offload.scheduler import OffloadScheduler

logger = logging.getLogger(__name__)


def event_groups(kv_cache_config: KVCacheConfig, block_size: int) -> list[tuple[int, str]]:
    """(group index, spec kind) of the groups the events describe (module docstring)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_cache_spec_kind

    out = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec) and spec.block_size == block_size:
            out.append((i, get_kv_cache_spec_kind(spec).value))
    return out


def _extra_keys(request: Any, start: int, end: int) -> tuple[Any, ...] | None:
    """vLLM's published extra keys of the block [start, end) of ``request`` (LoRA name,
    multimodal items, cache_salt, prompt embeddings), as its GPU events carry them."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    if request.lora_request is None and not request.mm_features and not (
            start == 0 and request.cache_salt) and getattr(request, "prompt_embeds", None) is None:
        return None  # the common case, without vLLM's per-block walk
    keys, _ = generate_block_hash_extra_keys(request, start, end, 0)
    published = to_event_extra_keys([keys])
    return published[0] if published else None


class VllmTierEvents:
    """The scheduler's ``TierEvents`` and the groups its events name; ``take`` hands out
    vLLM's event objects (the connector's ``take_events``)."""

    def __init__(self, events: TierEvents, groups: list[tuple[int, str]]) -> None:
        self.events, self.groups = events, groups

    def take(self) -> list[KVCacheEvent]:
        return to_vllm(self.events.take(), self.groups)


def attach_events(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                  scheduler: OffloadScheduler) -> VllmTierEvents | None:
    """Turn the tiers' KV events on when vLLM's are, and start announcing what the disk
    tier holds (after a restart); None (no cost) otherwise."""
    config = vllm_config.kv_events_config
    if config is None or not config.enable_kv_cache_events:
        return None
    block_size = scheduler.config.tokens_per_hash
    groups = event_groups(kv_cache_config, block_size)
    if not groups:
        logger.info("kv-offload: no KV cache group has full attention at vLLM's hash block "
                    "size %d; the tiers publish no KV events", block_size)
        return None
    events = TierEvents(chunk_tokens=scheduler.config.chunk_tokens, block_size=block_size,
                        extra_keys_of=_extra_keys, counters=scheduler.counters)
    connect(scheduler, events)
    logger.info("kv-offload: publishing the %s tiers' chunks as KV events",
                ", ".join(["CPU", *(t.name for t in scheduler.tiers if t.enabled)]))
    return VllmTierEvents(events, groups)


def connect(scheduler: OffloadScheduler, events: TierEvents) -> None:
    """Have the planner capture chunk payloads and the tiers report to ``events``; the
    disk tier starts announcing what it holds."""
    scheduler.events = scheduler.cpu.events = events
    for tier in scheduler.tiers:
        tier.attach_events(events)


def to_vllm(events: Iterable[TierEvent], groups: list[tuple[int, str]]) -> list[KVCacheEvent]:
    """vLLM's ``BlockStored``/``BlockRemoved`` of ``events``, one per chunk and group."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[KVCacheEvent] = []
    for event in events:
        hashes = [maybe_convert_block_hash(h) for h in event.block_hashes]  # type: ignore[arg-type]
        tier, blocks = event.tier, event.blocks
        for group, kind in groups:
            if blocks is None:
                out.append(BlockRemoved(block_hashes=hashes, medium=tier.medium, group_idx=group,
                                        locality=tier.locality, ownership=tier.ownership))
                continue
            parent = (maybe_convert_block_hash(blocks.parent_hash)  # type: ignore[arg-type]
                      if blocks.parent_hash is not None else None)
            out.append(BlockStored(
                block_hashes=hashes, parent_block_hash=parent, token_ids=list(blocks.token_ids),
                block_size=blocks.block_size, lora_id=blocks.lora_id, medium=tier.medium,
                lora_name=blocks.lora_name,
                extra_keys=list(blocks.extra_keys) if blocks.extra_keys is not None else None,
                group_idx=group, kv_cache_spec_kind=kind, locality=tier.locality,
                ownership=tier.ownership))
    return out

