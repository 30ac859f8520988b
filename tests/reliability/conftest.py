"""Session fixtures of the reliability tests (helpers: reliability_support.py, engine_phases.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import CHUNK, PROMPTS, REPO, Reference

from kv_offload.testing.engine import EngineProcess, offload_transfer
from kv_offload.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def model() -> Path:
    return make_tiny_model()


@pytest.fixture(scope="session")
def start_engine(model, tmp_path_factory):
    """Factory: spawn an in-process EngineProcess of the tiny model (start-up goes on in
    the background), its log in a fresh directory named after it; ``offload`` is the
    extra config (None: no connector), ``overrides`` top-level --kv-transfer-config keys,
    ``env`` as for EngineProcess, ``engine`` LLM kwargs. Engines still running at the end
    of the session are killed."""
    started: list[EngineProcess] = []

    def start(name: str, offload: dict | None = None, *, overrides: dict | None = None,
              env: dict | None = None, **engine) -> EngineProcess:
        transfer = None if offload is None else offload_transfer(offload, **(overrides or {}))
        proc = EngineProcess(model, log_path=tmp_path_factory.mktemp(name) / "log.txt",
                             engine=engine, transfer=transfer, in_process=True, env=env,
                             timeout_s=600)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="session")
def reference(start_engine) -> Reference:
    """Starts the no-connector reference engine in the background; tokens() waits for it."""
    texts = list(dict.fromkeys(p for group in PROMPTS.values() for p in group))
    return Reference(start_engine("reference"), texts)


@pytest.fixture(scope="session")
def unseeded_engine(start_engine, tmp_path_factory) -> tuple[EngineProcess, Path]:
    """Starts (in the background) an engine with ``--prefix-caching-hash-algo xxhash``,
    no PYTHONHASHSEED, a disk_path, and ``"kv_load_failure_policy": "fail"``; returns the
    engine and its store path (test_unseeded_hash.py)."""
    store = tmp_path_factory.mktemp("unseeded") / "store"
    offload = {"cpu_size": "32MiB", "disk_path": str(store), "disk_size": "64MiB",
               "chunk_tokens": CHUNK}
    engine = start_engine("unseeded-run", offload, env={"PYTHONHASHSEED": None},
                          overrides={"kv_load_failure_policy": "fail"},
                          prefix_caching_hash_algo="xxhash")
    return engine, store


@pytest.fixture(scope="session")
def quick_soak(tmp_path_factory):
    """Starts ``python -m kv_offload.testing.soak --quick`` in the background; yields
    (process, result JSON path, server log path). Stopped with SIGTERM (it then stops its
    server) if a test session ends before it does."""
    work = tmp_path_factory.mktemp("soak")
    result, log = work / "soak.json", work / "server.log"
    with open(work / "soak.out", "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kv_offload.testing.soak", "--quick", "--json",
             str(result), "--server-log", str(log), "--disk-path", str(work)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    yield proc, result, log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
