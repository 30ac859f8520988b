"""A whole engine life written as data: start, run phases of prompts, quit.

For scripts that describe a run up front (the e2e tests, the demo, bench_remote); each
phase becomes commands of one ``EngineProcess`` (kv_offload.testing.engine).

SPEC: {"model": path, "offload": extra-config dict or null, "engine": LLM kwargs,
       "in_process": bool,
       "phases": [{"name", "prompts", "max_tokens", "one_by_one", "prompt_logprobs",
                   "reset_prefix_cache", "reset_connector", "command_before": argv,
                   "sleep_before_s", "command_during": {"argv", "after_s"}}]}
``reset_connector`` also resets kv-offload (its CPU tier only with ``connector_reset:
"cpu"``); the commands (run here, in the parent) let a test kill or restart a server before or while a phase runs.
OUT:  {"startup_s", "phases": [{"name", "tokens", "texts", "seconds", "latency_s",
                                "metrics", ...}], "log"}: a phase holds the fields of
``EngineProcess.generate`` plus its name.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kv_offload.testing.engine import EngineProcess, offload_transfer


def run_phase(engine: EngineProcess, phase: Mapping[str, Any]) -> dict[str, Any]:
    """Run one phase of the SPEC format on ``engine``; returns its output."""
    if phase.get("command_before"):
        subprocess.run(phase["command_before"], check=True, timeout=60)
    time.sleep(phase.get("sleep_before_s", 0))
    if phase.get("reset_prefix_cache") or phase.get("reset_connector"):
        engine.reset(connector=bool(phase.get("reset_connector")))
    during = phase.get("command_during")
    timer = None
    if during:
        timer = threading.Timer(during["after_s"], subprocess.run, [during["argv"]])
        timer.start()
    try:
        out = engine.generate(phase["prompts"], max_tokens=phase.get("max_tokens", 16),
                              one_by_one=bool(phase.get("one_by_one")),
                              prompt_logprobs=phase.get("prompt_logprobs"))
    finally:
        if timer is not None:
            timer.join()
    return {"name": phase.get("name", ""), **out}


def run_in_subprocess(spec: Mapping[str, Any], workdir: Path, *,
                      env: Mapping[str, str | None] | None = None,
                      timeout_s: float = 600) -> dict[str, Any]:
    """Run ``spec`` in a new engine process (log in ``workdir/log.txt``); raises
    EngineError (a RuntimeError) with the log's tail on failure. ``timeout_s`` bounds
    the start-up and each phase."""
    offload = spec.get("offload")
    engine = EngineProcess(
        spec["model"], log_path=Path(workdir) / "log.txt", engine=spec.get("engine"),
        transfer=None if offload is None else offload_transfer(offload),
        in_process=bool(spec.get("in_process")), env=env, timeout_s=timeout_s)
    with engine:
        phases = [run_phase(engine, phase) for phase in spec["phases"]]
    return {"startup_s": engine.startup_s, "phases": phases, "log": engine.log()}
