"""Administration of disk stores: list namespaces and entries, verify, repair, clear, and
find the processes using a store. What `kv-offload inspect/verify/clear` and `warm` do to
a store, without the printing (cli.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import psutil

from kv_offload.disk.env import clear_hint, existing_env, is_open_here
from kv_offload.disk.errors import StoreCorruptError, StoreError, StorePathError
from kv_offload.disk.index import DiskIndex
from kv_offload.disk.namespace import COMMITTED, NamespaceTxn
from kv_offload.disk.records import (
    PERSISTENT_COUNTERS,
    DiskEntry,
    EntryRecord,
    LruKey,
    NamespaceRecord,
    namespace_prefix,
)
from kv_offload.disk.slab import ReadResult, SlabFile, slab_dir, slab_path, validate_namespace_id

_SCAN_BATCH = 1024  # entries per short read transaction
_CLEAR_BATCH = 10_000  # records deleted per write transaction


def list_namespaces(root: str | os.PathLike) -> list[dict]:
    """Every namespace of the store: its record, counters, and oldest/newest access in
    seconds since the epoch (None when empty). Read-only; [] when there is no store."""
    out = []
    with existing_env(root) as env:
        if env is None:
            return []
        with env.read() as txn:
            for ns, raw in txn.cursor(db=env.dbs["namespaces"]):
                op, info = NamespaceTxn(txn, env.dbs, ns.decode()), NamespaceRecord.unpack(raw)
                names = ("entries", "reserved", "free", *PERSISTENT_COUNTERS)
                info["counters"] = {name: op.counter(name) for name in names}
                cursor = txn.cursor(db=env.dbs["lru"])  # "/" + 1 == "0": past the prefix
                ok = cursor.prev() if cursor.set_range(op.p[:-1] + b"0") else cursor.last()
                newest, oldest = cursor.key() if ok else b"", next(op.scan("lru"), None)
                info["oldest_access"] = LruKey.tick(oldest[0]) / 1e6 if oldest else None
                info["newest_access"] = (LruKey.tick(newest, len(op.p)) / 1e6
                                         if newest.startswith(op.p) else None)
                out.append(info)
    return out


def iter_entries(root: str | os.PathLike, namespace_id: str) -> Iterator[tuple[DiskEntry, float]]:
    """Yield (entry, last access in seconds since the epoch) for every committed entry in
    key order, reading 1024 entries per short read transaction."""
    validate_namespace_id(namespace_id)
    with existing_env(root) as env:
        start = b""
        while env is not None:
            with env.read() as txn:
                scan = NamespaceTxn(txn, env.dbs, namespace_id).scan("entries", start)
                batch = list(itertools.islice(scan, _SCAN_BATCH + 1))
            for key, value in batch[:_SCAN_BATCH]:
                state, slot, tick = EntryRecord.head(value)
                if state == COMMITTED:
                    yield DiskEntry(key, slot, EntryRecord.checksums(value)), tick / 1e6
            if len(batch) <= _SCAN_BATCH:
                return
            start = batch[_SCAN_BATCH][0]


def require_store(root: Path) -> None:
    """StorePathError naming the problem unless ``root`` is a store with an index."""
    if not root.exists():
        raise StorePathError(f"no disk store at {root}: the path does not exist")
    if not root.is_dir():
        raise StorePathError(f"{root} is a file, not a disk store directory")
    if not (root / "index" / "data.mdb").is_file():
        raise StorePathError(f"{root} is not a kv-offload disk store (no index/data.mdb); "
                             "pass the directory given as disk_path")


def read_namespaces(root: Path) -> list[dict]:
    """list_namespaces of an existing store, checked first in a child process.

    StorePathError when ``root`` is not a store (require_store); StoreCorruptError when
    its index cannot be read, including an index that kills its reader (LMDB maps the
    file, so a file cut short raises SIGBUS: a child process takes that signal).
    """
    require_store(root)
    crashed = _probe_index(root)
    if crashed:
        raise StoreCorruptError(
            f"the disk-tier index {root / 'index'} cannot be read (a process reading it was "
            f"killed by {crashed}: is index/data.mdb cut short?); " + clear_hint(root))
    return list_namespaces(root)


def is_store(root: Path) -> bool:
    """Whether ``root`` looks like a store (has index/ or slabs/), readable or not."""
    return (root / "index").is_dir() or (root / "slabs").is_dir()


def _probe_index(root: Path) -> str | None:
    """None if a child process can list the namespaces (or fails with an ordinary error
    that this process reports itself); else the signal that killed it."""
    probe = "import sys; from kv_offload.disk import list_namespaces; list_namespaces(sys.argv[1])"
    proc = subprocess.run([sys.executable, "-c", probe, str(root)], capture_output=True,
                          timeout=120)
    if proc.returncode >= 0:
        return None
    try:
        return signal.Signals(-proc.returncode).name
    except ValueError:
        return f"signal {-proc.returncode}"


def chunk_bytes(ns: dict) -> int:
    """Bytes of one chunk of a namespace (list_namespaces entry), all ranks."""
    return ns["slot_bytes"] * ns["num_ranks"]


def disk_bytes(root: Path, namespace_id: str) -> int:
    """Bytes the namespace's (sparse) slab files occupy on disk."""
    files = slab_dir(root, namespace_id).glob("*.slab")
    return sum(f.stat().st_blocks * 512 for f in files if f.is_file())


BadChunk = tuple[DiskEntry, int, str]  # entry, rank, reason (a ReadResult value)


def scan_namespace(root: Path, ns: dict, on_chunk: Callable[[int], None] | None = None
                   ) -> tuple[int, list[BadChunk]]:
    """Read and check every chunk of every rank; return (chunks checked, bad chunks).

    Read-only: a missing slab file is not created (its chunks are bad, "missing").
    ``on_chunk(num_bad)`` is called after each chunk, for progress.
    """
    nid, ranks, slot_bytes = ns["namespace_id"], ns["num_ranks"], ns["slot_bytes"]
    slabs: list[SlabFile | None] = []
    for rank in range(ranks):
        exists = slab_path(root, nid, rank, ranks).is_file()
        slabs.append(SlabFile(root, namespace_id=nid, rank=rank, num_ranks=ranks,
                              slot_bytes=slot_bytes) if exists else None)
    buf, bad, done = bytearray(slot_bytes), [], 0
    try:
        for entry, _ in iter_entries(root, nid):
            for rank, slab in enumerate(slabs):
                result = ReadResult.MISSING if slab is None else slab.read(
                    entry.slot, buf, entry.checksums[rank])
                if not result:
                    bad.append((entry, rank, result.value))
            done += 1
            if on_chunk is not None:
                on_chunk(len(bad))
    finally:
        for slab in slabs:
            if slab is not None:
                slab.close()
    return done, bad


def repair_and_check(root: Path, ns: dict, drop: list[DiskEntry]) -> list[str]:
    """Drop ``drop`` from the namespace, then return DiskIndex.check()'s problems.
    Opening the index reclaims reservations of dead processes."""
    with DiskIndex.open(root, namespace_id=ns["namespace_id"], descriptor=ns["descriptor"],
                        slot_bytes=ns["slot_bytes"], num_ranks=ns["num_ranks"], create=False,
                        capacity_bytes=ns["num_slots"] * chunk_bytes(ns)) as index:
        for entry in drop:
            index.drop(entry.key, entry.slot)
        return index.check()


def clear(root: str | os.PathLike, namespace_id: str | None = None) -> None:
    """Remove one namespace (index records, then slab files) or, with None, the store.

    Removes only what a store consists of (``index/``, ``slabs/``) and refuses a directory
    that is not a store. Stop the processes using it first; if not, they see misses, never
    wrong data. Namespace records are deleted in batches of 10k records per transaction.
    """
    root = Path(root)
    if namespace_id is None:
        if not is_store(root):
            raise StorePathError(f"{root} is not a kv-offload disk store (no index/ or slabs/)")
        if is_open_here(root):
            raise StoreError(f"the disk store {root} is open in this process; close it first")
        shutil.rmtree(root / "index")
        shutil.rmtree(root / "slabs", ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()
        return
    validate_namespace_id(namespace_id)
    with existing_env(root) as env:
        if env is not None:
            batch = functools.partial(_delete_batch, namespace_id=namespace_id, dbs=env.dbs)
            while not env.write(batch):
                pass
    shutil.rmtree(slab_dir(root, namespace_id), ignore_errors=True)


def _delete_batch(txn: lmdb.Transaction[bytes], *, namespace_id: str,
                  dbs: dict[str, lmdb._Database]) -> bool:
    """Delete up to _CLEAR_BATCH records of a namespace, then its record once none is
    left; whether it is gone."""
    prefix, left = namespace_prefix(namespace_id), _CLEAR_BATCH
    for db in ("entries", "slots", "lru", "free", "reservations", "counters"):
        cursor = txn.cursor(db=dbs[db])
        while left and cursor.set_range(prefix) and cursor.key().startswith(prefix):
            cursor.delete()
            left -= 1
    if left:
        txn.delete(namespace_id.encode(), db=dbs["namespaces"])
    return left > 0


def store_users(root: Path, namespace_id: str | None = None) -> dict[int, str]:
    """pid -> name of the other processes using the store: holding its slab files or LMDB
    files open or mapped, or listed in LMDB's reader table. With a namespace, only
    holders of that namespace's slab files count."""
    slabs = (slab_dir(root, namespace_id) if namespace_id else root / "slabs").resolve()
    index = {str((root / "index" / n).resolve()) for n in ("data.mdb", "lock.mdb")}
    users: dict[int, str] = {}
    for proc in psutil.process_iter(["name"]):
        if proc.pid == os.getpid():
            continue
        try:
            files = {f.path for f in proc.open_files()}
            if namespace_id is None and not files & index:
                files |= {m.path for m in proc.memory_maps()}
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # gone, or another user's
            continue
        if (namespace_id is None and files & index) or any(
                f.startswith(f"{slabs}/") for f in files):
            users[proc.pid] = proc.info["name"] or "?"
    if namespace_id is None:
        users.update({pid: _process_name(pid) for pid in _lmdb_readers(root / "index")})
    return users


def namespaces_held_by(root: Path, pids: list[int]) -> set[str]:
    """Ids of the namespaces of the store whose slab files the processes ``pids`` hold
    open (a running engine opens its slab files at start-up)."""
    slabs = str((root / "slabs").resolve()) + "/"
    held = set()
    for pid in pids:
        try:
            files = [f.path for f in psutil.Process(pid).open_files()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        held |= {f[len(slabs):].split("/", 1)[0] for f in files if f.startswith(slabs)}
    return held


def _process_name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"


def _lmdb_readers(index: Path) -> set[int]:
    """pids in the LMDB reader table (stale slots of dead processes cleared first)."""
    try:
        env = lmdb.open(str(index), readonly=True, lock=True, max_dbs=0)
    except lmdb.Error:
        return set()
    try:
        env.reader_check()
        rows = env.readers().splitlines()[1:]
    finally:
        env.close()
    pids = {int(r.split()[0]) for r in rows if r.split() and r.split()[0].isdigit()}
    return pids - {os.getpid()}
