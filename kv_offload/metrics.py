"""Metrics: kv-offload's counters in vLLM's connector stats, Prometheus and logs.

Workers and the scheduler side each produce deltas (plain dicts of numbers); vLLM
ships them in ``KVConnectorStats`` objects, merges ranks with ``aggregate`` and hands
the result to ``OffloadPromMetrics.observe`` (``/metrics``) and to its periodic log
(``reduce``). Every metric is documented in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

_BYTES_DOC = ("Bytes moved by direction: load (host -> engine), store (engine -> host), "
              "disk_read, disk_write, remote_read, remote_write")
_SECONDS_DOC = "Seconds spent moving bytes, by direction (see transfer_bytes)"
# name -> (Prometheus name, help, labels). A "tier"/"direction" label value follows the
# last underscore-separated part of the short name (e.g. hit_tokens_cpu -> tier="cpu").
COUNTERS: dict[str, tuple[str, str, dict[str, str]]] = {
    "hit_tokens_cpu": ("kv_offload_hit_tokens_total", "Prompt tokens loaded", {"tier": "cpu"}),
    "hit_tokens_disk": ("kv_offload_hit_tokens_total", "Prompt tokens loaded", {"tier": "disk"}),
    "hit_tokens_remote": ("kv_offload_hit_tokens_total", "Prompt tokens loaded",
                          {"tier": "remote"}),
    "miss_tokens": ("kv_offload_miss_tokens_total",
                    "Prompt tokens past vLLM's own hit that no tier held", {}),
    "lookup_skipped_tokens": ("kv_offload_lookup_skipped_tokens_total",
                              "Prompt tokens past vLLM's own hit of requests that must not "
                              "read cached KV (prompt_logprobs): not looked up, neither hits "
                              "nor misses", {}),
    "chunks_loaded_cpu": ("kv_offload_chunks_loaded_total", "Chunks loaded", {"tier": "cpu"}),
    "chunks_loaded_disk": ("kv_offload_chunks_loaded_total", "Chunks loaded", {"tier": "disk"}),
    "chunks_loaded_remote": ("kv_offload_chunks_loaded_total", "Chunks loaded",
                             {"tier": "remote"}),
    "chunks_stored_cpu": ("kv_offload_chunks_stored_total", "Chunks stored", {"tier": "cpu"}),
    "chunks_stored_disk": ("kv_offload_chunks_stored_total", "Chunks stored", {"tier": "disk"}),
    "chunks_stored_remote": ("kv_offload_chunks_stored_total", "Chunks stored",
                             {"tier": "remote"}),
    "evictions_cpu": ("kv_offload_evictions_total", "Chunks evicted", {"tier": "cpu"}),
    "skipped_stores": ("kv_offload_skipped_stores_total",
                       "Chunks not stored because no CPU slot was free", {}),
    "stores_without_window": ("kv_offload_stores_without_window_total",
                              "Chunks not stored because vLLM had already freed a "
                              "sliding-window block they need", {}),
    "stores_without_state": ("kv_offload_stores_without_state_total",
                             "Chunks not stored because vLLM handed over no mamba state "
                             "for their end boundary", {}),
    "loads_same_step": ("kv_offload_loads_same_step_total",
                        "Loads copied before the forward of the step that runs their "
                        "request (no wait outside the batch)", {}),
    "load_errors": ("kv_offload_load_errors_total",
                    "Chunks whose load failed and were recomputed", {}),
    "checksum_failures": ("kv_offload_checksum_failures_total",
                          "Disk chunk reads whose checksum did not match", {}),
    "disk_read_errors": ("kv_offload_disk_read_errors_total",
                         "Disk chunk reads that failed: I/O error, slab file missing or cut "
                         "short", {}),
    "disk_write_errors": ("kv_offload_disk_write_errors_total", "Failed slab writes", {}),
    "remote_lookups": ("kv_offload_remote_lookups_total",
                       "Remote existence checks, one per request the local tiers could not "
                       "serve (a miss without a call while the server backs off)", {}),
    "remote_lookup_errors": ("kv_offload_remote_lookup_errors_total",
                             "Remote existence checks that failed or ran past the budget", {}),
    "seconds_remote_lookup": ("kv_offload_remote_lookup_seconds_total",
                              "Seconds the scheduler spent in remote existence checks", {}),
    "remote_errors": ("kv_offload_remote_errors_total",
                      "Remote reads that failed (server down, timeout) and were recomputed", {}),
    "remote_misses": ("kv_offload_remote_misses_total",
                      "Remote values gone since the lookup or failing verification", {}),
    "remote_skipped_stores": ("kv_offload_remote_skipped_stores_total",
                              "Remote writes that failed or were skipped while the server "
                              "was down (per rank)", {}),
    "audit_chunks": ("kv_offload_audit_chunks_total",
                     "Chunks whose copy the runtime audit re-read and compared (audit_rate)",
                     {}),
    "audit_mismatches": ("kv_offload_audit_mismatches_total",
                         "Audited chunks whose copy differed from the engine blocks: "
                         "discarded, and the copy path fell back to the plainest", {}),
    "bytes_load": ("kv_offload_transfer_bytes_total", _BYTES_DOC,
                   {"direction": "load"}),
    "bytes_store": ("kv_offload_transfer_bytes_total", _BYTES_DOC,
                    {"direction": "store"}),
    "bytes_disk_read": ("kv_offload_transfer_bytes_total", _BYTES_DOC,
                        {"direction": "disk_read"}),
    "bytes_disk_write": ("kv_offload_transfer_bytes_total", _BYTES_DOC,
                         {"direction": "disk_write"}),
    "bytes_remote_read": ("kv_offload_transfer_bytes_total", _BYTES_DOC,
                          {"direction": "remote_read"}),
    "bytes_remote_write": ("kv_offload_transfer_bytes_total", _BYTES_DOC,
                           {"direction": "remote_write"}),
    "seconds_load": ("kv_offload_transfer_seconds_total", _SECONDS_DOC,
                     {"direction": "load"}),
    "seconds_store": ("kv_offload_transfer_seconds_total", _SECONDS_DOC,
                      {"direction": "store"}),
    "seconds_disk_read": ("kv_offload_transfer_seconds_total", _SECONDS_DOC,
                          {"direction": "disk_read"}),
    "seconds_disk_write": ("kv_offload_transfer_seconds_total", _SECONDS_DOC,
                           {"direction": "disk_write"}),
    "seconds_remote_read": ("kv_offload_transfer_seconds_total", _SECONDS_DOC,
                            {"direction": "remote_read"}),
    "seconds_remote_write": ("kv_offload_transfer_seconds_total", _SECONDS_DOC,
                             {"direction": "remote_write"}),
}
GAUGES: dict[str, tuple[str, str]] = {
    "pending_jobs": ("kv_offload_pending_jobs", "Load and store jobs in flight"),
    "cpu_used_bytes": ("kv_offload_cpu_used_bytes", "Bytes of CPU-tier slots in use, per rank"),
    "cpu_capacity_bytes": ("kv_offload_cpu_capacity_bytes", "CPU-tier size, per rank"),
    "disk_used_bytes": ("kv_offload_disk_used_bytes",
                        "Bytes of disk slots in use in this namespace, all ranks"),
    "disk_capacity_bytes": ("kv_offload_disk_capacity_bytes", "Disk budget of this namespace"),
    "remote_up": ("kv_offload_remote_up",
                  "1 while the scheduler reaches the remote tier, 0 while it backs off"),
}


@dataclass
class OffloadStats(KVConnectorStats):
    """Counter deltas (summed over ranks and steps) and gauges (latest value wins)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if name in GAUGES:
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)


def summarize(data: dict[str, Any]) -> dict[str, int | float]:
    """A few numbers an operator reads at a glance (hit rate, GB/s, usage)."""
    tiers = ("cpu", "disk", "remote")
    hits = {t: data.get(f"hit_tokens_{t}", 0) for t in tiers}
    looked_up = sum(hits.values()) + data.get("miss_tokens", 0)
    out: dict[str, int | float] = {
        f"hit_rate_{t}": round(hits[t] / looked_up, 3) if looked_up else 0.0 for t in tiers}
    for direction in ("load", "store", "disk_read", "disk_write", "remote_read",
                      "remote_write"):
        seconds = data.get(f"seconds_{direction}", 0)
        nbytes = data.get(f"bytes_{direction}", 0)
        out[f"{direction}_GBps"] = round(nbytes / seconds / 1e9, 2) if seconds else 0.0
    for name in ("chunks_stored_cpu", "chunks_stored_disk", "chunks_stored_remote",
                 "load_errors", "skipped_stores", "remote_errors", "audit_mismatches"):
        out[name] = data.get(name, 0)
    if data.get("cpu_capacity_bytes"):
        out["cpu_usage"] = round(data.get("cpu_used_bytes", 0) / data["cpu_capacity_bytes"], 3)
    if data.get("disk_capacity_bytes"):
        out["disk_usage"] = round(data.get("disk_used_bytes", 0) / data["disk_capacity_bytes"], 3)
    return out


class OffloadPromMetrics(KVConnectorPromMetrics):
    """Registers the ``kv_offload_*`` metrics and records observed stats into them."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        families: dict[str, Any] = {}
        for short, (name, doc, labels) in COUNTERS.items():
            if name not in families:
                families[name] = self._counter_cls(
                    name=name, documentation=doc, labelnames=labelnames + sorted(labels))
            self._counters[short] = {
                idx: families[name].labels(*values, *[labels[k] for k in sorted(labels)])
                for idx, values in per_engine_labelvalues.items()}
        self._gauges: dict[str, dict[int, Any]] = {}
        for short, (name, doc) in GAUGES.items():
            # vLLM types _gauge_cls as any of its metric classes; it is prometheus' Gauge.
            gauge = self._gauge_cls(  # type: ignore[call-arg]
                name=name, documentation=doc, labelnames=labelnames,
                multiprocess_mode="mostrecent")
            self._gauges[short] = {idx: gauge.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for short, value in transfer_stats_data.items():
            if short in self._counters and value:
                self._counters[short][engine_idx].inc(value)
            elif short in self._gauges:
                self._gauges[short][engine_idx].set(value)
