"""Session fixtures of the reliability tests (helpers live in reliability_support.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import (
    CHUNK,
    MAX_TOKENS,
    PROMPTS,
    REPO,
    EngineProcess,
    Reference,
    engine_spec,
)

from kv_offload.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="session")
def start_engine():
    """Factory: start an EngineProcess; every process still running at the end is killed."""
    started: list[EngineProcess] = []

    def start(spec: dict, workdir: Path, **kw) -> EngineProcess:
        proc = EngineProcess(spec, workdir, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc.poll() is None:
            proc.kill_group()


@pytest.fixture(scope="session")
def reference(model, start_engine, tmp_path_factory) -> Reference:
    """Starts the no-connector reference engine in the background; tokens() waits for it."""
    texts = list(dict.fromkeys(p for group in PROMPTS.values() for p in group))
    spec = engine_spec(model, None, [{"name": "ref", "prompts": texts,
                                      "max_tokens": MAX_TOKENS}])
    return Reference(start_engine(spec, tmp_path_factory.mktemp("reference")), texts)


@pytest.fixture(scope="session")
def unseeded_engine(model, start_engine, tmp_path_factory) -> tuple[EngineProcess, Path]:
    """Starts (in the background) an engine with ``--prefix-caching-hash-algo xxhash``,
    no PYTHONHASHSEED, a disk_path, and ``"kv_load_failure_policy": "fail"``; returns the
    process and its store path (test_unseeded_hash.py)."""
    store = tmp_path_factory.mktemp("unseeded") / "store"
    offload = {"cpu_size": "32MiB", "disk_path": str(store), "disk_size": "64MiB",
               "chunk_tokens": CHUNK}
    phases = [{"name": "cold", "prompts": PROMPTS["convoy"], "max_tokens": MAX_TOKENS},
              {"name": "cpu", "prompts": PROMPTS["convoy"], "max_tokens": MAX_TOKENS,
               "reset": "prefix"}]
    spec = engine_spec(model, offload, phases, prefix_caching_hash_algo="xxhash")
    spec["transfer_overrides"] = {"kv_load_failure_policy": "fail"}
    proc = start_engine(spec, tmp_path_factory.mktemp("unseeded-run"),
                        drop_env=("PYTHONHASHSEED",))
    return proc, store


@pytest.fixture(scope="session")
def quick_soak(tmp_path_factory):
    """Starts ``benchmarks/soak.py --quick`` in the background; yields (process, result
    JSON path, server log path). Stopped with SIGTERM (it then stops its server) if a test
    session ends before it does."""
    work = tmp_path_factory.mktemp("soak")
    result, log = work / "soak.json", work / "server.log"
    with open(work / "soak.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "benchmarks" / "soak.py"), "--quick", "--json",
             str(result), "--server-log", str(log), "--disk-path", str(work)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    yield proc, result, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
