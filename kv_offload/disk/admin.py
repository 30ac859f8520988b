"""Administration of disk stores: list namespaces and entries, verify, repair, clear, and
find the processes using a store. What `kv-offload inspect/verify/clear` and `warm` do to
a store, without the printing (cli.py).

Listing and verifying only read (a read-only LMDB environment, slab files opened for
reading). ``clear`` first proves the directory is a store (``prove_store``), then deletes
only the files kv-offload names (files.py) and leaves everything else where it is.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import psutil

from kv_offload.checksum import CHECKSUM_ALGORITHM
from kv_offload.disk.env import clear_hint, existing_env, is_open_here
from kv_offload.disk.errors import StoreCorruptError, StoreError, StorePathError
from kv_offload.disk.files import (
    INDEX_DIR,
    INDEX_FILES,
    MARKER_NAME,
    SLABS_DIR,
    is_marker_leftover,
    is_namespace_name,
    is_slab_name,
    marker_problem,
    slab_dir,
    validate_namespace_id,
)
from kv_offload.disk.index import DiskIndex
from kv_offload.disk.namespace import COMMITTED, NamespaceTxn
from kv_offload.disk.records import (
    PERSISTENT_COUNTERS,
    DiskEntry,
    EntryRecord,
    LruKey,
    namespace_prefix,
)
from kv_offload.disk.slab import SlabFile

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
            for ns in txn.cursor(db=env.dbs["namespaces"]).iternext(values=False):
                if not is_namespace_name(ns.decode("ascii", "replace")):
                    raise StoreCorruptError(
                        f"the disk-tier index {env.root / 'index'} names a namespace {ns!r} "
                        "that is not a namespace id; " + clear_hint(env.root))
                op = NamespaceTxn(txn, env.dbs, ns.decode(), root=env.root)
                info = op.record()
                assert info is not None  # the cursor just found it
                names = ("entries", "reserved", "free", *PERSISTENT_COUNTERS)
                info["counters"] = {name: op.counter(name) for name in names}
                info["tails"] = op.num_tails()  # request tails among the entries
                cursor = txn.cursor(db=env.dbs["lru"])  # "/" + 1 == "0": past the prefix
                ok = cursor.prev() if cursor.set_range(op.p[:-1] + b"0") else cursor.last()
                newest, oldest = cursor.key() if ok else b"", next(op.scan("lru"), None)
                info["oldest_access"] = LruKey.tick(oldest[0]) / 1e6 if oldest else None
                info["newest_access"] = (LruKey.tick(newest, len(op.p)) / 1e6
                                         if newest.startswith(op.p) else None)
                out.append(info)
    return out


def iter_entries(root: str | os.PathLike, namespace_id: str, *,
                 on_bad: Callable[[bytes, str], None] | None = None
                 ) -> Iterator[tuple[DiskEntry, float]]:
    """Yield (entry, last access in seconds since the epoch) for every committed entry in
    key order, reading 1024 entries per short read transaction. Read-only. A bad record
    (malformed, or its slot outside the namespace) is skipped; ``on_bad(key, why)`` is
    called for each."""
    validate_namespace_id(namespace_id)
    with existing_env(root) as env:
        start = b""
        while env is not None:
            with env.read() as txn:
                op = NamespaceTxn(txn, env.dbs, namespace_id, root=env.root)
                batch = list(itertools.islice(op.scan("entries", start), _SCAN_BATCH + 1))
                parsed = [(key, value, op.parse_entry(value)) for key, value in
                          batch[:_SCAN_BATCH]]
                why = {key: op.why_bad(value) for key, value, p in parsed if p is None}
            for key, value, fields in parsed:
                if fields is None:
                    if on_bad is not None:
                        on_bad(key, why[key])
                    continue
                state, slot, tick = fields
                if state == COMMITTED:
                    yield DiskEntry(key, slot, EntryRecord.checksums(value)), tick / 1e6
            if len(batch) <= _SCAN_BATCH:
                return
            start = batch[_SCAN_BATCH][0]


def require_dir(root: Path) -> None:
    """StorePathError naming the problem unless ``root`` is an existing directory."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise StorePathError(f"no disk store at {root}: the path does not exist") from None
    except NotADirectoryError:
        raise StorePathError(f"no disk store at {root}: a part of the path is a file, not a "
                             "directory") from None
    except OSError as exc:
        raise StorePathError(f"cannot access {root}: {exc.strerror}; run as the user that "
                             "owns the store, or fix its permissions") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StorePathError(f"{root} is a file, not a disk store directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise StorePathError(f"cannot access {root}: Permission denied; run as the user that "
                             "owns the store, or fix its permissions")


def require_store(root: Path) -> None:
    """StorePathError naming the problem unless ``root`` is a store with an index."""
    require_dir(root)
    try:
        data = os.lstat(root / INDEX_DIR / "data.mdb")
    except (FileNotFoundError, NotADirectoryError):
        raise StorePathError(f"{root} is not a kv-offload disk store (no index/data.mdb); "
                             "pass the directory given as disk_path") from None
    except OSError as exc:
        raise StorePathError(f"cannot access the disk store {root}: {exc.strerror}; run as "
                             "the user that owns it, or fix its permissions") from None
    if not stat.S_ISREG(data.st_mode):
        raise StorePathError(f"{root / INDEX_DIR / 'data.mdb'} is not a file; {root} is not "
                             "a kv-offload disk store kv-offload can read")


def prove_store(root: Path) -> str:
    """How ``root`` is proven to be a kv-offload store before anything in it is deleted:
    "marker" (its ``kv-offload-store.json``), or "index" for a store made before the
    marker (its ``index/`` is an LMDB environment with kv-offload's tables and format
    records). Read-only. StorePathError saying what is missing otherwise."""
    require_dir(root)
    problem = marker_problem(root)
    if problem is None:
        return "marker"
    try:
        with existing_env(root) as env:
            if env is None:
                raise StorePathError("no index/data.mdb")
            with env.read() as txn:
                algorithm = txn.get(b"checksum", db=env.dbs["meta"])
            if algorithm != CHECKSUM_ALGORITHM.encode():
                raise StoreCorruptError(f"its index names the checksum {algorithm!r}")
        return "index"
    except StoreError as exc:
        index_problem = str(exc)
    raise StorePathError(
        f"{root} is not a kv-offload disk store, or not one kv-offload can prove is its own: "
        f"{problem}, and its index does not show it ({index_problem}). Nothing was deleted. "
        "If it is a store kv-offload made, delete it yourself after checking what is in it")


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
    """Bytes the namespace's (sparse) slab files occupy on disk (links not followed)."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(slab_dir(root, namespace_id)):
            if is_slab_name(entry.name) and entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_blocks * 512
    return total


BadChunk = tuple[DiskEntry, int, str]  # entry, rank, reason (a ReadResult value)
BadRecord = tuple[bytes, str]  # key, why (a malformed record, or a slot outside the slab)


def scan_namespace(root: Path, ns: dict, on_chunk: Callable[[int], None] | None = None
                   ) -> tuple[int, list[BadChunk], list[BadRecord]]:
    """Read and check every chunk of every rank; return (chunks checked, bad chunks, bad
    index records).

    Read-only: slab files are opened for reading and a missing one is not created (its
    chunks are bad, "missing"). ``on_chunk(num_bad)`` is called after each chunk, for
    progress. StorePathError when a slab path holds a link, a directory or a special file.
    """
    nid, ranks, slot_bytes = ns["namespace_id"], ns["num_ranks"], ns["slot_bytes"]
    slabs: list[SlabFile] = []
    bad_records: list[BadRecord] = []
    buf, bad, done = bytearray(slot_bytes), [], 0
    try:
        for rank in range(ranks):
            slabs.append(SlabFile(root, namespace_id=nid, rank=rank, num_ranks=ranks,
                                  slot_bytes=slot_bytes, allow_unsafe_permissions=True,
                                  readonly=True))
        for entry, _ in iter_entries(root, nid, on_bad=lambda k, w: bad_records.append((k, w))):
            for rank, slab in enumerate(slabs):
                result = slab.read(entry.slot, buf, entry.checksums[rank])
                if not result:
                    bad.append((entry, rank, result.value))
            done += 1
            if on_chunk is not None:
                on_chunk(len(bad))
    finally:
        for slab in slabs:
            slab.close()
    return done, bad, bad_records


def check_namespace(root: Path, namespace_id: str) -> list[str]:
    """DiskIndex.check()'s problems of a namespace but its bad records (``iter_entries``
    lists them), read-only: no reservation of a dead process is reclaimed."""
    with existing_env(root) as env:
        if env is None:
            raise StorePathError(f"no disk store at {root} (missing index/data.mdb)")
        with env.read() as txn:
            op = NamespaceTxn(txn, env.dbs, namespace_id, root=env.root)
            return op.check(list_bad_records=False)


def repair_and_check(root: Path, ns: dict, drop: list[DiskEntry], bad_keys: list[bytes]
                     ) -> list[str]:
    """Drop the entries ``drop`` and the bad records ``bad_keys`` from the namespace, then
    return DiskIndex.check()'s problems. Opening the index reclaims reservations of dead
    processes."""
    with DiskIndex.open(root, namespace_id=ns["namespace_id"], descriptor=ns["descriptor"],
                        slot_bytes=ns["slot_bytes"], num_ranks=ns["num_ranks"], create=False,
                        capacity_bytes=ns["num_slots"] * chunk_bytes(ns)) as index:
        for entry in drop:
            index.drop(entry.key, entry.slot)
        if bad_keys:
            index.drop_bad_records(bad_keys)
        return index.check()


def clear(root: str | os.PathLike, namespace_id: str | None = None) -> list[Path]:
    """Remove one namespace (index records, then slab files) or, with None, the store;
    return the paths left in place because kv-offload did not make them.

    Refuses (StorePathError, nothing deleted) a directory that ``prove_store`` cannot
    prove is a store. Deletes only what kv-offload names: the marker, ``index/data.mdb``
    and ``index/lock.mdb``, ``slabs/<namespace id>/rank<r>-of-<n>.slab``, then each of
    those directories (and the store directory) once empty; never follows a link. Stop
    the processes using it first; if not, they see misses, never wrong data. Namespace
    records are deleted in batches of 10k records per transaction.
    """
    root = Path(root)
    prove_store(root)
    left: list[Path] = []
    if namespace_id is None:
        if is_open_here(root):
            raise StoreError(f"the disk store {root} is open in this process; close it first")
        _remove_known(root / SLABS_DIR, lambda name: is_namespace_name(name), left,
                      inner=lambda name: is_slab_name(name))
        _remove_known(root / INDEX_DIR, lambda name: name in INDEX_FILES, left)
        for entry in _scandir(root, left):
            if is_marker_leftover(entry.name) and entry.is_file(follow_symlinks=False):
                _unlink(Path(entry.path))
        _unlink(root / MARKER_NAME)
        _rmdir_if_empty(root, left=[])
        return left
    validate_namespace_id(namespace_id)
    with existing_env(root, write=True) as env:
        if env is not None:
            batch = functools.partial(_delete_batch, namespace_id=namespace_id, dbs=env.dbs)
            while not env.write(batch):
                pass
    if not os.path.islink(root / SLABS_DIR):
        _remove_known(slab_dir(root, namespace_id), is_slab_name, left)
    return left


def _remove_known(directory: Path, known: Callable[[str], bool], left: list[Path], *,
                  inner: Callable[[str], bool] | None = None) -> None:
    """Delete the entries of ``directory`` that ``known`` names (files; directories whose
    files ``inner`` names, with ``inner``), then ``directory`` if empty. Links and
    anything else are left and appended to ``left``. A link or file in place of
    ``directory`` is left too."""
    try:
        st = os.lstat(directory)
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise _delete_failed(directory, exc) from None
    if not stat.S_ISDIR(st.st_mode):
        left.append(directory)
        return
    for entry in _scandir(directory, left):
        path = Path(entry.path)
        if inner is not None and known(entry.name) and entry.is_dir(follow_symlinks=False):
            _remove_known(path, inner, left)
        elif inner is None and known(entry.name) and entry.is_file(follow_symlinks=False):
            _unlink(path)
        else:
            left.append(path)
    _rmdir_if_empty(directory, left)


def _scandir(directory: Path, left: list[Path]) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as exc:
        raise _delete_failed(directory, exc) from None


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise _delete_failed(path, exc) from None


def _rmdir_if_empty(directory: Path, left: list[Path]) -> None:
    if any(p.parent == directory or directory in p.parents for p in left):
        return
    with contextlib.suppress(OSError):  # not empty (a file appeared meanwhile)
        os.rmdir(directory)


def _delete_failed(path: Path, exc: OSError) -> StorePathError:
    return StorePathError(f"cannot delete {path}: {exc.strerror}; run as the user that owns "
                          "the store, or fix its permissions (what was deleted before stays "
                          "deleted: the store is only a cache)")


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
