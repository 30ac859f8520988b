"""SchedulerCounters: what the scheduler side counts, for logs, metrics and tests."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters since the connector started (scheduler thread only).

    Names match ``kv_offload.metrics.COUNTERS`` so deltas export as they are.
    """

    hit_tokens_cpu: int = 0  # prompt tokens loaded from the CPU tier
    hit_tokens_disk: int = 0  # prompt tokens loaded from the disk tier
    hit_tokens_remote: int = 0  # prompt tokens loaded from the remote tier
    miss_tokens: int = 0  # prompt tokens past vLLM's own hit that no tier held
    lookup_skipped_tokens: int = 0  # ... of requests whose hits vLLM discards: not looked up
    chunks_loaded_cpu: int = 0
    chunks_loaded_disk: int = 0
    chunks_loaded_remote: int = 0
    chunks_stored_cpu: int = 0  # chunks published in the CPU tier
    chunks_stored_disk: int = 0  # chunks committed to the disk tier
    chunks_stored_remote: int = 0  # chunks written to the remote tier by every rank
    skipped_stores: int = 0  # chunks not stored: no CPU slot could be had
    stores_without_window: int = 0  # chunks not stored: a sliding-window block was freed
    stores_without_state: int = 0  # chunks not stored: no mamba state handed over for its end
    evictions_cpu: int = 0
    load_errors: int = 0  # chunks whose load failed or vanished (recomputed)
    loads_same_step: int = 0  # loads copied before the forward of the step that ran them
    loads_given_up: int = 0  # loads vLLM dropped as a whole (answered a miss on retry)
    hook_errors: int = 0  # exceptions caught in connector hooks (degraded to a miss)
    remote_lookups: int = 0  # existence checks sent to the remote tier (one per request)
    remote_lookup_errors: int = 0  # ... that failed or ran past the budget (answered miss)
    seconds_remote_lookup: float = 0.0

    def snapshot(self) -> dict[str, float]:
        # Read every step (connector stats): attribute reads, not dataclasses.asdict,
        # which deep-copies each field (~50 us a call).
        return {name: getattr(self, name) for name in _FIELDS}


_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerCounters))
