"""LMDB plumbing of the disk index: the shared environment, its layout and the
per-namespace operations inside one transaction (``_NsTxn``).

Private to ``kv_offload.disk``; ``DiskIndex`` (index.py) is the public face.
LMDB layout (named sub-databases; ``P`` = ``<namespace_id>/`` in ASCII, ``be64`` = 8-byte
big-endian so that cursors walk slots and ticks in order):
  meta          format_version -> b"1", created -> ISO time, checksum -> b"xxh3_64"
  namespaces    namespace_id -> pretty JSON (descriptor, slot_bytes, num_ranks, num_slots)
  entries       P + key -> <state u8, slot u64, tick u64, checksum u64 * num_ranks>
                (state 0: reserved, no checksums; 1: committed, visible to lookups)
  slots         P + be64(slot) -> key                (every reserved or committed slot)
  lru           P + be64(tick) + be64(slot) -> key   (committed entries, oldest first)
  free          P + be64(slot) -> b""                (released slots below the hwm)
  reservations  P + be64(slot) -> <pid, process start time, instance token, time>
  counters      P + name -> u64 (hwm, entries, reserved, free, hits, misses, ...)
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import struct
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import lmdb

from kv_offload.checksum import CHECKSUM_ALGORITHM
from kv_offload.disk.errors import (
    NamespaceMismatchError,
    StoreCorruptError,
    StoreError,
    StorePathError,
    StoreVersionError,
)
from kv_offload.disk.slab import DIR_MODE, check_private, make_private_dirs

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAX_KEY_BYTES = 64
PERSISTENT_COUNTERS = ("hits", "misses", "checksum_failures", "commits", "evictions", "reclaimed")
_DB_NAMES = ("meta", "namespaces", "entries", "slots", "lru", "free", "reservations", "counters")
_MIN_MAP_SIZE = 64 << 10
_DEFAULT_MAP_SIZE = 64 << 20
_MAP_BYTES_PER_SLOT = 1024  # generous index bytes per entry, to pre-size the map
_RECLAIM_EVERY_S = 5.0  # at most one dead-reservation scan per index this often when full
_RESERVED, _COMMITTED = 0, 1
_HEAD = struct.Struct("<BQQ")  # state, slot, tick
_BE64 = struct.Struct(">Q")
_LRU_KEY = struct.Struct(">QQ")  # tick, slot
_U64 = struct.Struct("<Q")
_OWNER = struct.Struct("<QQQd")  # pid, process start time, instance token, time reserved
_CORRUPT = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
            lmdb.PageNotFoundError, lmdb.PanicError, lmdb.BadChecksumError, lmdb.IncompatibleError)

Owner = tuple[int, int, int]  # pid, process start time (0: unknown), instance token
_LMDB_MAGIC = 0xBEEFC0DE
# An LMDB meta page (64-bit): 16-byte page header, magic, version, address, map size,
# two MDB_db records (the first's md_pad is the page size), last used page, txn id.
_META_PAGE = struct.Struct("<16xII16xI92xQQ")  # magic, version, page size, last page, txnid


@functools.cache
def _checksums_struct(num_ranks: int) -> struct.Struct:
    return struct.Struct(f"<{num_ranks}Q")


class DiskEntry(NamedTuple):
    """A committed chunk: its key, its slot (same in every rank's slab), per-rank checksums.

    Immutable and slotted. A NamedTuple rather than a frozen dataclass because lookups
    build one per hit and the tuple is twice as cheap to construct (the 5 us/key budget).
    """

    key: bytes
    slot: int
    checksums: tuple[int, ...]


def _clear_hint(root: Path) -> str:
    return f"it is only a cache: run `kv-offload clear {root}` or delete that directory"


def _lmdb_failure(store_root: Path, exc: Exception) -> StoreError:
    """Translate an LMDB error into the StoreError that tells the user what to do."""
    index_dir = store_root / "index"
    if isinstance(exc, _CORRUPT):
        return StoreCorruptError(
            f"the disk-tier index {index_dir} is unreadable or corrupt ({exc}); "
            + _clear_hint(store_root)
        )
    if isinstance(exc, lmdb.ReadonlyError):
        return StorePathError(
            f"the disk-tier index {index_dir} is not writable ({exc}); fix its permissions "
            "or choose another disk path"
        )
    return StoreError(f"the disk-tier index {index_dir} failed: {exc}")


def _process_identity(pid: int) -> tuple[bool, int]:
    """(alive, start time in clock ticks or 0 if unknown) of ``pid``; zombies are dead."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0] not in (b"Z", b"X"), int(fields[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False, 0
    except (OSError, IndexError, ValueError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False, 0
    except PermissionError:
        pass
    return True, 0


def _check_data_file(root: Path) -> None:
    """Raise StoreCorruptError when ``index/data.mdb`` is shorter than its newest meta page
    says. LMDB maps the file, so reading past its end (a copy cut short, an OS crash with
    ``sync=False``) would kill the process with SIGBUS instead of raising."""
    path = root / "index" / "data.mdb"
    try:
        with open(path, "rb") as f:
            first = f.read(_META_PAGE.size)
            if len(first) < _META_PAGE.size:
                return  # a new store, or too short to be LMDB (lmdb.open says so)
            page_size = _META_PAGE.unpack(first)[2]
            if _META_PAGE.unpack(first)[0] != _LMDB_MAGIC or not 512 <= page_size <= 1 << 16:
                return  # not an LMDB file: lmdb.open says so
            f.seek(page_size)
            second = f.read(_META_PAGE.size)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return
    metas = [_META_PAGE.unpack(first)]
    if len(second) == _META_PAGE.size and _META_PAGE.unpack(second)[0] == _LMDB_MAGIC:
        metas.append(_META_PAGE.unpack(second))
    needed = (max(metas, key=lambda m: m[4])[3] + 1) * page_size
    if size < needed:
        raise StoreCorruptError(
            f"the disk-tier index {path} is cut short ({size} of {needed} bytes); "
            + _clear_hint(root))


class _Store:
    """This process's LMDB environment of one store (LMDB forbids opening one twice).

    Every transaction of every DiskIndex on the store in this process runs under
    ``lock``, which also makes resizing the map safe (it needs no live transaction).
    """

    def __init__(self, root: Path, *, map_size: int, sync: bool) -> None:
        self.root, self.lock, self.refs = root, threading.RLock(), 0
        self.live_tokens: set[int] = set()  # instance tokens of open DiskIndex objects
        _check_data_file(root)
        try:
            self.env = lmdb.open(
                str(root / "index"), map_size=map_size, subdir=True, max_dbs=len(_DB_NAMES),
                sync=sync, metasync=sync, readahead=False, meminit=False, mode=DIR_MODE,
                max_spare_txns=4,
            )
        except lmdb.Error as exc:
            raise _lmdb_failure(root, exc) from exc
        try:
            self.dbs = {name: self.env.open_db(name.encode()) for name in _DB_NAMES}
            self.write(self._check_format)
        except BaseException:
            self.env.close()
            raise

    def _check_format(self, txn: lmdb.Transaction) -> None:
        raw = txn.get(b"format_version", db=self.dbs["meta"])
        if raw is None and not txn.stat(self.dbs["namespaces"])["entries"]:
            for name, value in ((b"format_version", str(FORMAT_VERSION)),
                                (b"created", datetime.now(timezone.utc).isoformat()),
                                (b"checksum", CHECKSUM_ALGORITHM)):
                txn.put(name, value.encode(), db=self.dbs["meta"])
            return
        if raw is None or not raw.isdigit():
            raise StoreCorruptError(
                f"the disk-tier index {self.root / 'index'} has no readable format version; "
                + _clear_hint(self.root)
            )
        if int(raw) > FORMAT_VERSION:
            raise StoreVersionError(
                f"the disk store {self.root} was written by a newer kv-offload (format version "
                f"{int(raw)}; this one reads up to {FORMAT_VERSION}); upgrade kv-offload, choose "
                f"another disk path, or run `kv-offload clear {self.root}`"
            )

    def write(self, fn: Callable[[lmdb.Transaction], object]):
        """Run ``fn(txn)`` in one write transaction and commit; return its result.

        Atomic: if ``fn`` raises, nothing is written. On a full map the map is grown and
        ``fn`` runs again from scratch, so ``fn`` must not mutate in-memory state.
        """
        with self.lock:
            while True:
                try:
                    with self.env.begin(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.grow_map(2 * self.env.info()["map_size"])
                except lmdb.MapResizedError:  # another process grew it: adopt its size
                    self.env.set_mapsize(0)
                except lmdb.Error as exc:
                    raise _lmdb_failure(self.root, exc) from exc

    @contextlib.contextmanager
    def read(self) -> Iterator[lmdb.Transaction]:
        """A short read transaction, under the store lock."""
        with self.lock:
            try:
                try:
                    txn = self.env.begin()
                except lmdb.MapResizedError:
                    self.env.set_mapsize(0)
                    txn = self.env.begin()
                with txn:
                    yield txn
            except lmdb.Error as exc:
                raise _lmdb_failure(self.root, exc) from exc

    def grow_map(self, new_size: int) -> None:
        """Grow the memory map to at least ``new_size`` bytes; never shrinks it."""
        with self.lock:
            old = self.env.info()["map_size"]
            if new_size > old:
                self.env.set_mapsize(new_size)
                logger.info("disk tier: index map grown from %d to %d KiB", old >> 10,
                            new_size >> 10)


_STORES: dict[tuple[int, int, int], _Store] = {}  # (pid, st_dev, st_ino) of index/ -> store
_STORES_LOCK = threading.Lock()


def _acquire_store(root: Path, *, create: bool, map_size: int | None, sync: bool,
                   allow_unsafe_permissions: bool = False) -> _Store:
    """Open, or share, this process's environment of the store at ``root``. Unless
    ``allow_unsafe_permissions``, refuses (StorePathError) a store directory or index
    file owned by another user or writable by group or others."""
    try:
        if root.exists() and not root.is_dir():
            raise StorePathError(
                f"disk store path {root} is a file, not a directory; point the disk tier at "
                "a directory (or remove the file)"
            )
        if not create and not (root / "index" / "data.mdb").exists():
            raise StorePathError(f"no disk store at {root} (missing index/data.mdb)")
        make_private_dirs(root, "index", allow_unsafe_permissions=allow_unsafe_permissions)
        for name in ("data.mdb", "lock.mdb"):
            with contextlib.suppress(FileNotFoundError):
                path = root / "index" / name
                check_private(path, os.stat(path), allow_unsafe=allow_unsafe_permissions)
        st = os.stat(root / "index")
    except PermissionError as exc:
        raise StorePathError(
            f"cannot access the disk store {root}: {exc.strerror}; fix its permissions or "
            "choose another disk path"
        ) from exc
    ident = (os.getpid(), st.st_dev, st.st_ino)
    with _STORES_LOCK:
        store = _STORES.get(ident)
        if store is None:
            size = max(map_size or _DEFAULT_MAP_SIZE, _MIN_MAP_SIZE)
            store = _STORES[ident] = _Store(root, map_size=size, sync=sync)
        store.refs += 1
    return store


def _release_store(store: _Store) -> None:
    # The environment is closed while _STORES_LOCK is held: a concurrent
    # _acquire_store of the same files must not open a second environment before
    # this one is closed (LMDB forbids two in one process).
    with _STORES_LOCK:
        store.refs -= 1
        if store.refs > 0:
            return
        for ident in [i for i, s in _STORES.items() if s is store]:
            del _STORES[ident]
        with store.lock:
            with contextlib.suppress(lmdb.Error):
                store.env.sync(True)
            store.env.close()


class _NsTxn:
    """One namespace's records inside one LMDB transaction. Counter changes collect in
    ``deltas`` until finish(). Lives as long as its transaction, on its thread."""

    def __init__(self, txn: lmdb.Transaction, dbs: dict, namespace_id: str) -> None:
        self.txn, self.dbs, self.namespace_id = txn, dbs, namespace_id
        self.p = namespace_id.encode("ascii") + b"/"
        self.deltas: dict[str, int] = defaultdict(int)
        self.hwm: int | None = None  # cached high-water mark (take_slot)
        self.free_exhausted = False  # the free list has no unpinned slot (take_slot)

    def get(self, db: str, key: bytes) -> bytes | None:
        return self.txn.get(self.p + key, db=self.dbs[db])

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self.txn.put(self.p + key, value, db=self.dbs[db])

    def delete(self, db: str, key: bytes) -> None:
        self.txn.delete(self.p + key, db=self.dbs[db])

    def record(self) -> dict | None:
        raw = self.txn.get(self.namespace_id.encode(), db=self.dbs["namespaces"])
        return None if raw is None else json.loads(raw)

    def put_record(self, record: dict) -> None:
        raw = json.dumps(record, indent=2, sort_keys=True).encode()
        self.txn.put(self.namespace_id.encode(), raw, db=self.dbs["namespaces"])

    def counter(self, name: str) -> int:
        raw = self.get("counters", name.encode())
        return (0 if raw is None else _U64.unpack(raw)[0]) + self.deltas.get(name, 0)

    def finish(self) -> None:
        """Write the counter deltas."""
        for name, delta in list(self.deltas.items()):
            if delta:
                self.put("counters", name.encode(), _U64.pack(max(self.counter(name), 0)))
        self.deltas.clear()

    def scan(self, db: str, start: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """(key without the prefix, value) of this namespace's records in ``db``, in order."""
        cursor = self.txn.cursor(db=self.dbs[db])
        if cursor.set_range(self.p + start):
            for key, value in cursor:
                if not key.startswith(self.p):
                    return
                yield key[len(self.p) :], value

    def apply_accesses(self, pending: dict[bytes, int], counts: dict[str, int]) -> None:
        """Move each accessed, still committed entry to its newer tick in the LRU order."""
        for key, tick in pending.items():
            value = self.get("entries", key)
            if value is None or value[0] != _COMMITTED:
                continue
            _, slot, old = _HEAD.unpack_from(value)
            if tick > old:
                self.delete("lru", _LRU_KEY.pack(old, slot))
                self.put("lru", _LRU_KEY.pack(tick, slot), key)
                self.put("entries", key, _HEAD.pack(_COMMITTED, slot, tick) + value[_HEAD.size :])
        for name, n in counts.items():
            self.deltas[name] += n

    def take_slot(self, num_slots: int, pins: dict[int, int]) -> int | None:
        """A slot to reserve: free list, then the high-water mark, then the least recently
        used unpinned committed entry (unpublished here). None if none can be had."""
        slot = None if self.free_exhausted else self._pop_unpinned("free", pins)
        if slot is not None:
            self.deltas["free"] -= 1
            return slot
        self.free_exhausted = True  # until this transaction frees a slot
        if self.hwm is None:
            self.hwm = self.counter("hwm")
        if self.hwm < num_slots:
            self.deltas["hwm"] += 1
            self.hwm += 1
            return self.hwm - 1
        return self._pop_unpinned("lru", pins)

    def _pop_unpinned(self, db: str, pins: dict[int, int]) -> int | None:
        cursor = self.txn.cursor(db=self.dbs[db])
        if not cursor.set_range(self.p):
            return None
        for key, value in cursor:
            if not key.startswith(self.p):
                return None
            slot = _BE64.unpack_from(key, len(key) - 8)[0]
            if slot not in pins:
                cursor.delete()
                if db == "lru":  # an eviction; reserve() overwrites the slots record
                    self.delete("entries", value)
                    self.deltas["entries"] -= 1
                    self.deltas["evictions"] += 1
                return slot
        return None

    def reserve(self, key: bytes, slot: int, owner: Owner, tick: int) -> None:
        self.put("entries", key, _HEAD.pack(_RESERVED, slot, tick))
        self.put("slots", _BE64.pack(slot), key)
        self.put("reservations", _BE64.pack(slot), _OWNER.pack(*owner, time.time()))
        self.deltas["reserved"] += 1

    def owner_of(self, slot: int) -> Owner | None:
        raw = self.get("reservations", _BE64.pack(slot))
        return None if raw is None else _OWNER.unpack(raw)[:3]

    def publish(self, key: bytes, slot: int, checksums: Sequence[int], tick: int, owner) -> bool:
        """Turn ``owner``'s reservation of ``slot`` for ``key`` into a committed entry."""
        value = self.get("entries", key)
        if value is None or value[0] != _RESERVED or _HEAD.unpack_from(value)[1] != slot:
            return False
        if self.owner_of(slot) != owner:
            return False
        sums = _checksums_struct(len(checksums)).pack(*checksums)
        self.put("entries", key, _HEAD.pack(_COMMITTED, slot, tick) + sums)
        self.put("lru", _LRU_KEY.pack(tick, slot), key)
        self.delete("reservations", _BE64.pack(slot))
        for name, n in (("reserved", -1), ("entries", 1), ("commits", 1)):
            self.deltas[name] += n
        return True

    def unreserve(self, slot: int) -> None:
        """Forget the reservation of ``slot`` and put the slot on the free list."""
        key = self.get("slots", _BE64.pack(slot))
        self.delete("reservations", _BE64.pack(slot))
        self.delete("slots", _BE64.pack(slot))
        value = None if key is None else self.get("entries", key)
        if value is not None and value[0] == _RESERVED and _HEAD.unpack_from(value)[1] == slot:
            self.delete("entries", key)
        self.deltas["reserved"] -= 1
        self.free(slot)

    def unpublish(self, key: bytes, slot: int) -> bool:
        """Remove ``key`` if it is committed at ``slot``; the caller decides the slot's fate."""
        value = self.get("entries", key)
        if value is None or value[0] != _COMMITTED or _HEAD.unpack_from(value)[1] != slot:
            return False
        self.delete("entries", key)
        self.delete("lru", _LRU_KEY.pack(_HEAD.unpack_from(value)[2], slot))
        self.delete("slots", _BE64.pack(slot))
        self.deltas["entries"] -= 1
        return True

    def free(self, slot: int) -> None:
        self.put("free", _BE64.pack(slot), b"")
        self.deltas["free"] += 1
        self.free_exhausted = False

    def reclaim(self, keep: Callable[[Owner], bool]) -> int:
        """Unreserve every reservation whose owner ``keep`` rejects; return how many."""
        doomed = [_BE64.unpack(slot)[0] for slot, raw in self.scan("reservations")
                  if not keep(_OWNER.unpack(raw)[:3])]
        for slot in doomed:
            self.unreserve(slot)
        self.deltas["reclaimed"] += len(doomed)
        return len(doomed)

    def check(self) -> list[str]:
        """Every cross-reference violation in this namespace (see DiskIndex.check)."""
        problems: list[str] = []
        holder: dict[int, bytes] = {}
        found = {"entries": 0, "reserved": 0}
        for key, value in self.scan("entries"):
            state, slot, tick = _HEAD.unpack_from(value)
            if slot in holder:
                problems.append(f"slot {slot} held by {holder[slot].hex()} and {key.hex()}")
            holder[slot] = key
            if self.get("slots", _BE64.pack(slot)) != key:
                problems.append(f"slots record of slot {slot} does not name {key.hex()}")
            if state == _COMMITTED and self.get("lru", _LRU_KEY.pack(tick, slot)) != key:
                problems.append(f"committed {key.hex()} is missing from the LRU order")
            if state == _RESERVED and self.owner_of(slot) is None:
                problems.append(f"reserved {key.hex()} has no reservation record")
            found["entries" if state == _COMMITTED else "reserved"] += 1
        free = {_BE64.unpack(k)[0] for k, _ in self.scan("free")}
        found["free"] = len(free)
        problems += [f"slot {s} is both free and in use" for s in sorted(free & holder.keys())]
        expect = {"slots": len(holder), "lru": found["entries"], "reservations": found["reserved"]}
        for db, n in expect.items():
            if sum(1 for _ in self.scan(db)) != n:
                problems.append(f"{db} does not hold exactly {n} records")
        problems += [f"counter {name}={self.counter(name)}, found {n}"
                     for name, n in found.items() if self.counter(name) != n]
        hwm = self.counter("hwm")
        if len(holder) + len(free) != hwm or any(s >= hwm for s in (*holder, *free)):
            problems.append(f"{hwm - len(holder) - len(free)} slots below hwm {hwm} leaked")
        return problems


def _alive_owner(store: _Store) -> Callable[[Owner], bool]:
    """Predicate: is a reservation's owner still running? In this process: is that
    DiskIndex still open? Elsewhere: is the pid alive with the same start time? Each
    pid is looked up once per predicate."""
    own_pid, seen = os.getpid(), {}

    def alive(owner: Owner) -> bool:
        pid, start, token = owner
        if pid == own_pid:
            return token in store.live_tokens
        if pid not in seen:
            seen[pid] = _process_identity(pid)
        running, now_start = seen[pid]
        return running and (not start or not now_start or start == now_start)

    return alive


def _open_namespace(op: _NsTxn, record: dict, *, create: bool, store: _Store) -> dict:
    """Create or validate the namespace record, then reclaim dead reservations."""
    ns, stored = op.namespace_id, op.record()
    if stored is None:
        if not create:
            raise StoreError(f"namespace {ns} does not exist in the disk store {store.root}")
        op.put_record(stored := record)
    for name in ("slot_bytes", "num_ranks"):
        if stored[name] != record[name]:
            raise NamespaceMismatchError(
                f"namespace {ns} exists in the disk store {store.root} with {name}="
                f"{stored[name]}, but this process asks for {name}={record[name]}; the namespace "
                f"fingerprint should cover the KV layout. Run `kv-offload clear {store.root} "
                f"--namespace {ns}` to drop the old namespace"
            )
    if record["num_slots"] > stored["num_slots"]:
        logger.info("disk tier: namespace %s grows from %d to %d slots", ns,
                    stored["num_slots"], record["num_slots"])
        stored["num_slots"] = record["num_slots"]
        op.put_record(stored)
    elif record["num_slots"] < stored["num_slots"]:
        logger.warning("disk tier: namespace %s keeps its %d slots; the requested capacity "
                       "holds only %d (shrinking is not supported: run `kv-offload clear` to "
                       "start over)", ns, stored["num_slots"], record["num_slots"])
    reclaimed = op.reclaim(_alive_owner(store))
    if reclaimed:
        logger.info("disk tier: reclaimed %d slots reserved by dead processes", reclaimed)
    op.finish()
    return stored


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"chunk keys must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"chunk keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


