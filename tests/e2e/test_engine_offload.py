"""kv-offload in a real vLLM engine (CPU backend): every load path against recompute.

Each engine runs in a fresh process (``kv_offload.testing.workload``), with vLLM's
engine core and worker inside it (``in_process``: starts in seconds; the multi-process
layout is covered by test_serve_and_tp.py); module-scoped fixtures share them. Greedy tokens of the tiny model depend on every
prompt token, so KV loaded for the wrong prompt, layer or model changes the output.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kv_offload.disk import list_namespaces
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
from kv_offload.testing.workload import run_in_subprocess

pytestmark = pytest.mark.engine

PREFIX_TOKENS = 640
CHUNK = 64


def prompts() -> list[str]:
    """Four prompts sharing a 640-token prefix, and two unrelated ones."""
    prefix = make_prompt(PREFIX_TOKENS, seed=1)
    shared = [prefix + make_prompt(40 + 7 * i, seed=10 + i) for i in range(4)]
    return shared + [make_prompt(300, seed=50), make_prompt(520, seed=51)]


def offload(store: Path, **extra) -> dict:
    return {"cpu_size": "64MiB", "disk_path": str(store), "disk_size": "256MiB",
            "chunk_tokens": CHUNK, "io_threads": 2, **extra}


LOGPROBS_PHASE = {"name": "logprobs", "prompts": prompts(), "prompt_logprobs": 1,
                  "reset_prefix_cache": True}


def spec(model: Path, offload_cfg: dict | None, phases: list[dict], **engine) -> dict:
    return {"model": str(model), "offload": offload_cfg, "engine": engine, "phases": phases,
            "in_process": True}


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def other_model() -> Path:
    return make_tiny_model(num_layers=3)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-store") / "store"


@pytest.fixture(scope="module")
def reference_run(model, tmp_path_factory) -> dict:
    """vLLM without any connector: the prompts, then again with prompt logprobs."""
    return run_in_subprocess(spec(model, None, [{"prompts": prompts()}, LOGPROBS_PHASE]),
                             tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def reference(reference_run) -> list[list[int]]:
    """Tokens recomputed by vLLM without any connector."""
    return reference_run["phases"][0]["tokens"]


@pytest.fixture(scope="module")
def first_engine(model, store, reference, tmp_path_factory) -> dict:
    """Cold run, then the same prompts after vLLM's own prefix cache was reset, then
    again with prompt logprobs (every chunk is in the CPU tier by then)."""
    phases = [{"name": "cold", "prompts": prompts()},
              {"name": "cpu", "prompts": prompts(), "reset_prefix_cache": True},
              LOGPROBS_PHASE]
    return run_in_subprocess(spec(model, offload(store), phases),
                             tmp_path_factory.mktemp("first"))


@pytest.fixture(scope="module")
def restarted_engine(model, store, first_engine, tmp_path_factory) -> dict:
    """A new process on the same store: the CPU tier is empty, the disk tier is not. Then
    the disk tier again, vLLM's prefix cache and the CPU tier dropped
    (``connector_reset="cpu"``)."""
    phases = [{"name": "disk", "prompts": prompts()},
              {"name": "disk again", "prompts": prompts(), "reset_connector": True}]
    return run_in_subprocess(spec(model, offload(store, connector_reset="cpu"), phases),
                             tmp_path_factory.mktemp("restart"))


def test_cold_outputs_equal_recompute(first_engine, reference):
    assert first_engine["phases"][0]["tokens"] == reference
    assert first_engine["phases"][0]["metrics"]["external_hits"] == 0


def test_cpu_tier_serves_after_prefix_cache_reset(first_engine, reference):
    warm = first_engine["phases"][1]
    assert warm["tokens"] == reference
    # Every chunk-aligned prefix below the last token is served: at least the shared prefix.
    assert warm["metrics"]["hits_host"] >= PREFIX_TOKENS
    # ... in the step that scheduled each request (CPU-tier chunks load before the forward)
    assert warm["kv_offload"]["kv_offload_loads_same_step_total{}"] >= 1  # within the budget
    # ... copied layer by layer while the forward runs, each layer waiting for its own
    assert "same-step loads are copied layer by layer" in first_engine["log"]


def test_prompt_logprobs_requests_are_not_looked_up_and_equal_recompute(first_engine,
                                                                        reference_run):
    """Issue 32 §3: vLLM discards the connector's hits of a request asking for prompt
    logprobs (every prompt position must be computed). kv-offload does not look such a
    request up though the CPU tier holds its chunks, and counts its tokens apart, not as
    misses; its tokens and prompt logprobs are vLLM's without the connector."""
    phase, ref = first_engine["phases"][2], reference_run["phases"][1]
    assert phase["tokens"] == ref["tokens"] == reference_run["phases"][0]["tokens"]
    for ours, theirs in zip(phase["prompt_logprobs"], ref["prompt_logprobs"]):
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert phase["metrics"]["external_hits"] == 0
    counts = phase["kv_offload"]
    assert counts.get("kv_offload_lookup_skipped_tokens_total{}", 0) >= 4 * PREFIX_TOKENS
    assert counts.get("kv_offload_miss_tokens_total{}", 0) == 0


def test_restarted_engine_hits_disk_tier(restarted_engine, reference):
    phase = restarted_engine["phases"][0]
    assert phase["tokens"] == reference
    assert phase["metrics"]["hits_disk"] >= PREFIX_TOKENS
    # Disk chunks are staged into host RAM first: those loads wait outside the batch.
    assert phase["kv_offload"].get("kv_offload_loads_same_step_total{}", 0) < len(prompts())


def test_disk_loads_in_one_batch_copied_as_their_chunks_land_equal_recompute(
        restarted_engine, reference):
    """Issue 29: the CPU backend copies a disk load's chunks into the engine as their
    reads land, interleaved with the reads of its later chunks and of the batch's other
    loads (``OffloadWorker._copy_landed``); every request's tokens are still vLLM's."""
    phase = restarted_engine["phases"][1]
    assert phase["tokens"] == reference
    assert phase["metrics"]["hits_disk"] >= PREFIX_TOKENS, "the CPU tier was dropped"


def test_other_model_never_hits(other_model, store, restarted_engine, tmp_path_factory):
    """Another model on the same store: nothing is loaded (so its tokens are recomputed
    by construction), and it keeps its own namespace."""
    phases = [{"name": "other", "prompts": prompts()}]
    out = run_in_subprocess(spec(other_model, offload(store), phases),
                            tmp_path_factory.mktemp("other"))
    assert out["phases"][0]["metrics"]["external_hits"] == 0
    assert out["phases"][0]["metrics"]["external_queries"] > 0, "it did look"
    assert len(list_namespaces(store)) == 2


def test_corrupted_slab_is_recomputed(model, store, reference, restarted_engine,
                                      tmp_path_factory):
    """Runs last in this module: it damages the shared store (tests run in file order)."""
    slabs = sorted(Path(store).glob("slabs/*/rank0-of-1.slab"))
    assert slabs, "the first engine wrote no slab"
    for slab in slabs:  # flip one byte in every 4 KiB page: every chunk is damaged
        with open(slab, "r+b") as f:
            size = os.fstat(f.fileno()).st_size
            for off in range(0, size, 4096):
                f.seek(off)
                byte = f.read(1)
                if byte:
                    f.seek(off)
                    f.write(bytes([byte[0] ^ 0xFF]))
    out = run_in_subprocess(spec(model, offload(store), [{"name": "corrupt", "prompts": prompts()}]),
                            tmp_path_factory.mktemp("corrupt"))
    phase = out["phases"][0]
    assert phase["tokens"] == reference
    assert phase["metrics"]["hits_disk"] >= PREFIX_TOKENS, "the damaged chunks were looked up"
    assert "could not be read (ReadResult.CHECKSUM_MISMATCH)" in out["log"], \
        "the load errors were reported"
