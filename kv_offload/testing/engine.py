"""One vLLM engine in a child process, driven command by command: the harness of the engine
tests, the benchmarks and the demo.

A fresh process is what a restart looks like, a process group is what a test can kill,
and two engines alive at once can be measured side by side. The child is
``kv_offload.testing.engine_server`` (the protocol is described there); this is the parent:

    with EngineProcess(model, transfer=offload_transfer({"cpu_size": "1GiB"}),
                       log_path=tmp / "engine.log", in_process=True) as engine:
        cold = engine.generate(prompts)          # tokens, texts, timings, metric deltas
        engine.reset(connector=False)            # drop vLLM's own prefix cache
        warm = engine.generate(prompts)
        state = engine.snapshot()                # counters and the connector's state

``in_process`` runs vLLM's engine core and its worker inside the child (no engine-core or
worker process, each of which re-imports vLLM): a start-up in ~5 s instead of ~35 s on two
cores, and the connector's state becomes readable (``snapshot``, ``drain``). The default
is vLLM's usual multi-process layout, which also exercises pickling of the connector's
metadata. ``submit``/``answer`` queue commands without waiting (the child reads them
while vLLM starts), so several engines can start and work in the background.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
_OWN_TREE = str(Path(__file__).resolve().parents[2])  # the checkout this module runs from


def child_pythonpath(pythonpath: str | None) -> str:
    """PYTHONPATH of an engine process: ``pythonpath`` (e.g. another checkout to measure
    side by side) first, then the checkout of this kv_offload. The child runs with
    ``python -P``: with ``-m`` its working directory would otherwise come first on
    ``sys.path``, and started from a repository root it would import that checkout's
    kv_offload whatever PYTHONPATH says."""
    return os.pathsep.join(p for p in (pythonpath, _OWN_TREE) if p)


class EngineError(RuntimeError):
    """The engine process failed to start, to answer, or to run a command; the message
    ends with the tail of its log."""


def default_engine_kwargs() -> dict[str, Any]:
    """LLM kwargs that work on the vLLM CPU backend of a small machine."""
    return {
        "enforce_eager": True,
        # float32 keeps greedy tokens independent of batch composition; bf16 does not.
        "dtype": "float32",
        "max_model_len": 4096,
        "block_size": 32,
        "seed": 0,
        "disable_log_stats": False,
        "max_num_seqs": 16,
        # On the CPU backend the KV cache lives in host RAM: a fixed 512 MiB keeps
        # start-up independent of how much memory other processes use.
        "kv_cache_memory_bytes": 512 * 2**20,
    }


def engine_kwargs(*, in_process: bool = False, **overrides: Any) -> dict[str, Any]:
    """``default_engine_kwargs()`` with ``overrides``; ``in_process`` adds vLLM's
    single-process executor (pair it with IN_PROCESS_ENV, as EngineProcess does)."""
    extra = {"distributed_executor_backend": "uni"} if in_process else {}
    return {**default_engine_kwargs(), **extra, **overrides}


def offload_transfer(extra: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """kv-offload's ``kv_transfer_config`` dict for these extra-config options, with
    top-level keys (e.g. ``kv_load_failure_policy``) replaced by ``overrides``."""
    from kv_offload.config import OffloadConfig

    return {**OffloadConfig.from_extra_config(dict(extra)).to_kv_transfer_dict(), **overrides}


def example_transfer_config(storage_dir: str | os.PathLike) -> dict[str, Any]:
    """vLLM's ExampleConnector (safetensors files per prompt and layer): the peer that
    kv-offload's benchmarks compare with."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}


class EngineProcess:
    """One ``vllm.LLM`` in a child process of its own session; a context manager that
    waits for start-up on entry and quits on exit.

    Blocking calls, from one thread. ``engine`` overrides ``default_engine_kwargs()``;
    ``transfer`` is a raw ``kv_transfer_config`` dict or None (no connector); ``env``
    entries are added to the child's environment, or removed where the value is None.
    The child's stdout and stderr go to ``log_path``. Every wait is bounded by
    ``timeout_s``; past it the process group is killed and EngineError raised.
    """

    def __init__(self, model: str | os.PathLike, *, log_path: Path,
                 engine: Mapping[str, Any] | None = None,
                 transfer: Mapping[str, Any] | None = None, in_process: bool = False,
                 env: Mapping[str, str | None] | None = None, timeout_s: float = 900) -> None:
        """Spawn the engine process; start-up continues in the background."""
        self.log_path = Path(log_path)
        self.timeout_s = timeout_s
        self.startup_s: float | None = None
        self.engine = engine_kwargs(in_process=in_process, **(engine or {}))
        full_env = {**os.environ, **(IN_PROCESS_ENV if in_process else {})}
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = value
        full_env["PYTHONPATH"] = child_pythonpath(full_env.get("PYTHONPATH"))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in close()/kill()
        spec = {"model": str(model), "engine": self.engine,
                "transfer": dict(transfer) if transfer else None}
        # A session of its own: kill() ends vLLM's engine-core and worker children with it.
        # -P: the working directory must not shadow PYTHONPATH (see child_pythonpath).
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "kv_offload.testing.engine_server", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=full_env, start_new_session=True)
        if self.proc.stdin is None or self.proc.stdout is None:  # never: both are pipes
            raise EngineError("engine process started without its stdin/stdout pipes")
        self._commands, self._replies = self.proc.stdin, self.proc.stdout
        self._answers: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read_answers, daemon=True).start()

    def _read_answers(self) -> None:
        for line in self._replies:
            self._answers.put(line)
        self._answers.put(None)

    # -- commands ------------------------------------------------------------------------

    def wait_ready(self) -> EngineProcess:
        """Block until the engine has started (or raise EngineError); returns self."""
        if self.startup_s is None:
            self.startup_s = self._next_answer()["startup_s"]
        return self

    def submit(self, command: Mapping[str, Any]) -> None:
        """Queue ``command`` without waiting; ``answer()`` returns its answer later."""
        if self.proc.poll() is not None:
            raise EngineError(f"engine process exited ({self.proc.returncode})\n{self.log(6000)}")
        try:
            self._commands.write(json.dumps(command) + "\n")
            self._commands.flush()
        except OSError as exc:
            raise EngineError(f"engine process gone ({exc})\n{self.log(6000)}") from None

    def answer(self) -> dict[str, Any]:
        """The answer to the oldest command not yet answered (waits for start-up first)."""
        self.wait_ready()
        return self._next_answer()

    def has_answer(self) -> bool:
        """Whether an answer (or the end of the process) is waiting to be read."""
        return not self._answers.empty()

    def call(self, command: Mapping[str, Any]) -> dict[str, Any]:
        self.submit(command)
        return self.answer()

    def generate(self, prompts: list, *, max_tokens: int = 16, one_by_one: bool = False,
                 abort: Mapping[str, Any] | None = None,
                 prompt_logprobs: int | None = None) -> dict[str, Any]:
        """Greedy outputs of ``prompts`` (str or {"prompt", "cache_salt"}); see
        engine_server for the fields. ``one_by_one`` gives per-request latencies;
        ``abort`` = {"after_steps", "indexes"} aborts those requests mid-way;
        ``prompt_logprobs``: vLLM's option, and the prompt tokens' logprobs come back."""
        command: dict[str, Any] = {"op": "generate", "prompts": prompts,
                                   "max_tokens": max_tokens, "one_by_one": one_by_one}
        if abort:
            command["abort"] = dict(abort)
        if prompt_logprobs is not None:
            command["prompt_logprobs"] = prompt_logprobs
        return self.call(command)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Step the engine until the connector has no job in flight (in_process only)."""
        self.call({"op": "drain", "timeout_s": timeout_s})

    def reset(self, *, connector: bool = False) -> bool:
        """Drop vLLM's prefix cache, and with ``connector`` kv-offload's (what its
        ``connector_reset`` says: the CPU tier only with "cpu").
        Returns vLLM's answer: False when blocks were still in use (nothing reset)."""
        return self.call({"op": "reset", "connector": connector})["reset"]

    def snapshot(self) -> dict[str, Any]:
        """Totals of vLLM's counters and ours, the connector's state (None unless
        in_process) and vLLM's KV cache plan (``kv_cache``): see engine_state."""
        return self.call({"op": "snapshot"})

    def kv_events_sent(self, timeout_s: float = 60.0) -> int:
        """How many KV event batches vLLM's ZMQ publisher has sent, once none is queued
        (in_process only): a subscriber that has seen sequence number n - 1 has every
        event published before this call."""
        return self.call({"op": "kv_events_sent", "timeout_s": timeout_s})["sent"]

    # -- process ---------------------------------------------------------------------------

    def _next_answer(self) -> dict[str, Any]:
        try:
            line = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            self.kill()
            raise EngineError(f"engine gave no answer within {self.timeout_s:.0f} s\n"
                              f"{self.log(6000)}") from None
        if line is None:
            self._answers.put(None)  # every later call fails the same way
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
            raise EngineError(f"engine process died (exit {self.proc.returncode})\n"
                              f"{self.log(6000)}")
        answer = json.loads(line)
        if not answer.get("ok"):
            raise EngineError(f"engine command failed: {answer.get('error')}\n{self.log(6000)}")
        return answer

    def log(self, tail: int | None = None) -> str:
        """The child's log so far (its last ``tail`` characters)."""
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def close(self) -> None:
        """Ask the engine to quit; kill its process group if it does not within 60 s.
        Idempotent."""
        if self.proc.poll() is None:
            try:
                self.submit({"op": "quit"})
                self.proc.wait(timeout=60)
            except (EngineError, subprocess.TimeoutExpired):
                pass
        if self.proc.returncode != 0:  # died or hangs: vLLM's children may be left
            self.kill()
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole process group (engine core and workers included) and wait
        until none of its processes is left (at most 30 s). Idempotent."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._log.close()

    def __enter__(self) -> EngineProcess:
        try:
            return self.wait_ready()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start_engines(engines: list[EngineProcess]) -> list[EngineProcess]:
    """Wait until every engine (spawned together, so they start in parallel) is ready;
    on failure close them all and re-raise."""
    try:
        return [e.wait_ready() for e in engines]
    except BaseException:
        for e in engines:
            e.close()
        raise
