"""Invariant 7: kill -9 at any instant; the store reopens and serves only intact chunks.

A writer subprocess loops allocate -> write both rank slabs -> commit (plus lookups,
verified reads and drops, with evictions since the namespace is small). The test
SIGKILLs it at random moments, sometimes before it finished opening, many times. After
each kill it reopens the store and checks that every visible key's bytes verify, in
checksum and content, on both ranks, and that no slot leaked (dead reservations are
reclaimed). Run as a script, this file is the writer.
"""

from __future__ import annotations

import hashlib
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from kv_offload.disk import DiskIndex, SlabFile, iter_entries
from kv_offload.disk import env as env_module

NS = "c4a54"
SLOT = 64 * 1024
NUM_RANKS = 2
NUM_SLOTS = 48
NUM_KILLS = 20
REPO = Path(__file__).resolve().parents[2]


def expected_bytes(key: bytes, rank: int) -> np.ndarray:
    """Deterministic chunk content of ``key`` on ``rank``."""
    block = hashlib.blake2b(key + bytes([rank]), digest_size=64).digest()
    return np.frombuffer(block * (SLOT // 64), np.uint8)


def open_store(root) -> tuple[DiskIndex, list[SlabFile]]:
    index = DiskIndex.open(root, namespace_id=NS, descriptor={"test": "crash"}, slot_bytes=SLOT,
                           num_ranks=NUM_RANKS, capacity_bytes=NUM_SLOTS * SLOT * NUM_RANKS)
    slabs = [SlabFile(root, namespace_id=NS, rank=r, num_ranks=NUM_RANKS, slot_bytes=SLOT)
             for r in range(NUM_RANKS)]
    return index, slabs


def writer(root: str, seed: int) -> None:
    """Store chunks forever (until killed), like a scheduler plus its workers would."""
    rng = random.Random(seed)
    index, slabs = open_store(root)
    print("ready", flush=True)
    buf = np.empty(SLOT, np.uint8)
    for i in range(10**9):
        count = rng.randint(1, 4)
        keys = [hashlib.sha256(f"{seed}-{i}-{j}".encode()).digest() for j in range(count)]
        slots = index.allocate(keys)
        items = []
        for key, slot in zip(keys, slots):
            if slot is not None:
                sums = [slab.write(slot, expected_bytes(key, r)) for r, slab in enumerate(slabs)]
                items.append((key, slot, tuple(sums)))
        index.commit(items)
        for entry in index.find_prefix([keys[0]]):
            index.pin([entry.slot])
            if not slabs[1].read(entry.slot, buf, entry.checksums[1]):
                index.drop(entry.key, entry.slot)
            index.unpin([entry.slot])
        if i % 7 == 0:
            index.flush_access()


def reserve_all_and_die(root: str) -> None:
    """Reserve every slot, never commit, and die by SIGKILL (no close, no cleanup)."""
    index, _ = open_store(root)
    slots = index.allocate([hashlib.sha256(b"doomed-%d" % i).digest() for i in range(NUM_SLOTS)])
    print(sum(s is not None for s in slots), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_in_a_lookup(root: str) -> None:
    """Die by SIGKILL inside a read transaction, as a process killed during a lookup."""
    index, _ = open_store(root)
    with index._env.read():
        os.kill(os.getpid(), signal.SIGKILL)


def verify_store(root) -> int:
    """Reopen (reclaiming the dead writer's reservations) and check every visible chunk."""
    index, slabs = open_store(root)
    try:
        assert index.check() == [], index.check()
        stats = index.stats()
        assert stats["reserved"] == 0, "reservations of a dead writer were not reclaimed"
        assert stats["num_entries"] + stats["free_listed"] + stats["never_used"] == NUM_SLOTS
        buf = np.empty(SLOT, np.uint8)
        entries = [entry for entry, _ in iter_entries(root, NS)]
        for entry in entries:
            for rank, slab in enumerate(slabs):
                assert slab.read(entry.slot, buf, entry.checksums[rank]), (entry, rank)
                assert np.array_equal(buf, expected_bytes(entry.key, rank))
        return len(entries)
    finally:
        index.close()
        for slab in slabs:
            slab.close()


def read_line(proc: subprocess.Popen, timeout: float = 60.0):
    """One line of the child's stdout; fails the test instead of hanging forever."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"child {proc.pid} said nothing for {timeout} s"
    return proc.stdout.readline()


def test_store_survives_random_sigkills(tmp_path):
    rng = random.Random(1234)
    env = _child_env()
    seen_entries = []
    for n in range(NUM_KILLS):
        child = subprocess.Popen([sys.executable, __file__, str(tmp_path), str(n)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            if rng.random() < 0.8:  # usually mid-loop; otherwise possibly inside open()
                assert read_line(child) == b"ready\n", child.stderr.read().decode()
            time.sleep(rng.uniform(0.0, 0.25))
            assert child.poll() is None, child.stderr.read().decode()[-3000:]
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
            child.stderr.close()
        seen_entries.append(verify_store(tmp_path))
    assert max(seen_entries) > NUM_SLOTS // 2, seen_entries  # the writer really wrote


def test_full_store_reclaims_a_dead_writers_slots_while_running(tmp_path):
    """A process that dies holding every reservation does not starve a running one."""
    index, slabs = open_store(tmp_path)
    try:
        out = subprocess.run([sys.executable, __file__, str(tmp_path), "reserve-and-die"],
                             env=_child_env(), capture_output=True, timeout=60)
        assert out.returncode == -signal.SIGKILL and out.stdout == b"%d\n" % NUM_SLOTS
        assert index.stats()["reserved"] == NUM_SLOTS
        slots = index.allocate([b"survivor-%d" % i for i in range(3)])
        assert None not in slots and index.stats()["reserved"] == 3
        assert index.stats()["counters"]["reclaimed"] == NUM_SLOTS
    finally:
        index.close()
        for slab in slabs:
            slab.close()


def test_a_process_killed_in_a_lookup_does_not_make_the_index_grow(tmp_path, monkeypatch):
    """Its LMDB reader slot pinned the snapshot of that lookup for as long as any other
    process kept the store open: no page freed after it was reused, and the index file
    grew with every write (~36 KiB per store) until the disk was full. Writes now free
    reader slots of dead processes (every READER_CHECK_EVERY_S; 0 here)."""
    monkeypatch.setattr(env_module, "READER_CHECK_EVERY_S", 0.0)
    index, slabs = open_store(tmp_path)
    try:
        def churn(n: int) -> None:  # a full namespace: every allocation evicts
            for i in range(n):
                keys = [hashlib.sha256(b"churn-%d-%d" % (n, i)).digest()]
                (slot,) = index.allocate(keys)
                if slot is not None:
                    index.commit([(keys[0], slot, (1, 1))])

        churn(2 * NUM_SLOTS)
        out = subprocess.run([sys.executable, __file__, str(tmp_path), "die-in-a-lookup"],
                             env=_child_env(), capture_output=True, timeout=60)
        assert out.returncode == -signal.SIGKILL, out.stderr.decode()[-2000:]
        before = index._env.env.info()["last_pgno"]
        churn(1500)
        grown = index._env.env.info()["last_pgno"] - before
        assert grown < 50, f"the index grew by {grown} pages behind a dead reader"
    finally:
        index.close()
        for slab in slabs:
            slab.close()


def _child_env() -> dict:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


if __name__ == "__main__":
    if sys.argv[2] == "reserve-and-die":
        reserve_all_and_die(sys.argv[1])
    elif sys.argv[2] == "die-in-a-lookup":
        die_in_a_lookup(sys.argv[1])
    else:
        writer(sys.argv[1], int(sys.argv[2]))
