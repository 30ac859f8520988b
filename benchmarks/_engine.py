"""A vLLM engine in a child process that the benchmarks drive request by request.

``kv_offload.testing.workload`` runs a fixed list of phases and exits; the benchmarks
need more: any ``kv_transfer_config`` (vLLM's ExampleConnector as the peer), and two
engines alive at once so that their runs can be interleaved side by side. So each engine
lives in its own process (a fresh process is what a restart looks like) and serves JSON
commands, one per line:

    {"op": "generate", "prompts": [...], "max_tokens": 1, "one_by_one": true}
    {"op": "reset_prefix_cache"}           vLLM's own cache only, not the connector's
    {"op": "quit"}

Each answer is one JSON line: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
vLLM logs to stdout, so the child moves its stdout to stderr (the log file) before
importing anything and answers on a private copy of the original stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kv_offload.config import OffloadConfig
from kv_offload.testing.workload import generate_timed, metric_totals

# After each message, the readers of vLLM's shared-memory queues (the engine core and its
# worker) busy-spin for 1 s before they sleep (SpinCondition.busy_loop_s). An engine used
# right after another one shares the cores with those spinners: measured here, that added
# ~0.4 s to every warm TTFT when requests alternated between engines one by one.
SETTLE_S = 1.2


class Turns:
    """Hands the machine from one engine to the next: ``take(engine)`` waits SETTLE_S
    when the previous call went to another engine, so no engine is measured while an
    idle one still spins. Benchmarks therefore run blocks of requests per engine."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.settle_s = settle_s
        self.num_switches = 0
        self._last: object | None = None

    def take(self, engine: object) -> None:
        if self._last is not None and self._last is not engine:
            time.sleep(self.settle_s)
            self.num_switches += 1
        self._last = engine


class EngineError(RuntimeError):
    """The engine process failed to start or to answer; the message ends with its log."""


def ours_transfer_config(**extra: Any) -> dict[str, Any]:
    """kv-offload's ``--kv-transfer-config`` dict for these extra-config options."""
    return OffloadConfig.from_extra_config(extra).to_kv_transfer_dict()


def example_transfer_config(storage_dir: str | os.PathLike) -> dict[str, Any]:
    """vLLM's ExampleConnector (safetensors files per prompt and layer) as the peer."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}


def engine_kwargs(*, in_process: bool = False, **overrides: Any) -> dict[str, Any]:
    """LLM kwargs for the CPU backend (the test suite's defaults) with ``overrides``.

    ``in_process``: vLLM's single-process executor (no worker process); pair it with
    ``IN_PROCESS_ENV`` (no engine-core process). Starts in a fraction of the time, for
    smoke tests; not the default topology, so not for the figures.
    """
    from kv_offload.testing.workload import default_engine_kwargs

    extra = {"distributed_executor_backend": "uni"} if in_process else {}
    return {**default_engine_kwargs(), **extra, **overrides}


IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# vLLM's CPU backend reserves one more core for the scheduler process when *any* KV
# connector is configured ("for nixl_connector under p/d case"). On a 2-core machine that
# leaves no core to reserve, so an engine with a connector runs 2 unbound OpenMP threads
# while one without runs 1 thread bound to core 0. Benchmarks pin every engine to the same
# policy (one reserved core, as vLLM does without a connector) so that they compare the
# connectors, not two thread layouts.
SAME_BINDING_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def benchmark_env(*, in_process: bool, vllm_default_binding: bool) -> dict[str, str]:
    """Environment of every engine of a benchmark (see SAME_BINDING_ENV)."""
    env = {} if vllm_default_binding else dict(SAME_BINDING_ENV)
    if in_process:
        env.update(IN_PROCESS_ENV)
    return env


class EngineProcess:
    """One engine in a child process; use as a context manager (quits on exit).

    Blocking calls from one thread. ``transfer`` is a raw ``kv_transfer_config`` dict or
    None (no connector). The child's log is written to ``log_path``.
    """

    def __init__(self, *, model: str | os.PathLike, engine: dict[str, Any],
                 transfer: dict[str, Any] | None, log_path: Path,
                 env: dict[str, str] | None = None, timeout_s: float = 900) -> None:
        """Spawn the engine process; ``wait_ready()`` blocks until it has started."""
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.startup_s: float | None = None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        spec = {"model": str(model), "engine": engine, "transfer": transfer}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        # A session of its own: close() can end vLLM's engine-core children with it.
        self._proc = subprocess.Popen(
            [sys.executable, __file__, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self) -> EngineProcess:
        """Block until the engine has started (or raise EngineError); returns self."""
        if self.startup_s is None:
            self.startup_s = self._answer()["startup_s"]
        return self

    def generate(self, prompts: list[str], *, max_tokens: int = 1,
                 one_by_one: bool = True) -> dict[str, Any]:
        """Run ``prompts``; returns latency_s (per request when one_by_one), seconds,
        num_output_tokens, tokens and the metric deltas of this call."""
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "one_by_one": one_by_one})

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's own prefix cache (the connector keeps its tiers)."""
        self.call({"op": "reset_prefix_cache"})

    def call(self, command: dict[str, Any]) -> dict[str, Any]:
        if self._proc.poll() is not None:
            raise EngineError(f"engine process exited ({self._proc.returncode})\n{self.log()}")
        self._proc.stdin.write(json.dumps(command) + "\n")
        self._proc.stdin.flush()
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
        if not ready:
            self._kill()
            raise EngineError(f"engine gave no answer within {self.timeout_s:.0f} s\n{self.log()}")
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait(timeout=30)
            raise EngineError(f"engine process died (exit {self._proc.returncode})\n{self.log()}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise EngineError(f"engine command failed: {answer.get('error')}\n{self.log()}")
        return answer

    def log(self, tail: int = 6000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def close(self) -> None:
        """Ask the engine to quit; kill its process group if it does not within 60 s.
        Idempotent."""
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self._proc.stdin.flush()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._kill()
        if self._proc.returncode:  # died: vLLM's engine core may be left in its group
            self._kill()
        if not self._log.closed:
            self._log.close()

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()

    def __enter__(self) -> EngineProcess:
        return self.wait_ready()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def start_engines(engines: list[EngineProcess]) -> list[EngineProcess]:
    """Wait until every engine (spawned together, so they start in parallel) is ready;
    on failure close them all and re-raise."""
    try:
        return [e.wait_ready() for e in engines]
    except BaseException:
        for e in engines:
            e.close()
        raise


# -- child side -------------------------------------------------------------------------


def _generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=command.get("max_tokens", 1),
                            ignore_eos=True)
    prompts = command["prompts"]
    before = metric_totals(llm)
    start = time.perf_counter()
    outputs, latencies = generate_timed(llm, prompts, params,
                                        one_by_one=command.get("one_by_one", True))
    seconds = time.perf_counter() - start
    after = metric_totals(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    ttft = [o.metrics.first_token_latency for o in outputs
            if getattr(o, "metrics", None) is not None]
    return {"latency_s": latencies, "ttft_s": ttft, "seconds": seconds, "tokens": tokens,
            "num_output_tokens": sum(map(len, tokens)),
            "num_prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
            "metrics": {k: after[k] - before[k] for k in after}}


def _serve(spec: dict[str, Any], reply: Any) -> None:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    kwargs = dict(spec["engine"])
    if spec.get("transfer"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["transfer"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    send({"ok": True, "startup_s": time.perf_counter() - t0})
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        try:
            if op == "quit":
                break
            if op == "generate":
                send({"ok": True, **_generate(llm, command)})
            elif op == "reset_prefix_cache":
                send({"ok": bool(llm.reset_prefix_cache())})
            else:
                send({"ok": False, "error": f"unknown op {op!r}"})
        except Exception as exc:  # report, keep serving: the parent decides
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    del llm


def main() -> None:
    # vLLM (and its engine-core child) log to stdout: keep the protocol on a private fd.
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _serve(json.loads(sys.argv[1]), reply)


if __name__ == "__main__":
    main()
