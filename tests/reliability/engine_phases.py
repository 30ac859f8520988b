"""Phases of prompts against one in-process ``EngineProcess``, with faults injected into its
store between them (tests/reliability).

A phase: {"name", "prompts": [str | {"prompt", "cache_salt"}], "max_tokens",
          "before": [FAULT], "reset": "none" | "prefix" | "all",
          "abort": {"after_steps": n, "indexes": [...]}, "verify": bool}
FAULT (applied by this process, on the store ``offload.disk_path``, before the reset):
  snapshot_files  record every file of the store (path, mode, owner) in the phase output
  fill_slab_fs    fill the file system of ``<store>/slabs`` up to 1 MiB with a filler
  free_slab_fs    remove the filler
  truncate_slabs  truncate every slab file to 0 bytes
  delete_store    lazily unmount ``<store>/slabs`` if it is a mount, remove the store
After the requests the engine is stepped until the connector has no job in flight; the
phase's output then holds: tokens, seconds, metrics and kv_offload (counter deltas over
the phase, drain included), connector (its state), counters_delta, faults, and with
``verify`` the count of committed disk entries of its namespace by read result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kv_offload.testing.engine import EngineProcess

FILLER_KEEP_BYTES = 1 << 20


def snapshot_files(store: Path) -> list[dict]:
    return [{"path": str(p.relative_to(store)), "mode": oct(p.stat().st_mode & 0o7777),
             "uid": p.stat().st_uid, "dir": p.is_dir()} for p in sorted(store.rglob("*"))]


def fill_slab_fs(store: Path) -> int:
    """Fill the slab file system; returns the bytes left free."""
    slabs_dir = store / "slabs"
    stat = os.statvfs(slabs_dir)
    fd = os.open(slabs_dir / "filler", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(stat.f_bavail * stat.f_frsize - FILLER_KEEP_BYTES, 4096))
    finally:
        os.close(fd)
    stat = os.statvfs(slabs_dir)
    return stat.f_bavail * stat.f_frsize


def free_slab_fs(store: Path) -> None:
    (store / "slabs" / "filler").unlink()


def truncate_slabs(store: Path) -> int:
    slabs = sorted(store.glob("slabs/*/*.slab"))
    for slab in slabs:
        os.truncate(slab, 0)
    return len(slabs)


def delete_store(store: Path) -> None:
    slabs_dir = store / "slabs"
    if os.path.ismount(slabs_dir):
        subprocess.run(["umount", "-l", str(slabs_dir)], check=True)
    shutil.rmtree(store)


FAULTS: dict[str, Callable[[Path], Any]] = {
    f.__name__: f for f in (snapshot_files, fill_slab_fs, free_slab_fs, truncate_slabs,
                            delete_store)}


def verify_store(store: Path, namespace: str, slot_bytes: int) -> dict[str, int]:
    """Read back every committed entry of ``namespace`` with kv-offload's disk API alone
    (iter_entries + SlabFile.read); counts by read result ({} without an index)."""
    import numpy as np

    from kv_offload.disk import SlabFile, iter_entries

    if not (store / "index").is_dir():
        return {}
    buf = np.empty(slot_bytes, np.uint8)
    results: dict[str, int] = {}
    with SlabFile(store, namespace_id=namespace, rank=0, num_ranks=1,
                  slot_bytes=slot_bytes) as slab:
        for entry, _ in iter_entries(store, namespace):
            name = slab.read(entry.slot, buf, entry.checksums[0]).name
            results[name] = results.get(name, 0) + 1
    return results


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def run_phase(engine: EngineProcess, phase: dict[str, Any], last: dict[str, Any],
              store: Path | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``phase``; ``last`` is the snapshot taken after the previous one. Returns the
    phase's output and the snapshot after it."""
    faults = {op: FAULTS[op](store) for op in phase.get("before", [])}
    reset = phase.get("reset", "none")
    if reset != "none" and not engine.reset(connector=reset == "all"):
        raise AssertionError(f"phase {phase['name']}: vLLM refused reset_prefix_cache "
                             "(blocks still in use after the drain)")
    out = engine.generate(phase["prompts"], max_tokens=phase.get("max_tokens", 8),
                          abort=phase.get("abort"))
    engine.drain()
    snap = engine.snapshot()
    state, before = snap["connector"], last["connector"]
    return {
        "name": phase["name"], "tokens": out["tokens"], "seconds": out["seconds"],
        "metrics": _delta(snap["metrics"], last["metrics"]),
        "kv_offload": _delta(snap["kv_offload"], last["kv_offload"]),
        "connector": state,
        "counters_delta": None if state is None or before is None
        else _delta(state["counters"], before["counters"]),
        "faults": faults,
        "verify": verify_store(store, state["namespace"], state["slot_bytes"])
        if phase.get("verify") else {},
    }, snap


def run_phases(engine: EngineProcess, phases: list[dict[str, Any]], *,
               store: Path | None = None) -> dict[str, Any]:
    """Run every phase, quit the engine; returns {"startup_s", "phases", "by_name", "log"}."""
    last = engine.wait_ready().snapshot()
    outputs = []
    try:
        for phase in phases:
            output, last = run_phase(engine, phase, last, store)
            outputs.append(output)
    finally:
        engine.close()
    return {"startup_s": engine.startup_s, "phases": outputs,
            "by_name": {p["name"]: p for p in outputs}, "log": engine.log()}
