"""Two processes share one store and one namespace, as two vLLM instances on a host would.

Phase 1: each process stores its own chunks, then (after a barrier) finds and verifies
the other's. Phase 2: both race to store the same keys under eviction pressure while
reading what they find. Asserts: each sees the other's commits; both win some keys;
no slot is held by two keys; every read that passes its checksum has the right bytes (a
read racing an eviction by the other process may fail, never lie). Run as a script, this
file is one of the processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import subprocess
import sys
from pathlib import Path

import numpy as np

from kv_offload.disk import DiskIndex, SlabFile, iter_entries

NS = "5a4ed"
SLOT = 32 * 1024
NUM_SLOTS = 64
REPO = Path(__file__).resolve().parents[2]


def chunk_key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def chunk_bytes(key: bytes) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(key, digest_size=64).digest() * (SLOT // 64), np.uint8)


def open_store(root) -> tuple[DiskIndex, SlabFile]:
    index = DiskIndex.open(root, namespace_id=NS, descriptor={"test": "sharing"},
                           slot_bytes=SLOT, num_ranks=1, capacity_bytes=NUM_SLOTS * SLOT)
    return index, SlabFile(root, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT)


def store_keys(index: DiskIndex, slab: SlabFile, keys: list[bytes]) -> list[bytes]:
    """Allocate, write and commit ``keys``; return those this process stored."""
    slots = index.allocate(keys)
    items = [(k, s, (slab.write(s, chunk_bytes(k)),)) for k, s in zip(keys, slots) if s is not None]
    done = index.commit(items)
    return [k for (k, _, _), ok in zip(items, done) if ok]


def read_all(index: DiskIndex, slab: SlabFile, keys: list[bytes]) -> tuple[int, int]:
    """(verified, failed) reads of the keys found; a verified read must hold right bytes."""
    buf, verified, failed = np.empty(SLOT, np.uint8), 0, 0
    for key in keys:
        for entry in index.find_prefix([key]):
            index.pin([entry.slot])
            if slab.read(entry.slot, buf, entry.checksums[0]):
                if not np.array_equal(buf, chunk_bytes(key)):
                    raise AssertionError("a verified read returned wrong bytes")
                verified += 1
            else:
                failed += 1
                index.drop(entry.key, entry.slot)
            index.unpin([entry.slot])
    return verified, failed


def participant(root: str, name: str, other: str) -> None:
    """One process: phase 1, barrier on stdin, phase 2; report JSON on stdout."""
    index, slab = open_store(root)
    own = [chunk_key(f"{name}-{i}") for i in range(20)]
    stored = store_keys(index, slab, own)
    print(json.dumps({"phase1_stored": len(stored)}), flush=True)
    sys.stdin.readline()  # barrier: the other process has committed its chunks too
    seen, failed = read_all(index, slab, [chunk_key(f"{other}-{i}") for i in range(20)])
    print(json.dumps({"seen_other": seen, "failed_other": failed}), flush=True)
    sys.stdin.readline()  # barrier: both have read, phase 2 may evict phase 1's chunks
    rng = random.Random(name)
    shared = [chunk_key(f"shared-{i}") for i in range(150)]
    won: list[str] = []
    verified_shared, failed_shared = 0, 0
    for _ in range(60):
        batch = rng.sample(shared, 4)
        won += [k.hex() for k in store_keys(index, slab, batch)]
        v, f = read_all(index, slab, rng.sample(shared, 4))
        verified_shared, failed_shared = verified_shared + v, failed_shared + f
    index.close()
    slab.close()
    print(json.dumps({"won": won, "verified_shared": verified_shared,
                      "failed_shared": failed_shared}), flush=True)


def read_line(proc: subprocess.Popen, timeout: float = 60.0):
    """One line of the child's stdout; fails the test instead of hanging forever."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"child {proc.pid} said nothing for {timeout} s"
    return proc.stdout.readline()


def release(procs: dict) -> None:
    """Let every participant pass its current barrier."""
    for proc in procs.values():
        proc.stdin.write("go\n")
        proc.stdin.flush()


def test_two_processes_share_one_store(tmp_path):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = {
        name: subprocess.Popen([sys.executable, __file__, str(tmp_path), name, other], env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for name, other in (("a", "b"), ("b", "a"))
    }
    try:
        for proc in procs.values():
            assert json.loads(read_line(proc)) == {"phase1_stored": 20}
        release(procs)
        for proc in procs.values():
            assert json.loads(read_line(proc)) == {"seen_other": 20, "failed_other": 0}
        release(procs)
        reports = {name: json.loads(read_line(proc)) for name, proc in procs.items()}
        for proc in procs.values():
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs.values():
            proc.kill() if proc.poll() is None else None
    for report in reports.values():
        assert report["verified_shared"] > 0
    assert reports["a"]["won"] and reports["b"]["won"]
    index, slab = open_store(tmp_path)
    try:
        assert index.check() == []
        assert index.stats()["reserved"] == 0
        entries = [entry for entry, _ in iter_entries(tmp_path, NS)]
        assert len({e.slot for e in entries}) == len(entries) > NUM_SLOTS // 2
        buf = np.empty(SLOT, np.uint8)
        for entry in entries:
            assert slab.read(entry.slot, buf, entry.checksums[0])
            assert np.array_equal(buf, chunk_bytes(entry.key))
    finally:
        index.close()
        slab.close()


if __name__ == "__main__":
    participant(*sys.argv[1:4])
