"""SchedulerCounters: what the scheduler side counts, for logs, metrics and tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters since the connector started (scheduler thread only)."""

    lookup_tokens: int = 0  # prompt tokens past vLLM's own hit that were looked up
    hit_tokens_cpu: int = 0  # tokens loaded from the CPU tier
    hit_tokens_disk: int = 0  # tokens loaded from the disk tier
    stored_chunks: int = 0  # chunks copied out of the engine into the CPU tier
    disk_stored_chunks: int = 0  # chunks committed to the disk tier
    disk_store_failures: int = 0  # chunks whose slab write failed on some rank
    skipped_stores: int = 0  # chunks not stored: no CPU slot could be had
    cpu_evictions: int = 0
    load_failed_chunks: int = 0  # chunks whose load failed on some rank (recomputed)
    load_vanished_chunks: int = 0  # chunks evicted between lookup and load (recomputed)

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)
