"""Which loads run in the step that schedules their request (issue 29), and how many.

A load vLLM runs synchronously (the connector answers ``(tokens, False)``) is copied
before the step's forward, so the whole batch's forward, other users' decode steps
included, waits for it. ``SameStepBudget`` bounds that wait: each step may load up to
``budget_s`` worth of copies at the engine's measured load bandwidth; past it, a hit
loads asynchronously (its request waits outside the batch, as before). Pure logic.
"""

from __future__ import annotations

from collections.abc import Sequence

from kv_offload.scheduler.lookup import Source

INITIAL_LOAD_BYTES_PER_S = 2e9
"""The load bandwidth assumed until the workers measured one (host -> engine copies; this
machine's CPU backend copies at 3-10 GB/s, pinned PCIe copies at 20-50 GB/s)."""
BANDWIDTH_WEIGHT = 0.2
"""Weight of each new measurement in the moving average of the load bandwidth."""
MIN_MEASURED_BYTES = 1 << 20
"""Copies smaller than this say more about per-call overhead than bandwidth: ignored."""


def why_off(*, async_scheduling: bool, inflight_loads: bool, remote_and_tp: bool,
            prefix_cache_kept: bool = False) -> str:
    """Why same-step loads must be off in this engine ("" when they may be on).

    - async scheduling: vLLM (0.32-0.34) recovers from a failed synchronous load only in
      the step that ran it; the next step, already scheduled, computes the request again
      on the failed KV and keeps its token (docs/vllm-bugs.md).
    - vLLM 0.34's ``--max-num-inflight-kv-loads`` starts asynchronous loads while the batch
      is full; a same-step hit needs a batch slot and would wait for one instead.
    - a remote tier with TP > 1: one rank's failed same-step load leaves the other ranks'
      stores of that step computed on wrong attention (the all-reduce mixes it in), and
      their remote writes are not gated on every rank (CPU and disk entries are).
    - ``prefix_cache_kept``: the connector cannot drop a failed same-step load's blocks
      from vLLM's prefix cache (its KV cache manager has no ``evict_blocks``); vLLM keeps
      them there under "recompute" and would serve their wrong KV (docs/vllm-bugs.md).
    """
    if async_scheduling:
        return "with async scheduling (docs/vllm-bugs.md)"
    if inflight_loads:
        return "with --max-num-inflight-kv-loads (hits load while the batch is full)"
    if remote_and_tp:
        return "with a remote tier and TP > 1"
    if prefix_cache_kept:
        return ("without vLLM's KVCacheManager.evict_blocks (a failed load's blocks would "
                "stay in its prefix cache, docs/vllm-bugs.md)")
    return ""


def ready_in_cpu(source: Source) -> bool:
    """Whether a chunk is a READY CPU-tier entry: nothing to read from disk or the remote
    tier, no staging load to wait for."""
    return source.cpu is not None and source.cpu.staging_job is None


def all_ready_in_cpu(run: Sequence[Source]) -> bool:
    return all(map(ready_in_cpu, run))


class SameStepBudget:
    """Bytes of same-step loads a step may take, from ``budget_s`` and the measured
    bandwidth. ``chunk_bytes``: one chunk's bytes on one rank (ranks copy in parallel)."""

    def __init__(self, budget_s: float, chunk_bytes: int,
                 bytes_per_s: float = INITIAL_LOAD_BYTES_PER_S) -> None:
        if budget_s < 0 or chunk_bytes <= 0 or bytes_per_s <= 0:
            raise ValueError(f"bad same-step budget: budget_s={budget_s}, "
                             f"chunk_bytes={chunk_bytes}, bytes_per_s={bytes_per_s}")
        self.budget_s = budget_s
        self.chunk_bytes = chunk_bytes
        self.bytes_per_s = bytes_per_s
        self._taken = 0  # bytes granted since the step began

    @property
    def step_bytes(self) -> int:
        """Bytes a step may load synchronously now."""
        return int(self.budget_s * self.bytes_per_s)

    def take(self, num_chunks: int) -> bool:
        """Grant ``num_chunks`` chunks to a load of this step if they fit in what is left;
        whether they were granted. A request vLLM asks about twice in one step counts
        twice (the budget errs on the side of the batch)."""
        need = num_chunks * self.chunk_bytes
        if num_chunks <= 0 or self._taken + need > self.step_bytes:
            return False
        self._taken += need
        return True

    def new_step(self) -> None:
        """The step's plan was built: the next lookups belong to the next step."""
        self._taken = 0

    def observe(self, num_bytes: float, seconds: float) -> None:
        """Fold the workers' load copies since the last report into the bandwidth."""
        if num_bytes < MIN_MEASURED_BYTES or seconds <= 0:
            return
        measured = num_bytes / seconds
        self.bytes_per_s += BANDWIDTH_WEIGHT * (measured - self.bytes_per_s)
