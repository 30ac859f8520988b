"""Metrics: kv-offload's counters in vLLM's connector stats, Prometheus and logs.

Workers and the scheduler side each produce deltas (plain dicts of numbers keyed by the
fields declared in ``kv_offload.counters``); vLLM ships them in ``KVConnectorStats``
objects, merges ranks with ``aggregate`` and hands the result to
``OffloadPromMetrics.observe`` (``/metrics``) and to its periodic log (``reduce``). A name
not declared there raises ``UnknownMetricError`` (a bug, never dropped). Every metric is
documented in docs/metrics.md; ``read_metrics`` reads them in-process (offline ``LLM``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kv_offload.counters import COUNTERS, GAUGES, Kind, SchedulerGauges, spec

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kv_offload.layout import KVLayout
    from kv_offload.scheduler.planner import OffloadScheduler

logger = logging.getLogger(__name__)

SUMMARY_INTERVAL_S = 60.0
DISK_STATS_INTERVAL_S = 5.0
_HITS, _MISSES = "kv_offload_hit_tokens_total", "kv_offload_miss_tokens_total"
_BYTES, _SECONDS = "kv_offload_transfer_bytes_total", "kv_offload_transfer_seconds_total"
_FOLDED = (_HITS, _MISSES, _BYTES, _SECONDS)  # shown in the summary as rates, not totals


@dataclass
class OffloadStats(KVConnectorStats):
    """Counter deltas (summed over ranks and steps) and gauges (latest value wins)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if spec(name).kind is Kind.GAUGE:
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(name) for name in COUNTERS)

    def reduce(self) -> dict[str, int | float]:
        return summarize(self.data)


def summarize(data: Mapping[str, Any]) -> dict[str, int | float]:
    """A few numbers an operator reads at a glance: hit rate per tier, GB/s per direction,
    usage, then every other counter that moved (errors among them). Raises
    UnknownMetricError for an undeclared name."""
    for name in data:
        spec(name)
    hits = {dict(s.labels)["tier"]: data.get(s.name, 0)
            for s in COUNTERS.values() if s.metric == _HITS}
    looked_up = sum(hits.values()) + sum(data.get(s.name, 0) for s in COUNTERS.values()
                                         if s.metric == _MISSES)
    out: dict[str, int | float] = {
        f"hit_rate_{t}": round(n / looked_up, 3) if looked_up else 0.0 for t, n in hits.items()}
    seconds = {dict(s.labels)["direction"]: data.get(s.name, 0)
               for s in COUNTERS.values() if s.metric == _SECONDS}
    for s in COUNTERS.values():
        if s.metric == _BYTES:
            direction = dict(s.labels)["direction"]
            took = seconds[direction]
            out[f"{direction}_GBps"] = round(data.get(s.name, 0) / took / 1e9, 2) if took else 0.0
    if data.get("cpu_capacity_bytes"):
        out["cpu_usage"] = round(data.get("cpu_used_bytes", 0) / data["cpu_capacity_bytes"], 3)
    if data.get("disk_capacity_bytes"):
        out["disk_usage"] = round(data.get("disk_used_bytes", 0) / data["disk_capacity_bytes"], 3)
    out.update({s.name: data[s.name] for s in COUNTERS.values()
                if s.metric not in _FOLDED and data.get(s.name)})
    return out


class OffloadPromMetrics(KVConnectorPromMetrics):
    """Registers the ``kv_offload_*`` metrics and records observed stats into them."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        families: dict[str, Any] = {}
        for s in COUNTERS.values():
            if s.metric not in families:
                families[s.metric] = self._counter_cls(
                    name=s.metric, documentation=s.help,
                    labelnames=labelnames + [k for k, _ in s.labels])
            self._counters[s.name] = {
                idx: families[s.metric].labels(*values, *[v for _, v in s.labels])
                for idx, values in per_engine_labelvalues.items()}
        self._gauges: dict[str, dict[int, Any]] = {}
        for s in GAUGES.values():
            # vLLM types _gauge_cls as any of its metric classes; it is prometheus' Gauge.
            gauge = self._gauge_cls(  # type: ignore[call-arg]
                name=s.metric, documentation=s.help, labelnames=labelnames,
                multiprocess_mode="mostrecent")
            self._gauges[s.name] = {idx: gauge.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one aggregated report; raises UnknownMetricError for an undeclared name."""
        for name, value in transfer_stats_data.items():
            if spec(name).kind is Kind.GAUGE:
                self._gauges[name][engine_idx].set(value)
            elif value:
                self._counters[name][engine_idx].inc(value)


def read_metrics(registry: CollectorRegistry | None = None) -> dict[str, float]:
    """kv-offload's counters and gauges in this process's Prometheus registry, by the
    field names of ``kv_offload.counters`` (e.g. ``hit_tokens_cpu``, ``hook_errors``),
    totals since start summed over engines. Filled in the process that runs vLLM's stat
    loggers: an offline ``LLM(..., disable_log_stats=False)``'s own; empty before the
    engine registered them. Reads only, any thread."""
    from prometheus_client import REGISTRY

    source = REGISTRY if registry is None else registry
    by_sample = {(s.metric, s.labels): s.name for s in (*COUNTERS.values(), *GAUGES.values())}
    label_keys = sorted({k for s in (*COUNTERS.values(), *GAUGES.values()) for k, _ in s.labels})
    out: dict[str, float] = {}
    for family in source.collect():
        for sample in family.samples:
            labels = tuple((k, sample.labels[k]) for k in label_keys if k in sample.labels)
            name = by_sample.get((sample.name, labels))
            if name is not None:
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


class SchedulerStats:
    """The scheduler side's connector stats (counter deltas and gauges) and its periodic
    log summary. Scheduler thread only; mutates only its own bookkeeping."""

    def __init__(self, scheduler: OffloadScheduler, layout: KVLayout, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._sched, self._layout, self._clock = scheduler, layout, clock
        self._last_summary = clock()
        self._last_counters = scheduler.counters.snapshot()
        self._worker_totals: dict[str, float] = {}
        self._disk_gauges = SchedulerGauges()
        self._disk_gauges_at = float("-inf")

    def take(self) -> dict[str, float]:
        """Counter deltas since the last call, plus current gauges; empty when no counter
        moved (vLLM drops stats without a counter delta anyway: ``OffloadStats.is_empty``)."""
        now_counters = self._sched.counters.snapshot()
        last = self._last_counters
        data: dict[str, float] = {k: v - last[k] for k, v in now_counters.items()
                                  if v != last[k]}
        if not data:
            return data
        self._last_counters = now_counters
        data.update(self._gauges().measured())
        return data

    def add_worker(self, data: Mapping[str, float]) -> None:
        """Add aggregated worker deltas to the totals the summary shows."""
        _add(self._worker_totals, data)

    def maybe_log_summary(self) -> None:
        """Log ``kv-offload summary since start:`` at most once per SUMMARY_INTERVAL_S."""
        now = self._clock()
        if now - self._last_summary < SUMMARY_INTERVAL_S:
            return
        self._last_summary = now
        totals = dict(self._worker_totals)
        _add(totals, self._sched.counters.snapshot())
        totals.update(self._gauges().measured())
        logger.info("kv-offload summary since start: %s",
                    ", ".join(f"{k}={v}" for k, v in summarize(totals).items()))

    def _gauges(self) -> SchedulerGauges:
        sched, slot_bytes = self._sched, self._layout.slot_bytes
        remote, disk = sched.tier("remote"), sched.tier("disk")
        remote_stats = None if remote is None else remote.stats()
        gauges = SchedulerGauges(
            pending_jobs=sched.num_pending_jobs(), cpu_used_bytes=len(sched.cpu) * slot_bytes,
            cpu_capacity_bytes=sched.cpu.num_slots * slot_bytes,
            remote_up=None if remote_stats is None else int(remote_stats["up"]))
        if disk is not None:
            gauges.disk_up = int(disk.enabled)
            now = self._clock()
            if now - self._disk_gauges_at >= DISK_STATS_INTERVAL_S:
                self._disk_gauges_at = now
                st = disk.stats()  # None: the tier is off (the last gauges stay)
                per_slot = slot_bytes * self._layout.tp_size
                if st is not None:
                    self._disk_gauges = SchedulerGauges(
                        disk_used_bytes=st["used_slots"] * per_slot,
                        disk_capacity_bytes=st["num_slots"] * per_slot)
            gauges.disk_used_bytes = self._disk_gauges.disk_used_bytes
            gauges.disk_capacity_bytes = self._disk_gauges.disk_capacity_bytes
        return gauges


def _add(totals: dict[str, float], deltas: Mapping[str, Any]) -> None:
    for name, value in deltas.items():
        totals[name] = totals.get(name, 0) + value
