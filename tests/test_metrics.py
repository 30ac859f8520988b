"""Metrics: every declared counter and gauge reaches /metrics, the log and docs/metrics.md;
merging over ranks and steps; the operator summary.

Regression (issue 30): ``hook_errors`` and ``loads_given_up`` were counted by the scheduler
but missing from the exported table, ``observe`` dropped unknown names without a word and
the log summary left them out, while docs/bad-input.md told operators they were counted.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kv_offload.counters import (
    COUNTERS,
    GAUGES,
    Kind,
    SchedulerCounters,
    SchedulerGauges,
    Side,
    UnknownMetricError,
    WorkerCounters,
    declared_metrics,
)
from kv_offload.plugin.metrics import (
    SUMMARY_INTERVAL_S,
    OffloadPromMetrics,
    OffloadStats,
    SchedulerStats,
    read_metrics,
)
from kv_offload.scheduler import OffloadScheduler, PlannerConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


@pytest.fixture
def exported():
    """An ``OffloadPromMetrics`` for one engine over a registry of its own; yields
    (exporter, registry)."""
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    prom = OffloadPromMetrics(SimpleNamespace(kv_transfer_config=None), types,
                              ["model_name", "engine"], {0: ["m", "0"]})
    yield prom, registry


def make_stats(*, clock=lambda: 0.0):
    """A ``SchedulerStats`` over a real scheduler (CPU tier only, 4 slots of 1 KiB)."""
    config = PlannerConfig(chunk_tokens=16, block_size=16, tokens_per_hash=16, num_ranks=1,
                           num_cpu_slots=4)
    sched = OffloadScheduler(config, block_ids_of=lambda rid: [])
    return sched, SchedulerStats(sched, SimpleNamespace(slot_bytes=1024, tp_size=1),
                                 clock=clock)


def test_counters_sum_and_gauges_keep_latest():
    rank0 = OffloadStats(data={"bytes_load": 100, "seconds_load": 1.0, "pending_jobs": 3})
    rank1 = OffloadStats(data={"bytes_load": 50, "checksum_failures": 1, "pending_jobs": 1})
    merged = rank0.aggregate(rank1)
    assert merged.data["bytes_load"] == 150
    assert merged.data["checksum_failures"] == 1
    assert merged.data["pending_jobs"] == 1


def test_empty_means_no_counter_moved():
    assert OffloadStats(data={"pending_jobs": 2}).is_empty()
    assert not OffloadStats(data={"hit_tokens_cpu": 64}).is_empty()


def test_summary_has_hit_rates_and_throughput():
    stats = OffloadStats(data={"hit_tokens_cpu": 300, "hit_tokens_disk": 100, "miss_tokens": 600,
                               "bytes_disk_read": 4e9, "seconds_disk_read": 2.0,
                               "cpu_used_bytes": 1, "cpu_capacity_bytes": 4})
    summary = stats.reduce()
    assert summary["hit_rate_cpu"] == 0.3 and summary["hit_rate_disk"] == 0.1
    assert summary["disk_read_GBps"] == 2.0
    assert summary["cpu_usage"] == 0.25


def test_summary_counts_the_remote_tier():
    summary = OffloadStats(data={"hit_tokens_remote": 250, "miss_tokens": 750,
                                 "bytes_remote_read": 1e9, "seconds_remote_read": 0.5}).reduce()
    assert summary["hit_rate_remote"] == 0.25 and summary["remote_read_GBps"] == 2.0


def test_every_counter_is_declared_once_with_a_kv_offload_name_and_help():
    sides = {Side.SCHEDULER: SchedulerCounters, Side.WORKER: WorkerCounters}
    for side, cls in sides.items():
        names = [f.name for f in dataclasses.fields(cls)]
        assert names == [s.name for s in COUNTERS.values() if s.side is side]
    assert len(COUNTERS) == sum(len(dataclasses.fields(c)) for c in sides.values())
    assert list(GAUGES) == [f.name for f in dataclasses.fields(SchedulerGauges)]
    for s in COUNTERS.values():
        assert s.kind is Kind.COUNTER and s.metric.startswith("kv_offload_")
        assert s.metric.endswith("_total") and s.help
    for s in GAUGES.values():
        assert s.kind is Kind.GAUGE and s.metric.startswith("kv_offload_") and s.help
    members = [(s.metric, s.labels) for s in (*COUNTERS.values(), *GAUGES.values())]
    assert len(set(members)) == len(members)  # no two names export to one sample


def test_a_field_declared_without_its_metric_is_refused():
    @dataclasses.dataclass
    class Bad:
        hook_errors: int = 0

    with pytest.raises(UnknownMetricError, match="Bad.hook_errors declares no metric"):
        declared_metrics(Bad, Side.SCHEDULER, Kind.COUNTER)


def test_every_counter_of_both_sides_is_exported(exported):
    """Every field either side counts goes from its producer (the scheduler's stats, a
    worker's tally) through vLLM's merge into /metrics, and reads back by name."""
    prom, registry = exported
    sched, stats = make_stats()
    for name in dataclasses.fields(sched.counters):
        setattr(sched.counters, name.name, 2)
    worker = WorkerCounters(**{f.name: 3 for f in dataclasses.fields(WorkerCounters)})
    merged = OffloadStats(data=stats.take()).aggregate(OffloadStats(data=worker.nonzero()))
    prom.observe(merged.data)
    read = read_metrics(registry)
    assert {name: read[name] for name in COUNTERS} == {
        s.name: 2.0 if s.side is Side.SCHEDULER else 3.0 for s in COUNTERS.values()}
    assert read["hook_errors"] == 2 and read["loads_given_up"] == 2
    assert read["cpu_capacity_bytes"] == 4 * 1024 and read["pending_jobs"] == 0
    text = "\n".join(f"{s.name} {s.labels}" for f in registry.collect() for s in f.samples)
    assert "kv_offload_hook_errors_total" in text


def test_an_unknown_name_is_a_bug_never_dropped(exported):
    prom, _ = exported
    with pytest.raises(UnknownMetricError, match="'hook_error' is not a declared"):
        prom.observe({"hook_errors": 1, "hook_error": 1})
    with pytest.raises(UnknownMetricError):
        OffloadStats(data={}).aggregate(OffloadStats(data={"bytes_loaded": 1}))
    with pytest.raises(UnknownMetricError):
        OffloadStats(data={"given_up": 1}).reduce()


def test_summary_shows_every_counter_that_moved():
    summary = OffloadStats(data={"hook_errors": 2, "loads_given_up": 1,
                                 "disk_write_errors": 4, "load_errors": 0}).reduce()
    assert summary["hook_errors"] == 2 and summary["loads_given_up"] == 1
    assert summary["disk_write_errors"] == 4 and "load_errors" not in summary


def test_the_log_summary_adds_worker_deltas_to_the_scheduler_counters(caplog):
    now = [0.0]
    sched, stats = make_stats(clock=lambda: now[0])
    sched.counters.hook_errors += 1
    stats.add_worker({"remote_errors": 2})
    stats.add_worker({"remote_errors": 1})
    with caplog.at_level(logging.INFO, logger="kv_offload"):
        stats.maybe_log_summary()  # within the interval: nothing
        now[0] = SUMMARY_INTERVAL_S
        stats.maybe_log_summary()
    (line,) = [r.getMessage() for r in caplog.records if "summary since start" in r.getMessage()]
    assert "hook_errors=1" in line and "remote_errors=3" in line and "cpu_usage=0.0" in line


def test_scheduler_stats_are_deltas_with_gauges_and_empty_when_nothing_moved():
    sched, stats = make_stats()
    assert stats.take() == {}
    sched.counters.loads_given_up += 1
    assert stats.take() == {"loads_given_up": 1, "pending_jobs": 0, "cpu_used_bytes": 0,
                            "cpu_capacity_bytes": 4096}
    assert stats.take() == {}


def test_every_metric_is_documented_and_the_docs_name_no_other():
    docs = DOCS.read_text()
    for s in (*COUNTERS.values(), *GAUGES.values()):
        assert f"`{s.metric}`" in docs, f"{s.metric} missing from docs/metrics.md"
        for key, value in s.labels:
            assert f'{key}="{value}"' in docs
    exported = {s.metric for s in (*COUNTERS.values(), *GAUGES.values())}
    named = set(re.findall(r"`(kv_offload_\w+)", docs))
    assert named <= exported, f"docs/metrics.md names metrics nobody exports: {named - exported}"


def test_every_counter_the_docs_and_readme_name_is_exported():
    """docs/bad-input.md and docs/vllm-bugs.md tell operators what is counted: every
    ``kv_offload_*_total`` any doc names must exist on /metrics."""
    root = DOCS.parents[1]
    exported = {s.metric for s in COUNTERS.values()}
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        named = set(re.findall(r"\bkv_offload_\w+_total\b", path.read_text()))
        assert named <= exported, f"{path.name} names unexported counters: {named - exported}"


# ---- the Grafana dashboard (examples/grafana_dashboard.json) -----------------------------

DASHBOARD = DOCS.parents[1] / "examples" / "grafana_dashboard.json"
# vLLM's own metrics the dashboard shows next to ours (Prometheus sample names)
VLLM_METRICS = {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                "vllm:external_prefix_cache_hits_total"}
PROMQL_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and",
                   "or", "unless", "bool", "offset"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions,
    keywords, label matchers, ranges or grouping labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = PROMQL_GROUPING.sub("", expr)
    names = set(re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)\b(?!\s*\()", expr))
    return names - PROMQL_KEYWORDS


def dashboard_expressions() -> list[str]:
    import json

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":  # label_values(metric, label): the metric
            exprs += re.findall(r"label_values\(([^,]+),", var["definition"])
    return exprs


def test_promql_metric_names_are_found():
    expr = ('sum by (tier) (rate(kv_offload_hit_tokens_total{model_name=~"$m"}[5m])) / on() '
            'group_left() (sum(rate(vllm:prefix_cache_queries_total[1m])) + min(x_up) * 2)')
    assert promql_metrics(expr) == {"kv_offload_hit_tokens_total",
                                    "vllm:prefix_cache_queries_total", "x_up"}


def test_every_dashboard_expression_names_exported_metrics_only():
    exported = {s.metric for s in (*COUNTERS.values(), *GAUGES.values())}
    exprs = dashboard_expressions()
    assert len(exprs) >= 10
    for expr in exprs:
        unknown = promql_metrics(expr) - exported - VLLM_METRICS
        assert promql_metrics(expr) and not unknown, f"{expr!r} names {unknown}"


def test_the_dashboard_shows_every_exported_metric():
    shown = set().union(*(promql_metrics(e) for e in dashboard_expressions()))
    missing = {s.metric for s in (*COUNTERS.values(), *GAUGES.values())} - shown
    assert not missing, f"examples/grafana_dashboard.json shows no panel for {missing}"
