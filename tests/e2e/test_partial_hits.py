"""Hits to the last cached token (issue 33) in a real vLLM engine (CPU backend).

One N-token prompt served again after vLLM's own prefix cache was reset is loaded up to
its last token but one (N - 1 tokens) from the CPU tier, for N a multiple of the chunk
(256), of the block (32) and neither; its greedy tokens equal vLLM's without the
connector; after a restart, from the disk tier (request tails are found there by their
parent chunk and tokens).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
from kv_offload.testing.workload import run_in_subprocess

pytestmark = pytest.mark.engine

CHUNK = 256
LENGTHS = (4096, 4100, 4000)  # a multiple of the chunk, of the block (32), neither
ENGINE = {"max_model_len": 4200}


def prompt(n: int) -> str:
    return make_prompt(n, seed=700 + n)


def spec(model: Path, offload: dict | None, phases: list[dict]) -> dict:
    return {"model": str(model), "offload": offload, "engine": ENGINE, "phases": phases,
            "in_process": True}


def offload(store: Path) -> dict:
    return {"cpu_size": "256MiB", "disk_path": str(store), "disk_size": "512MiB",
            "chunk_tokens": CHUNK}


def one_each(name: str) -> list[dict]:
    """One phase per prompt, vLLM's own prefix cache reset before each."""
    return [{"name": f"{name}-{n}", "prompts": [prompt(n)], "max_tokens": 8,
             "reset_prefix_cache": True} for n in LENGTHS]


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-store") / "store"


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict[int, list[int]]:
    out = run_in_subprocess(spec(model, None, [{"prompts": [prompt(n) for n in LENGTHS],
                                                "max_tokens": 8}]),
                            tmp_path_factory.mktemp("ref"))
    return dict(zip(LENGTHS, out["phases"][0]["tokens"]))


@pytest.fixture(scope="module")
def first_engine(model, store, tmp_path_factory) -> dict:
    phases = [{"name": "cold", "prompts": [prompt(n) for n in LENGTHS], "max_tokens": 8},
              *one_each("cpu")]
    return run_in_subprocess(spec(model, offload(store), phases),
                             tmp_path_factory.mktemp("first"))


@pytest.fixture(scope="module")
def restarted_engine(model, store, first_engine, tmp_path_factory) -> dict:
    return run_in_subprocess(spec(model, offload(store), one_each("disk")),
                             tmp_path_factory.mktemp("restart"))


def test_cold_run_equals_recompute(first_engine, reference):
    assert first_engine["phases"][0]["tokens"] == [reference[n] for n in LENGTHS]


@pytest.mark.parametrize("n", LENGTHS)
def test_cpu_tier_serves_all_but_the_last_token(first_engine, reference, n):
    phase = next(p for p in first_engine["phases"] if p["name"] == f"cpu-{n}")
    assert phase["tokens"] == [reference[n]]
    assert phase["metrics"]["external_hits"] == n - 1
    tail = phase["kv_offload"].get("kv_offload_tail_hit_tokens_total{}", 0)
    assert tail == (n - 1) % CHUNK if n % CHUNK else tail == 0


@pytest.mark.parametrize("n", LENGTHS)
def test_disk_tier_serves_all_but_the_last_token_after_a_restart(restarted_engine,
                                                                 reference, n):
    phase = next(p for p in restarted_engine["phases"] if p["name"] == f"disk-{n}")
    assert phase["tokens"] == [reference[n]]
    assert phase["metrics"]["external_hits"] == phase["metrics"]["hits_disk"] == n - 1
    tail = phase["kv_offload"].get("kv_offload_tail_hit_tokens_total{}", 0)
    assert tail == (n - 1) % CHUNK if n % CHUNK else tail == 0
