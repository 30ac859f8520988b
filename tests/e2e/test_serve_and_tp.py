"""kv-offload behind the OpenAI server (JSON --kv-transfer-config) and with TP=2."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kv_offload import OffloadConfig
from kv_offload.testing.openai_server import OpenAIServer, metric_sum
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
from kv_offload.testing.workload import run_in_subprocess

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_server):
    """`vllm serve` (as python -m, see README) with the connector, on a loopback port."""
    model = make_tiny_model()
    store = tmp_path_factory.mktemp("serve-store")
    cfg = OffloadConfig(cpu_size="64MiB", disk_path=str(store), chunk_tokens=64,
                        remote_url=redis_server.url)
    args = ["--block-size", "32", "--max-model-len", "4096", "--enforce-eager", "--dtype",
            "float32", "--kv-cache-memory-bytes", str(512 * 2**20),
            "--kv-transfer-config", cfg.to_json()]
    with OpenAIServer(model, args, log_path=tmp_path_factory.mktemp("serve-log") / "server.log",
                      env={"VLLM_SERVER_DEV_MODE": "1"}) as server:
        yield server, model


def test_served_requests_hit_the_cpu_tier_and_match_recompute(server, tmp_path):
    server, model = server
    prefix = make_prompt(600, seed=3)
    prompts = [prefix + make_prompt(30, seed=4), prefix + make_prompt(45, seed=5)]
    ref = run_in_subprocess({"model": str(model), "offload": None, "engine": {},
                             "in_process": True,
                             "phases": [{"prompts": prompts}]}, tmp_path)
    texts = []
    for i, prompt in enumerate(prompts):
        if i == 1:  # empty vLLM's own cache so the shared prefix must come from kv-offload
            server.post("/reset_prefix_cache", {})
            before = server.metrics()
        body = server.post("/v1/completions", {"model": str(model), "prompt": prompt,
                                               "max_tokens": 16, "temperature": 0,
                                               "ignore_eos": True})
        texts.append(json.loads(body)["choices"][0]["text"])
    assert texts == ref["phases"][0]["texts"]
    after = server.metrics()
    assert metric_sum(after, "vllm:prompt_tokens_cached_by_source_total", source="host") >= 576
    # kv-offload's own metrics are on /metrics and moved with the warm request.
    hit = ("kv_offload_hit_tokens_total",)
    assert (metric_sum(after, *hit, tier="cpu") - metric_sum(before, *hit, tier="cpu")) >= 576
    assert metric_sum(after, "kv_offload_chunks_stored_total", tier="cpu") >= 9
    assert metric_sum(after, "kv_offload_transfer_bytes_total", direction="load") > 0
    # The remote tier is reported like the others (its writes finish in the background).
    deadline = time.time() + 30
    while time.time() < deadline:
        after = server.metrics()
        if metric_sum(after, "kv_offload_chunks_stored_total", tier="remote") >= 9:
            break
        time.sleep(1)
    assert metric_sum(after, "kv_offload_chunks_stored_total", tier="remote") >= 9
    assert metric_sum(after, "kv_offload_transfer_bytes_total", direction="remote_write") > 0
    assert metric_sum(after, "kv_offload_remote_lookups_total") >= 1
    up = [s.value for s in after if s.name == "kv_offload_remote_up"]
    assert up and all(v == 1.0 for v in up), up


@pytest.fixture(scope="module")
def tp2_runs(tmp_path_factory, redis_server):
    """Two TP=2 engines (two "hosts") with their own stores, sharing one Redis."""
    model = make_tiny_model()
    prompts = [make_prompt(500, seed=7) + make_prompt(20 + i, seed=8 + i) for i in range(3)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    engine = {"tensor_parallel_size": 2}

    def offload(store):  # a lookup budget of 500 ms, as in test_remote_tier.py: on a loaded
        # 2-core machine round trips pass the default 50 ms, and a lookup past it is a miss
        return {"cpu_size": "64MiB", "disk_path": str(store), "chunk_tokens": 64,
                "remote_url": redis_server.url, "connector_reset": "cpu",
                "remote_lookup_budget_ms": 500.0}

    first = run_in_subprocess(
        {"model": str(model), "offload": offload(tmp_path_factory.mktemp("tp2-a") / "store"),
         "engine": engine,
         "phases": [{"name": "cold", "prompts": prompts},
                    {"name": "cpu", "prompts": prompts, "reset_prefix_cache": True}]},
        tmp_path_factory.mktemp("tp2-a-run"), env=env)
    store = tmp_path_factory.mktemp("tp2-b") / "store"
    second = run_in_subprocess(
        {"model": str(model), "offload": offload(store), "engine": engine,
         "phases": [{"name": "remote", "prompts": prompts},
                    {"name": "disk", "prompts": prompts, "reset_connector": True}]},
        tmp_path_factory.mktemp("tp2-b-run"), env=env)
    return store, first, second


def test_tp2_ranks_have_own_slabs_and_outputs_match(tp2_runs):
    """Each rank stores and loads its own part: CPU tier, remote tier (every rank's value
    must exist), and the disk tier filled from the remote tier (one slab per rank)."""
    store, first, second = tp2_runs
    cold, cpu = first["phases"]
    remote, disk = second["phases"]
    assert cold["metrics"]["external_hits"] == 0
    assert cpu["tokens"] == cold["tokens"] and cpu["metrics"]["hits_host"] >= 448
    assert remote["tokens"] == cold["tokens"]
    assert remote["metrics"]["hits_external_unspecified"] >= 448
    assert disk["tokens"] == cold["tokens"] and disk["metrics"]["hits_disk"] >= 448
    ranks = sorted(p.name for p in Path(store).glob("slabs/*/*.slab"))
    assert ranks == ["rank0-of-2.slab", "rank1-of-2.slab"]
