"""One vLLM engine for tests/reliability: phases of prompts, with faults injected between them.

Run in a fresh process: ``python tests/reliability/engine_script.py SPEC.json OUT.json``.
With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set by ``run_engine``) the scheduler, the
worker and both connector halves live in this process, so after every phase the output
also holds the connector's state: CPU-index counts, pinned and in-flight entries,
pending jobs, scheduler counters, disk-index stats. With multiprocessing on (a
"serving process" that a test kills), only tokens and metrics are reported.

SPEC: {"model": path, "offload": extra-config dict or null, "engine": LLM kwargs,
       "transfer_overrides": top-level --kv-transfer-config keys to change,
       "phases": [{"name", "prompts": [str | {"prompt", "cache_salt"}], "max_tokens",
                   "before": [{"op": FAULT}], "reset": "none" | "prefix" | "all",
                   "abort": {"after_steps": n, "indexes": [...]}, "verify": bool}]}
FAULT (run in this process, as root, on the store ``offload.disk_path``):
  snapshot_files  record every file of the store (path, mode, owner) in the phase output
  fill_slab_fs    fill the file system of ``<store>/slabs`` up to 1 MiB with a filler
  free_slab_fs    remove the filler
  truncate_slabs  truncate every slab file to 0 bytes
  delete_store    lazily unmount ``<store>/slabs`` if it is a mount, remove the store
OUT:  {"startup_s", "phases": [{"name", "tokens", "seconds", "metrics", "kv_offload",
                                "connector", "counters_delta", "faults"}]}
After a phase the engine is stepped until the connector has no job in flight; with
``verify`` every committed disk entry is then read back and checked (counts by result).
Prints ``phase NAME`` on stdout (flushed) as each phase starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DRAIN_TIMEOUT_S = 60.0
FILLER_KEEP_BYTES = 1 << 20
VLLM_METRICS = {
    "external_hits": "vllm:external_prefix_cache_hits",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "preemptions": "vllm:num_preemptions",
}
SOURCE_METRIC = "vllm:prompt_tokens_cached_by_source"


def metric_totals(llm: Any) -> dict[str, float]:
    """vLLM's counters of interest, by short name (hits_host/hits_disk by source)."""
    out = {k: 0.0 for k in VLLM_METRICS}
    out.update(hits_host=0.0, hits_disk=0.0)
    for m in llm.get_metrics():
        if not hasattr(m, "value"):
            continue
        for short, name in VLLM_METRICS.items():
            if m.name == name:
                out[short] += float(m.value)
        if m.name == SOURCE_METRIC and f"hits_{m.labels.get('source')}" in out:
            out[f"hits_{m.labels['source']}"] += float(m.value)
    return out


def kv_offload_samples() -> dict[str, float]:
    """Every kv_offload_* Prometheus sample of this process, as 'name{tier/direction}'."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            if not sample.name.startswith("kv_offload") or sample.name.endswith("_created"):
                continue
            label = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                             if k in ("tier", "direction"))
            key = f"{sample.name}{{{label}}}"
            out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def scheduler_connector(llm: Any) -> Any | None:
    """The scheduler-side KVOffloadConnector of an in-process engine, else None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return None if core is None else core.scheduler.connector


def connector_state(llm: Any) -> dict[str, Any] | None:
    conn = scheduler_connector(llm)
    if conn is None:
        return None
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    sched = conn._scheduler  # the connector has no public accessor; read-only use
    worker = get_kv_transfer_group()._worker
    return {
        "counters": sched.counters.snapshot(),
        "cpu": sched.cpu.counts(),
        "pending_jobs": sched.num_pending_jobs(),
        "pending_work": sched.has_pending_work(),
        "worker_pending_jobs": worker.has_pending_jobs() if worker is not None else None,
        "persistent": conn.persistent,
        "disk_enabled": sched.disk_enabled,
        "disk": sched.disk.stats() if sched.disk is not None else None,
        "namespace": conn.namespace,
        "slot_bytes": conn.layout.slot_bytes,
    }


def drain(llm: Any) -> None:
    """Step an in-process engine until the connector has no job in flight."""
    conn = scheduler_connector(llm)
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while conn is not None and conn.has_pending_push_work():
        if time.monotonic() > deadline:
            raise RuntimeError("connector jobs still pending after the workload drained")
        llm.llm_engine.step()
        time.sleep(0.005)


def verify_entries(llm: Any, store: Path) -> dict[str, Any]:
    """Read back every committed entry of this engine's namespace and check its checksum
    (without the connector: iter_entries + SlabFile.read)."""
    import numpy as np

    from kv_offload.disk import SlabFile, iter_entries

    conn = scheduler_connector(llm)
    if conn is None or not (store / "index").is_dir():
        return {}
    buf = np.empty(conn.layout.slot_bytes, np.uint8)
    results: dict[str, int] = {}
    with SlabFile(store, namespace_id=conn.namespace, rank=0, num_ranks=1,
                  slot_bytes=conn.layout.slot_bytes) as slab:
        for entry, _ in iter_entries(store, conn.namespace):
            name = slab.read(entry.slot, buf, entry.checksums[0]).name
            results[name] = results.get(name, 0) + 1
    return results


def apply_fault(op: str, store: Path) -> Any:
    """Inject ``op`` into the store of the running engine; returns what it recorded."""
    slabs_dir = store / "slabs"
    filler = slabs_dir / "filler"
    if op == "snapshot_files":
        return [{"path": str(p.relative_to(store)), "mode": oct(p.stat().st_mode & 0o7777),
                 "uid": p.stat().st_uid, "dir": p.is_dir()} for p in sorted(store.rglob("*"))]
    if op == "fill_slab_fs":
        free = os.statvfs(slabs_dir).f_bavail * os.statvfs(slabs_dir).f_frsize
        fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(free - FILLER_KEEP_BYTES, 4096))
        finally:
            os.close(fd)
        return os.statvfs(slabs_dir).f_bavail * os.statvfs(slabs_dir).f_frsize
    if op == "free_slab_fs":
        filler.unlink()
        return None
    if op == "truncate_slabs":
        slabs = sorted(slabs_dir.glob("*/*.slab"))
        for slab in slabs:
            os.truncate(slab, 0)
        return len(slabs)
    if op == "delete_store":
        if os.path.ismount(slabs_dir):
            subprocess.run(["umount", "-l", str(slabs_dir)], check=True)
        shutil.rmtree(store)
        return None
    raise ValueError(f"unknown fault {op!r}")


def run_with_abort(llm: Any, prompts: list, params: Any, name: str, abort: dict) -> list:
    """Add every prompt, step ``after_steps`` times, abort some, run the rest to the end.
    Returns the finished outputs of the requests not aborted, in prompt order."""
    engine = llm.llm_engine
    ids = [f"{name}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    for _ in range(abort["after_steps"]):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    doomed = [ids[i] for i in abort["indexes"]]
    engine.abort_request(doomed)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids if rid not in doomed]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from kv_offload import OffloadConfig
    from kv_offload.testing.workload import default_engine_kwargs

    kwargs = {**default_engine_kwargs(), **spec.get("engine", {})}
    store = None
    if spec.get("offload") is not None:
        from vllm.config import KVTransferConfig

        cfg = OffloadConfig.from_extra_config(spec["offload"])
        kwargs["kv_transfer_config"] = KVTransferConfig(
            **{**cfg.to_kv_transfer_dict(), **spec.get("transfer_overrides", {})})
        store = Path(cfg.disk_path) if cfg.disk_path else None
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "phases": []}
    last = connector_state(llm)
    for phase in spec["phases"]:
        faults = {f["op"]: apply_fault(f["op"], store) for f in phase.get("before", [])}
        reset = phase.get("reset", "none")
        if reset != "none":
            llm.reset_prefix_cache(reset_connector=reset == "all")
        print(f"phase {phase['name']}", flush=True)
        params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 8),
                                ignore_eos=True)
        before, ours_before = metric_totals(llm), kv_offload_samples()
        start = time.perf_counter()
        if "abort" in phase:
            outputs = run_with_abort(llm, phase["prompts"], params, phase["name"],
                                     phase["abort"])
        else:
            outputs = llm.generate(phase["prompts"], params, use_tqdm=False)
        drain(llm)
        seconds = time.perf_counter() - start
        after, ours_after = metric_totals(llm), kv_offload_samples()
        state = connector_state(llm)
        result["phases"].append({
            "name": phase["name"],
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "seconds": seconds,
            "metrics": {k: after[k] - before[k] for k in after},
            "kv_offload": {k: v - ours_before.get(k, 0.0) for k, v in ours_after.items()},
            "connector": state,
            "counters_delta": None if state is None else {
                k: v - last["counters"][k] for k, v in state["counters"].items()},
            "faults": faults,
            "verify": verify_entries(llm, store) if phase.get("verify") else {},
        })
        last = state
        print(f"phase {phase['name']} done in {seconds:.1f}s", flush=True)
    del llm
    return result


if __name__ == "__main__":
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    out_path.write_text(json.dumps(run(json.loads(spec_path.read_text()))))
