"""vLLM's OpenAI server on a loopback port, for the serving test and the soak benchmark.

The CPU wheel's ``vllm`` console script is broken (docs: ENVIRONMENT), so the server runs
as ``python -m vllm.entrypoints.openai.api_server``, in a session of its own so that
``stop()`` ends its engine-core process too. ``metric_samples`` reads its ``/metrics``
text with ``prometheus_client.parser`` (installed with vLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from kv_offload.testing.engine import EngineError
from kv_offload.testing.redis_server import free_port


class Sample(NamedTuple):
    name: str  # as exposed, e.g. "kv_offload_hit_tokens_total"
    labels: dict[str, str]
    value: float


def metric_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text page, ``*_created`` timestamps left out."""
    from prometheus_client.parser import text_string_to_metric_families

    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")]


def metric_sum(samples: Sequence[Sample], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def http(url: str, payload: Mapping[str, Any] | None = None, timeout: float = 30) -> str:
    """GET ``url``, or POST ``payload`` as JSON; returns the body."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if payload is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


class OpenAIServer:
    """The server for ``model`` with extra command-line ``args``; a context manager that
    waits until it is healthy on entry and stops it on exit. Its log goes to ``log_path``."""

    def __init__(self, model: str | os.PathLike, args: Sequence[str], *, log_path: Path,
                 port: int = 0, env: Mapping[str, str] | None = None) -> None:
        """Spawn the server; ``wait_healthy()`` blocks until it answers."""
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(model), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.startup_s: float | None = None
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_healthy(self, timeout_s: float = 600) -> OpenAIServer:
        """Block until /health answers; EngineError (with the log's tail) if the server
        exits or stays unhealthy for ``timeout_s``. Returns self."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(OSError):
                http(self.base + "/health", timeout=5)
                self.startup_s = time.monotonic() - self._started
                return self
            time.sleep(1)
        raise EngineError(f"server not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def get(self, path: str, timeout: float = 30) -> str:
        return http(self.base + path, timeout=timeout)

    def post(self, path: str, payload: Mapping[str, Any], timeout: float = 120) -> str:
        return http(self.base + path, payload, timeout=timeout)

    def metrics(self) -> list[Sample]:
        return metric_samples(self.get("/metrics"))

    def tail(self, n: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def processes(self) -> list[Any]:
        """psutil processes of the server and its children ([] once it is gone)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 60 s. Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self) -> OpenAIServer:
        try:
            return self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()
