"""Smoke tests of the benchmark scripts: they run in --quick mode and write the JSON
that benchmarks/run_all.py renders. No timing is asserted: these machines are noisy.

The engine benchmarks start real vLLM engines (the tiny test model, prompts of a few
hundred tokens): together they take a few minutes on two cores.
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def need_redis_server() -> None:
    """Skip without a redis-server binary unless KV_OFFLOAD_REQUIRE_REDIS=1 (as the
    remote-tier tests do): then fail."""
    if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
        if os.environ.get("KV_OFFLOAD_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is required (KV_OFFLOAD_REQUIRE_REDIS=1) but missing")
        pytest.skip("redis-server not installed (apt-get install redis-server)")


def run_script(name: str, *args: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(BENCH / name), *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{name} failed:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


def run_json(name: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    run_script(name, "--quick", "--json", str(out), *args)
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", ["bench_ttft.py", "bench_overhead.py", "bench_lookup.py",
                                  "bench_remote.py", "bench_copy.py", "bench_tiers.py",
                                  "bench_concurrent.py", "run_all.py"])
def test_help(name):
    assert "--quick" in run_script(name, "--help").stdout


def test_sized_flags_follow_quick():
    """A sized flag takes its --quick default with --quick, its full default without,
    and the value given on the command line either way."""
    sys.path.insert(0, str(BENCH))
    try:
        from _common import BenchParser
    finally:
        sys.path.remove(str(BENCH))
    parser = BenchParser("doc")
    parser.sized("--rounds", 6, 1, "rounds")
    assert "(default 6, --quick 1)" in parser.format_help()
    assert parser.parse_args([]).rounds == 6
    assert parser.parse_args(["--quick"]).rounds == 1
    assert parser.parse_args(["--quick", "--rounds", "3"]).rounds == 3


def test_copy_quick(tmp_path):
    data = run_json("bench_copy.py", tmp_path, "--chunk-kib", "256", "2048")
    cases = {(r["chunk_kib"], r["ids"], r["direction"]) for r in data["results"]}
    assert cases == {(c, i, d) for c in (256, 2048) for i in ("contiguous", "shuffled")
                     for d in ("store", "load")}
    for r in data["results"]:
        assert r["engine_gbps"] > 0 and r["memcpy_gbps"] > 0, r
        assert r["ratio"] == pytest.approx(r["engine_gbps"] / r["memcpy_gbps"], rel=1e-6), r
        assert r["target"] == (0.8 if r["chunk_kib"] >= 2048 else 0.6), r


def test_tiers_quick(tmp_path):
    data = run_json("bench_tiers.py", tmp_path)
    phases = ("write", "write_sync", "read_warm", "read_cold")
    rows = [r for r in data["io"] if r["chunk"]]
    assert {r["contender"] for r in rows} == {
        "raw sequential file", "ours: slab only (1 thread)", "ours (1 thread)",
        "vllm fs io (O_DIRECT)", "vllm fs io (buffered)"}
    for r in rows:  # vLLM's O_DIRECT I/O may be refused by the file system: said, not hidden
        assert "error" in r or all(r[p + "_gbps"] > 0 for p in phases), r
    graded = [r for r in data["io_ratios"] if r["graded"]]
    assert graded and all(r[p] > 0 for r in graded for p in phases), data["io_ratios"]


def test_docs_report_is_rendered_from_the_committed_json(tmp_path):
    """docs/benchmarks.md is what ``run_all.py --report-only`` makes of docs/bench-data:
    a change to a template or a section that is not rerendered fails here."""
    shutil.copytree(ROOT / "docs" / "bench-data", tmp_path / "bench-data")
    run_script("run_all.py", "--report-only", "--out", str(tmp_path))

    def normal(text: str) -> list[str]:  # the rebuild time differs
        return [re.sub(r"rebuilt [^.]*\.", "rebuilt X.", line) for line in text.splitlines()]

    rendered = normal((tmp_path / "benchmarks.md").read_text())
    assert rendered == normal((ROOT / "docs" / "benchmarks.md").read_text()), (
        "docs/benchmarks.md is stale: rebuild it with benchmarks/run_all.py --report-only")


def test_lookup_quick(tmp_path):
    data = run_json("bench_lookup.py", tmp_path, "--sizes", "1000,2000", "--calls", "20")
    assert [r["num_chunks"] for r in data["results"]] == [1000, 2000]
    for row in data["results"]:
        for key in ("lookup_cpu_us_per_chunk", "lookup_disk_us_per_chunk",
                    "lookup_miss_us_per_request", "plan_load_cpu_us_per_chunk",
                    "plan_load_disk_us_per_chunk", "plan_store_us_per_chunk",
                    "complete_store_us_per_chunk"):
            assert row[key] > 0, key
    verdicts = data["verdicts"]
    # Each verdict follows from its own figures: PASS exactly when value <= limit, and a
    # "flat" value is the largest size's time over the smallest's.
    assert verdicts and all(v["pass"] is (v["value"] <= v["limit"]) for v in verdicts), verdicts
    small, large = data["results"]
    flat = [v for v in verdicts if " flat: " in v["target"]]
    assert flat, verdicts
    for v in flat:
        key = v["target"].split(" ")[0]
        assert v["value"] == pytest.approx(large[key] / small[key], abs=0.006), v


def test_report_renders_partial_results(tmp_path):
    """run_all --report-only renders what is there and says what is missing."""
    data = tmp_path / "bench-data"
    data.mkdir()
    run_script("bench_lookup.py", "--quick", "--sizes", "1000", "--calls", "10",
               "--json", str(data / "lookup.json"))
    (data / "copy.json").write_text(json.dumps({"results": [
        {"engine": "torch", "chunk_kib": 256, "ids": "contiguous", "direction": "load",
         "engine_gbps": 3.0, "memcpy_gbps": 4.0, "ratio": 0.75, "target": 0.6}]}))
    (data / "tiers.json").write_text(json.dumps({"io": [{"chunk": 262144}]}))  # odd format
    run_script("run_all.py", "--report-only", "--out", str(tmp_path))
    report = (tmp_path / "benchmarks.md").read_text()
    assert "## Machine" in report and "## Targets" in report
    assert "Scheduler lookup" in report and "Copy engine" in report
    assert "No results: not run." in report  # ttft, overhead
    assert (tmp_path / "img" / "copy_gbps.png").stat().st_size > 0


@pytest.mark.engine
def test_ttft_quick(tmp_path):
    data = run_json("bench_ttft.py", tmp_path, "--lengths", "256")
    for mode in ("cold", "cold_peer", "vllm_hit", "cpu", "cpu_new_suffix", "disk",
                 "peer_same_process", "peer_warm"):
        assert data["modes"][mode]["256"]["median_s"] > 0, mode
    hits = data["modes"]
    # a prompt of 256 + 16 tokens: served to its last token but one (partial_hits)
    assert hits["cpu"]["256"]["hits"]["host_hit"] == 256 + 16 - 1
    assert hits["disk"]["256"]["hits"]["disk_hit"] == 256 + 16 - 1
    assert hits["peer_warm"]["256"]["hits"]["external_hit"] > 0
    assert {"cpu_vs_cold", "disk_vs_cold", "cpu_vs_peer", "disk_vs_peer", "cpu_vs_vllm_hit",
            "disk_vs_vllm_hit", "cpu_vs_own_hit", "disk_vs_own_hit"} <= set(data["ratios"]["256"])
    for mode, hit in (("cpu", "own_hit"), ("disk", "own_hit_restarted")):  # measured in pairs
        assert len(hits[mode]["256"]["samples_s"]) == len(hits[hit]["256"]["samples_s"])
        assert hits[hit]["256"]["hits"]["vllm_hit"] == 256
    # graded at 4k and 8k, or the longest length measured below: 256 here
    assert [(v["key"], v["length"]) for v in data["verdicts"]][-2:] == [
        ("cpu_vs_own_hit", 256), ("disk_vs_own_hit", 256)]
    assert len(data["verdicts"]) == 6


@pytest.mark.engine
def test_ttft_sliding_window_quick(tmp_path):
    """--sliding-window: a Gemma-3-style model with vLLM's hybrid KV cache manager on, no
    peer; the device KV capacity with the manager off and on (what the engines report,
    equal to kv_capacity's plan), computed rows for real geometries; the report renders it."""
    data = run_json("bench_ttft.py", tmp_path, "--sliding-window", "64", "--lengths", "256")
    assert data["model"]["sliding_window"] == 64 and data["engine"][
        "disable_hybrid_kv_cache_manager"] is False
    assert not any(mode.startswith(("peer", "cold_peer")) for mode in data["modes"])
    for mode, hit in (("cpu", "own_hit"), ("disk", "own_hit_restarted")):  # paired
        assert len(data["modes"][mode]["256"]["samples_s"]) == len(
            data["modes"][hit]["256"]["samples_s"])
    off, on = data["capacity"]["measured"]
    assert off["engine"]["groups"] == ["full(64) x4"] and off["engine"]["hybrid_manager"] is False
    assert on["engine"]["hybrid_manager"] is True and not on["turned_off_logged"]
    assert sorted(on["engine"]["groups"]) == ["full x2", "sliding_window(64) x2"]
    for row in (off, on):  # the engine reports what kv_capacity computes
        assert row["engine"]["num_blocks"] == row["computed"]["num_blocks"]
        assert row["engine"]["kv_cache_size_tokens"] == row["computed"]["kv_cache_size_tokens"]
    assert on["engine"]["max_concurrency"] > off["engine"]["max_concurrency"]
    computed = data["capacity"]["computed"]
    assert len(computed) == 12 and all(r["ratio"] > 1 for r in computed)

    out = tmp_path / "report"
    (out / "bench-data").mkdir(parents=True)
    (out / "bench-data" / "hybrid.json").write_text(json.dumps(data))
    run_script("run_all.py", "--report-only", "--out", str(out))
    report = (out / "benchmarks.md").read_text()
    assert "## Sliding-window models: device KV capacity and TTFT" in report
    assert "Could not render" not in report and "Gemma-3-27B-like" in report
    assert "TTFT (sliding window): CPU-tier hit" in report  # its targets, apart from ttft's
    assert "ExampleConnector warm at" not in report.split("## Sliding-window")[0].split(
        "## Targets")[1]  # no peer targets for the sliding-window run


@pytest.mark.engine
def test_ttft_chat_quick(tmp_path):
    """--chat: two conversations of three turns on plain vLLM and on kv-offload with and
    without partial hits, side by side, each engine with room for one longest prompt in
    its KV cache; plain vLLM serves from its own prefix cache only, partial hits serve more
    of each later turn than it (the previous prompt to its last token, where vLLM's cache
    stops at a whole block), and the report renders the section and its plot."""
    data = run_json("bench_ttft.py", tmp_path, "--chat", "2")
    assert not data["errors"] and set(data["modes"]) == {"plain", "whole", "partial"}
    plain, partial = data["modes"]["plain"], data["modes"]["partial"]
    assert list(plain) == list(partial) == list(data["modes"]["whole"]) == ["1", "2", "3"]
    assert data["engine"]["kv_cache_memory_bytes"] == (4096 + 32) * 4096  # 4 KiB a token
    for turn in ("2", "3"):
        assert all(len(m[turn]["served"]) == 2 for m in data["modes"].values())
        assert not any(plain[turn]["host_hits"]), "no connector: vLLM's own hits only"
        assert sum(partial[turn]["served"]) > sum(plain[turn]["served"]), turn
    out = tmp_path / "report"
    (out / "bench-data").mkdir(parents=True)
    (out / "bench-data" / "chat.json").write_text(json.dumps(data))
    run_script("run_all.py", "--report-only", "--out", str(out))
    report = (out / "benchmarks.md").read_text()
    assert "## Multi-turn chat" in report and "Could not render" not in report
    assert "img/chat.png" in report and (out / "img" / "chat.png").stat().st_size > 0


@pytest.mark.engine
def test_concurrent_quick(tmp_path):
    """Two engines, one round of four phases: every hit is served from a cache (after the
    reset, only kv-offload's CPU tier can), decodes ran while hits were in flight, each
    kv-offload mode has its ratios to plain, and the report renders it."""
    data = run_json("bench_concurrent.py", tmp_path)
    assert set(data["summary"]) == {"sync", "plain@sync", "async", "plain@async"}
    for mode, s in data["summary"].items():
        assert s["hits"] == 2 and s["cached_tokens_min"] >= 512, (mode, s)
        assert s["itl_gaps"] > 0 and s["itl_median_ms"] > 0, (mode, s)
    for mode in ("sync", "async"):
        assert set(data["summary"][mode]["vs_plain"]) == {
            "ttft_median_ms", "ttft_p90_ms", "paired_ttft", "itl_median_ms", "itl_p99_ms"}
    out = tmp_path / "report"
    (out / "bench-data").mkdir(parents=True)
    (out / "bench-data" / "concurrent.json").write_text(json.dumps(data))
    run_script("run_all.py", "--report-only", "--out", str(out))
    report = (out / "benchmarks.md").read_text()
    assert "## Decodes while hits load" in report and "Could not render" not in report


@pytest.mark.engine
def test_overhead_quick(tmp_path):
    data = run_json("bench_overhead.py", tmp_path, "--num-prompts", "2")
    for workload in ("no_reuse", "reuse_50"):
        summary = data["summary"][workload]
        assert summary["throughput_ratio"] > 0
        for name in ("plain", "ours"):
            assert summary[name]["throughput_tok_s"] > 0
    assert data["summary"]["reuse_50"]["ours"]["external_hit_tokens"] > 0
    verdicts = data["verdicts"]  # each follows from its own figures
    assert verdicts and all(v["pass"] is (v["value"] is not None and v["value"] >= v["limit"])
                            for v in verdicts), verdicts


@pytest.mark.engine
def test_remote_quick(tmp_path):
    """Every section of bench_remote's JSON is there with positive numbers, and the
    report renders it."""
    need_redis_server()
    data = run_json("bench_remote.py", tmp_path, "--chunk-kib", "256,2048", "--total-mib", "8",
                    "--lookup-keys", "16,64", "--lookup-calls", "20", "--lengths", "256")
    kinds = {"remote", "raw", "disk"}
    cases = {(r["chunk"], r["threads"], r["kind"]) for r in data["io"]}
    assert cases == {(c, t, k) for c in (256 << 10, 2 << 20) for t in (1, 4) for k in kinds}
    for row in data["io"]:
        assert row["store_gbps"] > 0 and row["load_gbps"] > 0, row
        assert row["store_cpu_s_per_gb"] >= 0 and row["load_cpu_s_per_gb"] >= 0, row
        assert row["store_page_faults_per_mb"] >= 0 and row["load_page_faults_per_mb"] >= 0
    assert all(r["load_cold_gbps"] > 0 for r in data["io"] if r["kind"] == "disk")
    assert len(data["io_ratios"]) == 4
    for row in data["io_ratios"]:
        for key in ("remote_vs_disk_store", "remote_vs_disk_load", "remote_vs_disk_cold_load",
                    "ours_vs_raw_store", "ours_vs_raw_load"):
            assert row[key] > 0, key
    # the connector's own client: hiredis parses, kv-offload packs
    assert data["clients"]["remote"].endswith("+ RespPacker")
    assert "Hiredis" in data["clients"]["remote"]
    for rows in (data["lookup"], data["lookup_cluster"]):
        assert {(r["keys"], r["present"]) for r in rows} == {
            (n, p) for n in (16, 64) for p in (True, False)}
        for row in rows:
            assert row["median_us"] > 0 and row["p99_us"] >= row["median_us"], row
            assert row["median_us_per_key"] == pytest.approx(row["median_us"] / row["keys"],
                                                             abs=0.02)
    ttft = data["ttft"]
    assert ttft["tokens_equal"] is True
    assert ttft["remote_hit_tokens"] > 0  # vLLM counted tokens loaded from Redis
    for mode in ("cold", "remote"):
        assert ttft["modes"][mode]["256"]["median_s"] > 0
    assert ttft["ratios"]["256"] > 0

    out = tmp_path / "report"
    (out / "bench-data").mkdir(parents=True)
    (out / "bench-data" / "remote.json").write_text(json.dumps(data))
    run_script("run_all.py", "--report-only", "--out", str(out))
    report = (out / "benchmarks.md").read_text()
    assert "## Remote tier (`bench_remote.py`)" in report and "Could not render" not in report
    assert "ours/raw store" in report and "store CPU s/GB" in report
    assert "The same lookups against a 3-node cluster" in report
    assert "Measured by an earlier version of this benchmark" in report


def test_rotated_orders_balance_firsts_and_successors():
    """Every engine goes first, and follows every other engine, equally often."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import rotated

    names = ["plain", "ours", "ours_bg"]
    orders = [rotated(names, r) for r in range(2 * len(names))]
    assert all(sorted(o) == sorted(names) for o in orders)
    assert collections.Counter(o[0] for o in orders) == dict.fromkeys(names, 2)
    pairs = collections.Counter((a, b) for o in orders for a, b in zip(o, o[1:]))
    assert set(pairs.values()) == {2} and len(pairs) == 6
