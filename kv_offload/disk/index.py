"""Scheduler side of the disk tier: the LMDB index of one namespace of a disk store.

Maps chunk keys to slots (the same slot in every rank's slab) with per-rank checksums, and
keeps the LRU order, free slots, reservations of slots being written and persistent
counters. Imports lmdb, never torch or vLLM. See docs/disk-tier.md.

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
import itertools
import json
import logging
import os
import secrets
import shutil
import struct
import threading
import time
from collections import Counter, defaultdict
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
from kv_offload.disk.slab import DIR_MODE, make_private_dirs, slab_dir, validate_namespace_id

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


class _Store:
    """This process's LMDB environment of one store (LMDB forbids opening one twice).

    Every transaction of every DiskIndex on the store in this process runs under
    ``lock``, which also makes resizing the map safe (it needs no live transaction).
    """

    def __init__(self, root: Path, *, map_size: int, sync: bool) -> None:
        self.root, self.lock, self.refs = root, threading.RLock(), 0
        self.live_tokens: set[int] = set()  # instance tokens of open DiskIndex objects
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


def _acquire_store(root: Path, *, create: bool, map_size: int | None, sync: bool) -> _Store:
    """Open, or share, this process's environment of the store at ``root``."""
    try:
        if root.exists() and not root.is_dir():
            raise StorePathError(
                f"disk store path {root} is a file, not a directory; point the disk tier at "
                "a directory (or remove the file)"
            )
        if not create and not (root / "index" / "data.mdb").exists():
            raise StorePathError(f"no disk store at {root} (missing index/data.mdb)")
        make_private_dirs(root, "index")
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


class DiskIndex:
    """The LMDB index of one namespace of a disk store; one per process per namespace.

    Thread-safe: every method runs under the store's per-process lock (the scheduler
    thread is the intended caller). Across processes LMDB serialises writers and lookups
    never block. Pins are per process: another process may evict a slot pinned here; the
    per-rank checksums turn that into a failed read (a miss), never wrong data.
    """

    def __init__(self, store: _Store, *, record: dict, clock: Callable[[], float]) -> None:
        """Use DiskIndex.open()."""
        self._store, self._dbs, self._record = store, store.dbs, record
        self._namespace_id = record["namespace_id"]
        self._prefix = self._namespace_id.encode() + b"/"
        self._num_ranks = record["num_ranks"]
        self._committed = struct.Struct(f"<xQ8x{self._num_ranks}Q")  # slot, checksums
        self._clock, self._last_tick = clock, 0
        self._token = secrets.randbits(63)
        self._owner: Owner = (os.getpid(), _process_identity(os.getpid())[1], self._token)
        self._pins: dict[int, int] = {}
        self._pending: dict[bytes, int] = {}  # key -> tick of its latest unflushed access
        self._counts = {"hits": 0, "misses": 0}  # unflushed
        self._next_reclaim = 0.0  # monotonic time of the next reclaim attempt when full
        self._closed = False
        store.live_tokens.add(self._token)

    @classmethod
    def open(
        cls,
        root: str | os.PathLike,
        *,
        namespace_id: str,
        descriptor: dict,
        slot_bytes: int,
        num_ranks: int,
        capacity_bytes: int,
        create: bool = True,
        map_size: int | None = None,
        sync: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> DiskIndex:
        """Open the store at ``root`` and the namespace in it, creating both if needed.

        ``num_slots = capacity_bytes // (slot_bytes * num_ranks)`` must be >= 1 (else
        ValueError). An existing namespace with another slot_bytes or num_ranks raises
        NamespaceMismatchError; a larger capacity is adopted, a smaller one is ignored with
        a warning. Reclaims reservations of dead processes. ``sync=True`` fsyncs each write
        transaction (durable against power loss); the default survives process crashes.
        The first opener in a process decides ``sync``. ``clock`` returns seconds; access
        ticks are its microseconds. StoreError subclasses for unusable stores.
        """
        validate_namespace_id(namespace_id)
        for name, value in (("slot_bytes", slot_bytes), ("num_ranks", num_ranks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        num_slots = capacity_bytes // (slot_bytes * num_ranks)
        if num_slots < 1:
            raise ValueError(f"capacity_bytes={capacity_bytes} holds no slot of {slot_bytes} "
                             f"bytes x {num_ranks} ranks; raise the disk capacity")
        record = {"namespace_id": namespace_id, "descriptor": json.loads(json.dumps(descriptor)),
                  "slot_bytes": slot_bytes, "num_ranks": num_ranks, "num_slots": num_slots,
                  "created": datetime.now(timezone.utc).isoformat()}
        store = _acquire_store(Path(root), create=create, map_size=map_size, sync=sync)
        try:
            store.grow_map(map_size or num_slots * _MAP_BYTES_PER_SLOT)
            record = store.write(lambda txn: _open_namespace(
                _NsTxn(txn, store.dbs, namespace_id), record, create=create, store=store))
        except BaseException:
            _release_store(store)
            raise
        return cls(store, record=record, clock=clock)

    def lookup_prefix(self, keys: Sequence[bytes]) -> list[DiskEntry]:
        """Entries of the longest prefix of ``keys`` that is committed, in order.

        One short read transaction. Records each hit's access in memory (applied to the
        LRU order by the next write: flush_access, allocate, commit...); writes nothing.
        """
        self._check_open()
        found: list[DiskEntry] = []
        prefix, size, unpack = self._prefix, self._committed.size, self._committed.unpack_from
        entries, new = self._dbs["entries"], tuple.__new__  # DiskEntry(...) minus a frame
        with self._store.read() as txn:
            get = txn.get
            for key in keys:
                value = get(prefix + key, db=entries)
                if value is None or len(value) != size:  # absent, or reserved
                    break
                fields = unpack(value)
                found.append(new(DiskEntry, (key, fields[0], fields[1:])))
            tick = self._tick()
            pending = self._pending
            for entry in found:
                pending[entry.key] = tick
            self._counts["hits"] += len(found)
            self._counts["misses"] += len(keys) - len(found)
        return found

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is committed. A pure query: records no access."""
        self._check_open()
        with self._store.read() as txn:
            value = txn.get(self._prefix + key, db=self._dbs["entries"])
        return value is not None and value[0] == _COMMITTED

    def pin(self, slots: Sequence[int]) -> None:
        """Increment in-memory pin counts; this process never reuses a pinned slot
        (never evicts it, never takes it from the free list)."""
        with self._store.lock:
            for slot in slots:
                self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slots: Sequence[int]) -> None:
        """Decrement pin counts. Atomic: ValueError, and no change, if one is not pinned."""
        with self._store.lock:
            need = Counter(slots)
            bad = sorted(s for s, n in need.items() if self._pins.get(s, 0) < n)
            if bad:
                raise ValueError(f"unpin of slots that are not pinned: {bad[:8]}")
            for slot, n in need.items():
                self._pins[slot] -= n
                if not self._pins[slot]:
                    del self._pins[slot]

    def allocate(self, keys: Sequence[bytes]) -> list[int | None]:
        """Reserve one slot per key about to be written; None where the store is skipped.

        None when the key is already committed or reserved (by any process), or when no
        slot can be had (all pinned or reserved; then, at most every 5 s, reservations of
        dead processes are reclaimed first). Slots come from the free list, then the
        high-water mark, then by evicting the least recently used unpinned entry
        (unpublished in the same transaction). One write transaction; atomic per call.
        """
        for key in keys:
            _check_key(key)

        def fn(op: _NsTxn) -> list[int | None]:
            record = op.record()
            if record is None:  # cleared under us: start the namespace over
                logger.warning("disk tier: namespace %s vanished; recreating", op.namespace_id)
                op.put_record(record := self._record)
            tick, out, tried_reclaim = self._tick(), [], False
            for key in keys:
                if op.get("entries", key) is not None:
                    out.append(None)
                    continue
                slot = op.take_slot(record["num_slots"], self._pins)
                if slot is None and not tried_reclaim and time.monotonic() > self._next_reclaim:
                    tried_reclaim, self._next_reclaim = True, time.monotonic() + _RECLAIM_EVERY_S
                    if op.reclaim(_alive_owner(self._store)):
                        slot = op.take_slot(record["num_slots"], self._pins)
                if slot is not None:
                    op.reserve(key, slot, self._owner, tick)
                out.append(slot)
            return out

        return self._write(fn)

    def commit(self, items: Sequence[tuple[bytes, int, tuple[int, ...]]]) -> list[bool]:
        """Publish ``key -> slot`` with per-rank checksums, for slots this index reserved.

        The caller guarantees the bytes are in every rank's slab. An item whose
        reservation is gone (released, reclaimed, namespace cleared) is not published and
        is logged; the result tells per item whether it was published. One write txn.
        """
        for key, _slot, checksums in items:
            _check_key(key)
            if len(checksums) != self._num_ranks:
                raise ValueError(f"need {self._num_ranks} checksums, got {len(checksums)}")

        def fn(op: _NsTxn) -> list[bool]:
            tick = self._tick()
            return [op.publish(key, slot, cs, tick, self._owner) for key, slot, cs in items]

        done = self._write(fn)
        lost = [(key.hex()[:16], slot) for (key, slot, _), ok in zip(items, done) if not ok]
        if lost:
            logger.warning("disk tier: %d stores lost their reservation, not published: %s",
                           len(lost), lost[:4])
        return done

    def release(self, slots: Sequence[int]) -> None:
        """Give back slots this index reserved and will not commit (a failed write); they
        go to the free list. Slots not reserved by this index are ignored. One write txn."""

        def fn(op: _NsTxn) -> None:
            for slot in slots:
                if op.owner_of(slot) == self._owner:
                    op.unreserve(slot)

        self._write(fn)

    def drop(self, key: bytes, slot: int) -> bool:
        """Unpublish ``key`` if it still maps to ``slot`` (after a failed read) and free
        the slot; True if dropped. Counts one checksum failure either way. One write txn."""
        _check_key(key)

        def fn(op: _NsTxn) -> bool:
            op.deltas["checksum_failures"] += 1
            dropped = op.unpublish(key, slot)
            if dropped:
                op.free(slot)
            return dropped

        return self._write(fn)

    def flush_access(self) -> None:
        """Write the batched access ticks and hit/miss counts in one write transaction
        (none when nothing is pending). Call periodically; every other write and close()
        flush them as well."""
        if self._pending or any(self._counts.values()):
            self._write(lambda op: None)

    def reclaim_reservations(self) -> int:
        """Free the reservations of dead processes; return how many. One write txn."""
        return self._write(lambda op: op.reclaim(_alive_owner(self._store)))

    def stats(self) -> dict:
        """Counts of this namespace: persistent counters plus this process's unflushed ones."""
        self._check_open()
        with self._store.read() as txn:
            op = _NsTxn(txn, self._dbs, self._namespace_id)
            n = {name: op.counter(name) for name in ("entries", "reserved", "free", "hwm")}
            counters = {name: op.counter(name) for name in PERSISTENT_COUNTERS}
            num_slots = (op.record() or self._record)["num_slots"]
        for name, delta in self._counts.items():
            counters[name] += delta
        return {"num_entries": n["entries"], "num_slots": num_slots,
                "used_slots": n["entries"] + n["reserved"], "reserved": n["reserved"],
                "free_listed": n["free"], "never_used": max(num_slots - n["hwm"], 0),
                "pinned": len(self._pins), "pending_accesses": len(self._pending),
                "counters": counters}

    def check(self) -> list[str]:
        """Scan the namespace; return every inconsistency (slot held twice, leaked slots,
        missing LRU or reservation records, counter drift), [] when sound. Read-only, one
        read transaction, O(entries): for tests and `kv-offload inspect`."""
        self._check_open()
        with self._store.read() as txn:
            return _NsTxn(txn, self._dbs, self._namespace_id).check()

    def close(self) -> None:
        """Flush accesses, release this index's uncommitted reservations, and close the
        environment if no other index in this process uses it. Idempotent. Stop the
        writers first: a late write into a released slot can only cause a checksum miss."""
        if self._closed:
            return
        try:
            self._write(lambda op: op.reclaim(lambda owner: owner != self._owner))
        finally:
            self._closed = True
            self._store.live_tokens.discard(self._token)
            _release_store(self._store)

    def __enter__(self) -> DiskIndex:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("operation on a closed DiskIndex")

    def _tick(self) -> int:
        """A strictly increasing access tick: the clock in microseconds."""
        self._last_tick = max(int(self._clock() * 1e6), self._last_tick + 1)
        return self._last_tick

    def _write(self, fn: Callable[[_NsTxn], object]):
        """Run ``fn`` in one write transaction after applying the pending accesses, which
        are cleared once it committed."""
        self._check_open()

        def run(txn: lmdb.Transaction):
            op = _NsTxn(txn, self._dbs, self._namespace_id)
            op.apply_accesses(self._pending, self._counts)
            result = fn(op)
            op.finish()
            return result

        with self._store.lock:
            result = self._store.write(run)
            self._pending = {}
            self._counts = dict.fromkeys(self._counts, 0)
        return result


@contextlib.contextmanager
def _existing_store(root: str | os.PathLike) -> Iterator[_Store | None]:
    """The store at ``root`` for a CLI helper, or None when there is none; never creates."""
    root = Path(root)
    if not (root / "index" / "data.mdb").exists():
        yield None
        return
    store = _acquire_store(root, create=False, map_size=None, sync=False)
    try:
        yield store
    finally:
        _release_store(store)


def list_namespaces(root: str | os.PathLike) -> list[dict]:
    """Every namespace of the store: its record, counters, and oldest/newest access in
    seconds since the epoch (None when empty). Read-only; [] when there is no store."""
    out = []
    with _existing_store(root) as store:
        if store is None:
            return []
        with store.read() as txn:
            for ns, raw in txn.cursor(db=store.dbs["namespaces"]):
                op, info = _NsTxn(txn, store.dbs, ns.decode()), json.loads(raw)
                names = ("entries", "reserved", "free", *PERSISTENT_COUNTERS)
                info["counters"] = {name: op.counter(name) for name in names}
                cursor = txn.cursor(db=store.dbs["lru"])  # "/" + 1 == "0": past the prefix
                ok = cursor.prev() if cursor.set_range(op.p[:-1] + b"0") else cursor.last()
                newest, oldest = cursor.key() if ok else b"", next(op.scan("lru"), None)
                info["oldest_access"] = _LRU_KEY.unpack(oldest[0])[0] / 1e6 if oldest else None
                info["newest_access"] = (_LRU_KEY.unpack_from(newest, len(op.p))[0] / 1e6
                                         if newest.startswith(op.p) else None)
                out.append(info)
    return out


def iter_entries(root: str | os.PathLike, namespace_id: str) -> Iterator[tuple[DiskEntry, float]]:
    """Yield (entry, last access in seconds since the epoch) for every committed entry in
    key order, reading 1024 entries per short read transaction."""
    validate_namespace_id(namespace_id)
    with _existing_store(root) as store:
        start = b""
        while store is not None:
            with store.read() as txn:
                scan = _NsTxn(txn, store.dbs, namespace_id).scan("entries", start)
                batch = list(itertools.islice(scan, 1025))
            for key, value in batch[:1024]:
                if value[0] == _COMMITTED:
                    _, slot, tick = _HEAD.unpack_from(value)
                    sums = struct.unpack_from(f"<{(len(value) - _HEAD.size) // 8}Q", value, 17)
                    yield DiskEntry(key, slot, sums), tick / 1e6
            if len(batch) <= 1024:
                return
            start = batch[1024][0]


def clear(root: str | os.PathLike, namespace_id: str | None = None) -> None:
    """Remove one namespace (index records, then slab files) or, with None, the store.

    Removes only what a store consists of (``index/``, ``slabs/``) and refuses a directory
    that is not a store. Stop the processes using it first; if not, they see misses, never
    wrong data. Namespace records are deleted in batches of 10k records per transaction.
    """
    root = Path(root)
    if namespace_id is None:
        if not (root / "index").is_dir() and not (root / "slabs").is_dir():
            raise StorePathError(f"{root} is not a kv-offload disk store (no index/ or slabs/)")
        if any(s.root.resolve() == root.resolve() for s in list(_STORES.values())):
            raise StoreError(f"the disk store {root} is open in this process; close it first")
        shutil.rmtree(root / "index")
        shutil.rmtree(root / "slabs", ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()
        return
    validate_namespace_id(namespace_id)

    def delete_batch(txn: lmdb.Transaction) -> bool:
        prefix, left = namespace_id.encode() + b"/", 10_000
        for db in ("entries", "slots", "lru", "free", "reservations", "counters"):
            cursor = txn.cursor(db=store.dbs[db])
            while left and cursor.set_range(prefix) and cursor.key().startswith(prefix):
                cursor.delete()
                left -= 1
        if left:
            txn.delete(namespace_id.encode(), db=store.dbs["namespaces"])
        return left > 0

    with _existing_store(root) as store:
        while store is not None and not store.write(delete_batch):
            pass
    shutil.rmtree(slab_dir(root, namespace_id), ignore_errors=True)
