"""`kv-offload warm` against a real vLLM engine, and every example script once.

Four engine start-ups in all: `kv-offload warm` fills a store; examples/warm_cache.py warms
the same prompts again (the second warm: everything already present, nothing new);
examples/offline_inference.py; examples/serve.sh --tiny. The demo is not run here (two
engines, minutes); `make demo` runs it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # one engine start-up takes 40 s on an idle 2-core machine, minutes on a busy one
ENGINE = ["--block-size", "32", "--chunk-tokens", "64", "--dtype", "float32",
          "--max-model-len", "2048"]


def kv_offload_cmd() -> list[str]:
    script = Path(sys.executable).parent / "kv-offload"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kv_offload.tools.cli"]


# vLLM's engine core in the calling process: one vLLM import fewer per engine start-up.
# Not for `kv-offload warm`: it waits for its disk writes to commit, which needs the
# engine core's own loop (in-process, the engine steps only inside generate()).
IN_PROCESS_ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO,
                          timeout=TIMEOUT_S, **kwargs)
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    """Two prompts sharing a 300-token document, a chat about it, and a salted prompt."""
    doc = make_prompt(300, seed=1)
    lines = [{"prompt": doc + make_prompt(40, seed=2)}, {"prompt": doc + make_prompt(50, seed=3)},
             {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "?"}]},
             {"prompt": make_prompt(200, seed=4), "cache_salt": "tenant-a"}]
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("warm") / "store"


@pytest.fixture(scope="module")
def first_warm(model, workload, store) -> tuple[subprocess.CompletedProcess, dict]:
    proc = run([*kv_offload_cmd(), "warm", "--model", model, "--prompts", workload,
                "--disk-path", store, "--disk-size", "256MiB", "--cpu-size", "64MiB",
                "--kv-cache-memory", "512MiB", "--enforce-eager", "--json", *ENGINE])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads(proc.stdout)


@pytest.fixture(scope="module")
def second_warm(model, workload, store, first_warm) -> subprocess.CompletedProcess:
    """The same prompts and engine settings again, through the Python example."""
    proc = run([sys.executable, "examples/warm_cache.py", "--model", model, "--prompts",
                workload, "--disk-path", store, *ENGINE], env=IN_PROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_first_warm_stores_every_chunk_durably(first_warm):
    proc, summary = first_warm
    # 300+40 and 300+50 tokens share 4 chunks of 64 and have one each; the chat has 5 more,
    # the salted prompt 3: 14 unique chunks.
    assert summary["chunks"] == 14
    assert summary["new_chunks"] == 14 and summary["already_present"] == 0
    assert summary["not_stored"] == 0 and summary["pending_writes"] == 0
    assert summary["complete"] and summary["skipped_prompts"] == 0
    assert summary["bytes_written"] == 14 * summary["chunk_bytes"]
    assert "warm 4/4 prompts" in proc.stderr  # the progress line


def test_second_warm_finds_every_chunk_already_present(second_warm, first_warm):
    _, summary = first_warm
    assert f"{summary['chunks']} in the workload: 0 new, {summary['chunks']} already present, " \
           "0 not stored" in second_warm.stdout
    assert "durable    yes" in second_warm.stdout


def test_warm_through_a_relative_symlinked_model_dir_finds_the_same_namespace(
        tmp_path, model, workload, store, first_warm):
    """Regression: `--model ./link` (relative, a symlink to the model directory) names the
    same namespace as the model's real path; warm used to compare the model string with
    the stored realpath and failed to find the namespace the engine had opened."""
    _, first = first_warm
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    proc = subprocess.run(
        [str(c) for c in (*kv_offload_cmd(), "warm", "--model", "./link", "--prompts", workload,
                          "--disk-path", store, "--disk-size", "256MiB", "--cpu-size", "64MiB",
                          "--kv-cache-memory", "512MiB", "--enforce-eager", "--json", *ENGINE)],
        capture_output=True, text=True, cwd=tmp_path, timeout=TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["namespace"] == first["namespace"]
    assert summary["already_present"] == first["chunks"] and summary["new_chunks"] == 0


def test_inspect_and_verify_after_warming(second_warm, first_warm, store, model):
    _, summary = first_warm
    proc = run([*kv_offload_cmd(), "inspect", store, "--json"])
    assert proc.returncode == 0, proc.stderr
    (ns,) = json.loads(proc.stdout)["namespaces"]
    assert ns["namespace_id"] == summary["namespace"] and ns["descriptor"]["model"] == str(model)
    # the prompts' tails (their tokens past the last whole chunk) are stored besides
    assert summary["tails"] > 0 and ns["tails"] == summary["tails"]
    assert ns["chunks"] - ns["tails"] == summary["chunks"]
    assert ns["counters"]["commits"] == summary["chunks"] + summary["tails"]
    assert ns["chunk_tokens"] == 64
    proc = run([*kv_offload_cmd(), "verify", store])
    assert proc.returncode == 0 and "no bad chunks" in proc.stdout


def test_offline_inference_example_loads_on_the_second_run(tmp_path, model):
    proc = run([sys.executable, "examples/offline_inference.py", "--model", model,
                "--disk-path", tmp_path / "store"], env=IN_PROCESS_ENV)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, second = (int(n) for n in re.findall(r"(\d+) prompt tokens loaded", proc.stdout))
    assert second >= 1024  # the shared document: at least four chunks of 256 tokens
    assert "same text in both runs: yes" in proc.stdout
    # kv-offload's own counters, read offline (vLLM's get_metrics() keeps only vllm: names)
    counters = dict(re.findall(r"(\w+)=(\d+)", proc.stdout.split("kv-offload counters:")[1]))
    assert int(counters["hit_tokens_cpu"]) + int(counters["hit_tokens_disk"]) >= second
    assert int(counters["hook_errors"]) == 0 and int(counters["chunks_stored_cpu"]) >= 4


def test_serve_example_answers_one_completion_and_stops():
    proc = run(["bash", "examples/serve.sh", "--tiny"],
               env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "completion: '" in proc.stdout and "server: stopping" in proc.stdout
