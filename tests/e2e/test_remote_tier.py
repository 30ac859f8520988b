"""The remote tier in real vLLM engines (CPU backend) against real Redis servers.

Every engine runs in a fresh process with its own disk store, as on different hosts;
they share only the Redis server. The reference tokens are those of the first engine's
cold run, which loads nothing (asserted), i.e. tokens computed from scratch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kv_offload.disk import iter_entries, list_namespaces
from kv_offload.testing.redis_server import RedisServer
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
from kv_offload.testing.workload import run_in_subprocess

pytestmark = pytest.mark.engine

PREFIX_TOKENS = 640
CHUNK = 64


def prompts() -> list[str]:
    """Four prompts sharing a 640-token prefix, and two unrelated ones."""
    prefix = make_prompt(PREFIX_TOKENS, seed=201)
    shared = [prefix + make_prompt(40 + 7 * i, seed=210 + i) for i in range(4)]
    return shared + [make_prompt(300, seed=250), make_prompt(520, seed=251)]


def later_prompts() -> list[str]:
    """Prompts first seen after the server came back."""
    return [make_prompt(400 + 60 * i, seed=260 + i) for i in range(3)]


def offload(store: Path | None, **remote) -> dict:
    return {"cpu_size": "64MiB", "disk_path": str(store) if store else None,
            "disk_size": "256MiB", "chunk_tokens": CHUNK, "io_threads": 2,
            "remote_max_backoff_s": 2.0, **remote}


def spec(model: Path, offload_cfg: dict, phases: list[dict]) -> dict:
    # Each host is its own OS process; vLLM's engine core and worker run inside it.
    return {"model": str(model), "offload": offload_cfg, "engine": {}, "phases": phases,
            "in_process": True}


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def first_host(model, redis_server, tmp_path_factory) -> dict:
    """Host A: cold run of every prompt; it stores them in its tiers and in Redis."""
    phases = [{"name": "cold", "prompts": prompts() + later_prompts()}]
    store = tmp_path_factory.mktemp("host-a") / "store"
    return run_in_subprocess(spec(model, offload(store, remote_url=redis_server.url), phases),
                             tmp_path_factory.mktemp("run-a"))


@pytest.fixture(scope="module")
def reference(first_host) -> dict[str, list[int]]:
    cold = first_host["phases"][0]
    assert cold["metrics"]["external_hits"] == 0, "the reference run must compute everything"
    return dict(zip(prompts() + later_prompts(), cold["tokens"]))


def expected(reference, texts: list[str]) -> list[list[int]]:
    return [reference[t] for t in texts]


@pytest.fixture(scope="module")
def second_host(model, redis_server, first_host, tmp_path_factory) -> dict:
    """Host B: its own empty store, the same Redis."""
    store = tmp_path_factory.mktemp("host-b") / "store"
    phases = [{"name": "remote", "prompts": prompts()},
              {"name": "cpu", "prompts": prompts(), "reset_prefix_cache": True}]
    out = run_in_subprocess(spec(model, offload(store, remote_url=redis_server.url), phases),
                            tmp_path_factory.mktemp("run-b"))
    out["store"] = store
    return out


def test_second_host_loads_what_the_first_served(second_host, reference):
    phase = second_host["phases"][0]
    assert phase["tokens"] == expected(reference, prompts())
    assert phase["metrics"]["hits_external_unspecified"] >= PREFIX_TOKENS
    # Requests sharing the prefix in the same batch wait on the first one's fetch (host hits).
    assert phase["metrics"]["hits_disk"] == 0


def test_remote_chunks_land_in_the_local_tiers(second_host, reference):
    """Fetched chunks are published in B's CPU tier and written to B's disk."""
    phase = second_host["phases"][1]
    assert phase["tokens"] == expected(reference, prompts())
    assert phase["metrics"]["hits_host"] >= PREFIX_TOKENS
    (namespace,) = list_namespaces(second_host["store"])
    entries = list(iter_entries(second_host["store"], namespace["namespace_id"]))
    # B computed no full chunk itself: every chunk on its disk came from Redis.
    assert len(entries) >= PREFIX_TOKENS // CHUNK


def test_cluster_serves_across_three_nodes(model, redis_cluster, reference, tmp_path_factory):
    remote = {"remote_cluster_nodes": redis_cluster.seeds}
    phases = [{"name": "cold", "prompts": prompts()},
              {"name": "remote", "prompts": prompts(), "reset_connector": True}]
    out = run_in_subprocess(spec(model, offload(None, **remote), phases),
                            tmp_path_factory.mktemp("run-cluster"))
    cold, warm = out["phases"]
    assert cold["tokens"] == warm["tokens"] == expected(reference, prompts())
    assert warm["metrics"]["hits_external_unspecified"] >= PREFIX_TOKENS
    keys_per_node = [int(n.cli("dbsize").strip()) for n in redis_cluster.nodes]
    assert all(k > 0 for k in keys_per_node), keys_per_node


def test_server_killed_mid_workload(model, reference, tmp_path_factory):
    """Kill -9 the server while requests load from it, serve while it is down, restart it
    empty: every token equals recompute, and the tier works again once it is back."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis-killed")).start()
    try:
        kill = ["kill", "-9", str(server.proc.pid)]
        phases = [
            {"name": "warm", "prompts": prompts()},
            {"name": "killed", "prompts": prompts(), "reset_connector": True,
             "one_by_one": True, "command_during": {"argv": kill, "after_s": 0.3}},
            {"name": "down", "prompts": later_prompts()},
            # After the restart, the backoff's first call is a probe; writes racing with
            # it are skipped (counted), so a small request brings the tier back first.
            {"name": "probe", "prompts": [make_prompt(200, seed=299)],
             "command_before": server.argv(daemonize=True), "sleep_before_s": 3.0},
            {"name": "back", "prompts": later_prompts(), "reset_connector": True},
            {"name": "remote-again", "prompts": later_prompts() + prompts()[:1],
             "reset_connector": True}]
        out = run_in_subprocess(spec(model, offload(None, remote_url=server.url), phases),
                                tmp_path_factory.mktemp("run-killed"))
    finally:
        server.stop()
    by_name = {p["name"]: p for p in out["phases"]}
    for name, texts in [("warm", prompts()), ("killed", prompts()), ("down", later_prompts()),
                        ("back", later_prompts()),
                        ("remote-again", later_prompts() + prompts()[:1])]:
        assert by_name[name]["tokens"] == expected(reference, texts), name
    assert by_name["killed"]["metrics"]["hits_external_unspecified"] > 0, "killed mid-way"
    assert by_name["remote-again"]["metrics"]["hits_external_unspecified"] >= 2 * CHUNK
    assert out["log"].count("remote tier") >= 2
    failures = out["log"].count("failed (")
    assert 1 <= failures <= 6, f"one warning per burst and process, got {failures}"
    assert "is back after" in out["log"]
