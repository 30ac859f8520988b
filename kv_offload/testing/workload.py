"""Runs a vLLM engine over phases of prompts and reports tokens, timings and metrics.

Used by the end-to-end tests, the demo and the TTFT benchmark, always in a fresh
process (``python -m kv_offload.testing.workload SPEC.json OUT.json``), because a new
process is what a restart looks like and vLLM engines do not share a process well.

SPEC: {"model": path, "offload": extra-config dict or null, "engine": LLM kwargs,
       "in_process": bool,
       "phases": [{"name", "prompts", "max_tokens", "reset_prefix_cache",
                   "reset_connector", "one_by_one", "command_before": argv,
                   "command_during": {"argv", "after_s"}, "sleep_before_s"}]}
``reset_connector`` also drops kv-offload's CPU tier; the commands let a test kill or
restart a server before or while a phase runs. ``in_process`` runs vLLM's engine core and
its worker inside this one process (no engine-core or worker process, each of which
re-imports vLLM: a start-up in ~5 s instead of ~35 s here); the default is vLLM's usual
multi-process layout, which also exercises pickling of the connector's metadata.
OUT:  {"phases": [{"name", "tokens", "texts", "seconds", "latency_s", "metrics"}],
       "startup_s"}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

METRICS = {
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "external_hits": "vllm:external_prefix_cache_hits",
    "external_queries": "vllm:external_prefix_cache_queries",
}
SOURCE_METRIC = "vllm:prompt_tokens_cached_by_source"


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


def metric_totals(llm: Any) -> dict[str, float]:
    """vLLM's prefix-cache counters (totals since start, summed over engines)."""
    out = {k: 0.0 for k in METRICS}
    out.update({"hits_host": 0.0, "hits_disk": 0.0, "hits_device": 0.0,
                "hits_external_unspecified": 0.0})
    for metric in llm.get_metrics():
        for short, name in METRICS.items():
            if metric.name == name and hasattr(metric, "value"):
                out[short] += float(metric.value)
        if metric.name == SOURCE_METRIC and hasattr(metric, "value"):
            source = metric.labels.get("source", "")
            if f"hits_{source}" in out:
                out[f"hits_{source}"] += float(metric.value)
    return out


def generate_timed(llm: Any, prompts: list, params: Any, *, one_by_one: bool
                   ) -> tuple[list, list[float]]:
    """Generate ``prompts``; one at a time gives per-request latency (TTFT when
    ``max_tokens`` is 1), else one batch and no latencies."""
    if not one_by_one:
        return llm.generate(prompts, params, use_tqdm=False), []
    outputs, latencies = [], []
    for prompt in prompts:
        start = time.perf_counter()
        outputs.extend(llm.generate([prompt], params, use_tqdm=False))
        latencies.append(time.perf_counter() - start)
    return outputs, latencies


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``spec`` in this process (it must be a fresh one)."""
    from vllm import LLM, SamplingParams

    from kv_offload import OffloadConfig

    kwargs = {**default_engine_kwargs(), **spec.get("engine", {})}
    if spec.get("in_process"):
        kwargs.setdefault("distributed_executor_backend", "uni")
    if spec.get("offload") is not None:
        kwargs["kv_transfer_config"] = OffloadConfig.from_extra_config(
            spec["offload"]).to_kv_transfer_config()
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "phases": []}
    for phase in spec["phases"]:
        if phase.get("command_before"):
            subprocess.run(phase["command_before"], check=True, timeout=60)
        time.sleep(phase.get("sleep_before_s", 0))
        if phase.get("reset_prefix_cache") or phase.get("reset_connector"):
            llm.reset_prefix_cache(reset_connector=bool(phase.get("reset_connector")))
        during = phase.get("command_during")
        if during:
            timer = threading.Timer(during["after_s"], subprocess.run, [during["argv"]])
            timer.start()
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 16),
                                ignore_eos=True)
        before = metric_totals(llm)
        prompts = phase["prompts"]
        start = time.perf_counter()
        outputs, latencies = generate_timed(llm, prompts, params,
                                            one_by_one=bool(phase.get("one_by_one")))
        seconds = time.perf_counter() - start
        if during:
            timer.join()
        after = metric_totals(llm)
        result["phases"].append({
            "name": phase.get("name", ""),
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "texts": [o.outputs[0].text for o in outputs],
            "seconds": seconds,
            "latency_s": latencies,
            "metrics": {k: after[k] - before[k] for k in after},
        })
    del llm
    return result


def run_in_subprocess(spec: dict[str, Any], workdir: Path, *, env: dict[str, str] | None = None,
                      timeout_s: float = 600) -> dict[str, Any]:
    """Run ``spec`` in a new Python process; raises RuntimeError with its log on failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = workdir / "spec.json", workdir / "out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    full_env = {**os.environ, **(env or {})}
    if spec.get("in_process"):
        full_env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "kv_offload.testing.workload", str(spec_path), str(out_path)],
        env=full_env, capture_output=True, text=True, timeout=timeout_s)
    (workdir / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out_path.exists():
        raise RuntimeError(f"engine run failed (exit {proc.returncode}):\n"
                           f"{(proc.stdout + proc.stderr)[-6000:]}")
    result = json.loads(out_path.read_text())
    result["log"] = proc.stdout + proc.stderr
    return result


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    Path(args[1]).write_text(json.dumps(run_spec(spec)))


if __name__ == "__main__":
    main()
