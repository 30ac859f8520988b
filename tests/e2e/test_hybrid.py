"""A sliding-window + full attention model with vLLM's hybrid KV cache manager on.

kv-offload implements ``SupportsHMA``, so vLLM keeps one KV cache group per attention
kind (sliding-window layers keep only their window) instead of turning the manager off.
Cold runs, CPU-tier hits and disk hits after a restart must give the greedy tokens of an
engine without a connector, with the chunk shorter than the window (every block of a
chunk stored) and longer than it (only the window's tail stored for the sliding layers).
So must a new engine that loads the prompts from the remote tier (Redis) another engine
wrote.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_offload.testing.tiny_model import make_prompt, make_tiny_hybrid_model
from kv_offload.testing.workload import run_in_subprocess

pytestmark = pytest.mark.engine

WINDOW = 64  # tokens; the engine's block size is 32 (default_engine_kwargs)
PREFIX_TOKENS = 512
HYBRID = {"disable_hybrid_kv_cache_manager": False}  # fail, never fall back, if refused


def prompts() -> list[str]:
    """Three prompts sharing a 512-token prefix (lengths not on a chunk boundary), and
    an unrelated one."""
    prefix = make_prompt(PREFIX_TOKENS, seed=3)
    return [prefix + make_prompt(37 + 29 * i, seed=30 + i) for i in range(3)] + [
        make_prompt(410, seed=60)]


def spec(model: Path, offload: dict | None, phases: list[dict]) -> dict:
    return {"model": str(model), "offload": offload, "engine": HYBRID, "phases": phases,
            "in_process": True}


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_hybrid_model(sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> list[list[int]]:
    """Tokens recomputed by vLLM (hybrid manager on) without any connector."""
    out = run_in_subprocess(spec(model, None, [{"prompts": prompts()}]),
                            tmp_path_factory.mktemp("hybrid-ref"))
    return out["phases"][0]["tokens"]


@pytest.fixture(scope="module", params=[32, 128], ids=["chunk-below-window",
                                                      "chunk-above-window"])
def runs(request, model, reference, tmp_path_factory) -> tuple[dict, dict]:
    """A cold run then a CPU-tier hit after vLLM's prefix cache was reset; then a new
    process on the same store, where only the disk tier holds the prompts."""
    store = tmp_path_factory.mktemp("hybrid-store") / "store"
    offload = {"cpu_size": "64MiB", "disk_path": str(store), "disk_size": "256MiB",
               "chunk_tokens": request.param, "io_threads": 2}
    first = run_in_subprocess(spec(model, offload, [
        {"name": "cold", "prompts": prompts()},
        {"name": "cpu", "prompts": prompts(), "reset_prefix_cache": True}]),
        tmp_path_factory.mktemp("hybrid-first"))
    restarted = run_in_subprocess(spec(model, offload, [{"name": "disk", "prompts": prompts()}]),
                                  tmp_path_factory.mktemp("hybrid-restart"))
    return first, restarted


def test_the_engine_keeps_its_hybrid_kv_cache_groups(runs):
    first, _ = runs
    assert "2 KV cache groups (vLLM's hybrid KV cache manager)" in first["log"]
    assert "sliding_window(64)" in first["log"]
    assert "Turning off hybrid kv cache manager" not in first["log"]


def test_cold_and_cpu_tier_hits_equal_recompute(runs, reference):
    first, _ = runs
    cold, warm = first["phases"]
    assert cold["tokens"] == reference
    assert warm["tokens"] == reference
    assert warm["metrics"]["hits_host"] >= PREFIX_TOKENS


def test_disk_hits_after_a_restart_equal_recompute(runs, reference):
    _, restarted = runs
    phase = restarted["phases"][0]
    assert phase["tokens"] == reference
    assert phase["metrics"]["hits_disk"] >= PREFIX_TOKENS


# -- the remote tier: a writer and a reader that share only a Redis server ----------------

REMOTE_CHUNK = 128  # above the window: an entry holds the sliding layers' tail only


def remote_offload(url: str) -> dict:
    # No disk tier: the reader can only find the prompts in Redis. A lookup budget of
    # 500 ms, as in test_remote_tier.py: on a loaded 2-core machine round trips pass the
    # default 50 ms, and a lookup past its budget is a miss.
    return {"cpu_size": "64MiB", "chunk_tokens": REMOTE_CHUNK, "io_threads": 2,
            "remote_url": url, "remote_lookup_budget_ms": 500.0}


@pytest.fixture(scope="module")
def remote_runs(model, redis_server, tmp_path_factory) -> tuple[dict, dict]:
    """A writer engine runs the prompts cold (storing them in Redis) and exits; then a
    new process, its CPU tier empty and no disk tier, runs them again."""
    offload = remote_offload(redis_server.url)
    writer = run_in_subprocess(spec(model, offload, [{"name": "cold", "prompts": prompts()}]),
                               tmp_path_factory.mktemp("hybrid-remote-writer"))
    reader = run_in_subprocess(spec(model, offload, [{"name": "remote", "prompts": prompts()}]),
                               tmp_path_factory.mktemp("hybrid-remote-reader"))
    return writer, reader


def test_remote_hits_in_a_new_engine_equal_recompute(remote_runs, reference):
    writer, reader = remote_runs
    assert "2 KV cache groups (vLLM's hybrid KV cache manager)" in reader["log"]
    cold, remote = writer["phases"][0], reader["phases"][0]
    # Redis is empty for the writer; its own CPU tier may serve a later prompt of the
    # batch once the first one stored the prefix (vLLM frees out-of-window blocks).
    assert cold["metrics"]["hits_external_unspecified"] == 0, "Redis was empty"
    assert cold["tokens"] == reference
    assert remote["tokens"] == reference
    # The first request sharing the prefix fetches it; the others in its batch wait for
    # that fetch and count host hits.
    assert remote["metrics"]["hits_external_unspecified"] >= PREFIX_TOKENS
