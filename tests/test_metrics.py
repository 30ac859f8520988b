"""OffloadStats: merging over ranks and steps, and the operator summary."""

from kv_offload.metrics import COUNTERS, GAUGES, OffloadStats


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


def test_every_metric_has_a_kv_offload_name_with_unit_and_docs():
    for name, doc, _ in COUNTERS.values():
        assert name.startswith("kv_offload_") and name.endswith("_total") and doc
    for name, doc in GAUGES.values():
        assert name.startswith("kv_offload_") and doc


def test_every_metric_is_documented():
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    for name, *_ in list(COUNTERS.values()) + list(GAUGES.values()):
        assert f"`{name}`" in docs, f"{name} missing from docs/metrics.md"
    for _, _, labels in COUNTERS.values():
        for key, value in labels.items():
            assert f'{key}="{value}"' in docs


def test_summary_counts_the_remote_tier():
    summary = OffloadStats(data={"hit_tokens_remote": 250, "miss_tokens": 750,
                                 "bytes_remote_read": 1e9, "seconds_remote_read": 0.5}).reduce()
    assert summary["hit_rate_remote"] == 0.25 and summary["remote_read_GBps"] == 2.0
