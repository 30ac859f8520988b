"""Scheduler side of the disk tier: the LMDB index of one namespace of a disk store.

Maps chunk keys to slots (the same slot in every rank's slab) with per-rank checksums, and
keeps the LRU order, free slots, reservations of slots being written and persistent
counters. Imports lmdb, never torch or vLLM. See docs/disk-tier.md.

Records and their codecs: records.py; the shared LMDB environment: env.py; the record
changes of one namespace inside a transaction: namespace.py.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import lmdb

from kv_offload.disk.env import StoreEnv, acquire_env, release_env
from kv_offload.disk.files import validate_namespace_id
from kv_offload.disk.namespace import COMMITTED, RESERVED, NamespaceTxn, open_namespace
from kv_offload.disk.owners import alive_owner, process_identity
from kv_offload.disk.records import (
    PERSISTENT_COUNTERS,
    DiskEntry,
    EntryRecord,
    Owner,
    check_key,
    namespace_prefix,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")
MAP_BYTES_PER_SLOT = 1024  # generous index bytes per entry, to pre-size the map
RECLAIM_EVERY_S = 5.0  # at most one dead-reservation scan per index this often when full


class DiskIndex:
    """The LMDB index of one namespace of a disk store; one per process per namespace.

    Thread-safe: every method runs under the store's per-process lock (the scheduler
    thread is the intended caller). Across processes LMDB serialises writers and lookups
    never block. Pins are per process: another process may evict a slot pinned here; the
    per-rank checksums turn that into a failed read (a miss), never wrong data.

    Every record is checked before it is trusted: a lookup that meets a malformed
    entry, or one whose slot lies outside the namespace, answers a miss there and the
    next write transaction removes the record (counted in ``bad_records``, logged); its
    slot never reaches the free list.
    """

    def __init__(self, env: StoreEnv, *, record: dict, clock: Callable[[], float]) -> None:
        """Use DiskIndex.open()."""
        self._env, self._dbs, self._record = env, env.dbs, record
        self._namespace_id = record["namespace_id"]
        self._prefix = namespace_prefix(self._namespace_id)
        self._num_ranks = record["num_ranks"]
        self._num_slots = record["num_slots"]  # may grow: another process's open()
        self._committed = EntryRecord.committed(self._num_ranks)  # slot, checksums
        self._clock, self._last_tick = clock, 0
        self._token = secrets.randbits(63)
        self._owner: Owner = (os.getpid(), process_identity(os.getpid())[1], self._token)
        self._pins: dict[int, int] = {}
        self._pending: dict[bytes, int] = {}  # key -> tick of its latest unflushed access
        self._counts = {"hits": 0, "misses": 0}  # unflushed
        self._bad: dict[bytes, bytes] = {}  # key -> malformed record a lookup met
        self._removed: list[tuple[bytes, bytes | None]] = []  # take_removed
        self.track_removed = False  # keep them for take_removed (the KV events are on)
        self._next_reclaim = 0.0  # monotonic time of the next reclaim attempt when full
        self._closed = False
        env.live_tokens.add(self._token)

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
        allow_unsafe_permissions: bool = False,
    ) -> DiskIndex:
        """Open the store at ``root`` and the namespace in it, creating both if needed.

        ``num_slots = capacity_bytes // (slot_bytes * num_ranks)`` must be >= 1 (else
        ValueError). An existing namespace with another slot_bytes or num_ranks raises
        NamespaceMismatchError; a larger capacity is adopted, a smaller one is ignored with
        a warning. Reclaims reservations of dead processes. ``sync=True`` fsyncs each write
        transaction (durable against power loss); the default survives process crashes.
        The first opener in a process decides ``sync``. ``clock`` returns seconds; access
        ticks are its microseconds. StoreError subclasses for unusable stores, including
        (StorePathError) a store owned by another user or writable by group or others
        unless ``allow_unsafe_permissions``.
        """
        validate_namespace_id(namespace_id)
        for name, value in (("slot_bytes", slot_bytes), ("num_ranks", num_ranks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        num_slots = capacity_bytes // (slot_bytes * num_ranks)
        if num_slots < 1:
            raise ValueError(f"disk_size: {capacity_bytes} bytes holds no slot of {slot_bytes} "
                             f"bytes x {num_ranks} ranks (one chunk of this model); raise "
                             "disk_size or lower chunk_tokens")
        record = {"namespace_id": namespace_id, "descriptor": json.loads(json.dumps(descriptor)),
                  "slot_bytes": slot_bytes, "num_ranks": num_ranks, "num_slots": num_slots,
                  "created": datetime.now(timezone.utc).isoformat()}
        env = acquire_env(Path(root), create=create, map_size=map_size, sync=sync,
                          allow_unsafe_permissions=allow_unsafe_permissions)
        try:
            env.grow_map(map_size or num_slots * MAP_BYTES_PER_SLOT)
            record = env.write(lambda txn: open_namespace(
                NamespaceTxn(txn, env.dbs, namespace_id, root=env.root), record, create=create,
                root=env.root, keep=alive_owner(env.live_tokens)))
        except BaseException:
            release_env(env)
            raise
        return cls(env, record=record, clock=clock)

    def count_lookup(self, *, hits: int, misses: int) -> None:
        """Add one lookup's outcome to the persistent counters (in memory until the next
        write transaction)."""
        with self._env.lock:
            self._counts["hits"] += hits
            self._counts["misses"] += misses

    def find_prefix(self, keys: Sequence[bytes]) -> list[DiskEntry]:
        """Entries of the longest prefix of ``keys`` that is committed, in order.

        One short read transaction. Records each hit's access in memory (applied to the
        LRU order by the next write: flush_access, allocate, commit...); writes nothing
        and counts nothing (the planner asks again for the same request). A malformed
        record, or one whose slot lies outside the namespace, ends the prefix there and
        is removed by the next write transaction.
        """
        self._check_open()
        found: list[DiskEntry] = []
        prefix, size, unpack = self._prefix, self._committed.size, self._committed.unpack_from
        entries, new = self._dbs["entries"], tuple.__new__  # DiskEntry(...) minus a frame
        reserved_size, num_slots = EntryRecord.HEAD.size, self._num_slots
        with self._env.read() as txn:
            get = txn.get
            for key in keys:
                value = get(prefix + key, db=entries)
                if value is None:
                    break
                if len(value) != size or value[0] != COMMITTED:
                    if len(value) != reserved_size or value[0] != RESERVED:
                        self._bad[key] = value
                    break  # reserved (being written), or a bad record
                fields = unpack(value)
                if fields[0] >= num_slots and not self._slot_grown(txn, fields[0]):
                    self._bad[key] = value
                    break
                found.append(new(DiskEntry, (key, fields[0], fields[1:])))
            tick = self._tick()
            pending = self._pending
            for entry in found:
                pending[entry.key] = tick
        return found

    def _slot_grown(self, txn: lmdb.Transaction[bytes], slot: int) -> bool:
        """Whether ``slot`` lies inside the namespace as another process may have grown
        it (reads the namespace record again)."""
        op = NamespaceTxn(txn, self._dbs, self._namespace_id, root=self._env.root)
        record = op.record()
        if record is not None:
            self._num_slots = max(self._num_slots, record["num_slots"])
        return slot < self._num_slots

    def pin(self, slots: Sequence[int]) -> None:
        """Increment in-memory pin counts; this process never reuses a pinned slot
        (never evicts it, never takes it from the free list)."""
        with self._env.lock:
            for slot in slots:
                self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slots: Sequence[int]) -> None:
        """Decrement pin counts. Atomic: ValueError, and no change, if one is not pinned."""
        with self._env.lock:
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
        return self.settle(keys=keys)[1]

    def commit(self, items: Sequence[tuple[bytes, int, tuple[int, ...]]]) -> list[bool]:
        """Publish ``key -> slot`` with per-rank checksums, for slots this index reserved.

        The caller guarantees the bytes are in every rank's slab. An item whose
        reservation is gone (released, reclaimed, namespace cleared) is not published and
        is logged; the result tells per item whether it was published. One write txn.
        """
        return self.settle(commits=items)[0]

    def release(self, slots: Sequence[int]) -> None:
        """Give back slots this index reserved and will not commit (a failed write); they
        go to the free list. Slots not reserved by this index are ignored. One write txn."""
        self.settle(releases=slots)

    def settle(self, commits: Sequence[tuple[bytes, int, tuple[int, ...]]] = (),
               releases: Sequence[int] = (), keys: Sequence[bytes] = (),
               blocks: Mapping[bytes, bytes] | None = None,
               tails: Mapping[bytes, tuple[bytes, Sequence[int]]] | None = None
               ) -> tuple[list[bool], list[int | None]]:
        """``release``, ``commit`` and ``allocate`` in one write transaction, in that
        order (a released slot may be reserved again at once): the scheduler's writes of
        a step cost one transaction. Returns (published per commit, slot per key).
        ``blocks``: per committed key, its vLLM blocks record (kept with the entry, for
        its KV events: ``read_blocks``, ``take_removed``). ``tails``: per committed key that
        is a request tail, its (parent, token ids) (``tails_of``). Atomic: if any part
        raises, nothing is written."""
        for key, _slot, checksums in commits:
            check_key(key)
            if len(checksums) != self._num_ranks:
                raise ValueError(f"need {self._num_ranks} checksums, got {len(checksums)}")
        for key in keys:
            check_key(key)

        def fn(op: NamespaceTxn) -> tuple[list[bool], list[int | None]]:
            tick = self._tick()
            for slot in releases:
                if op.owner_of(slot) == self._owner:
                    op.unreserve(slot)
            done = [op.publish(key, slot, cs, tick, self._owner) for key, slot, cs in commits]
            for (key, _, _), ok in zip(commits, done):
                if ok and blocks and key in blocks:
                    op.put_blocks(key, blocks[key])
                if ok and tails and key in tails:
                    op.put_tail(key, *tails[key])
            return done, self._reserve(op, keys, tick) if keys else []

        done, slots = self._write(fn)
        lost = [(key.hex()[:16], slot) for (key, slot, _), ok in zip(commits, done) if not ok]
        if lost:
            logger.warning("disk tier: %d stores lost their reservation, not published: %s",
                           len(lost), lost[:4])
        return done, slots

    def _reserve(self, op: NamespaceTxn, keys: Sequence[bytes], tick: int
                 ) -> list[int | None]:
        """``allocate``'s part of a write transaction."""
        record = op.record()
        if record is None:  # cleared under us: start the namespace over
            logger.warning("disk tier: namespace %s vanished; recreating", op.namespace_id)
            op.put_record(record := self._record)
        tried_reclaim = False
        out: list[int | None] = []
        for key in keys:
            value = op.get("entries", key)
            if value is not None and op.parse_entry(value) is None:
                op.discard_bad(key, value)  # a bad record is replaced, never kept
            elif value is not None:
                out.append(None)
                continue
            slot = op.take_slot(record["num_slots"], self._pins)
            if slot is None and not tried_reclaim and time.monotonic() > self._next_reclaim:
                tried_reclaim, self._next_reclaim = True, time.monotonic() + RECLAIM_EVERY_S
                if op.reclaim(alive_owner(self._env.live_tokens)):
                    slot = op.take_slot(record["num_slots"], self._pins)
            if slot is not None:
                op.reserve(key, slot, self._owner, tick)
            out.append(slot)
        return out

    def drop(self, key: bytes, slot: int) -> bool:
        """Unpublish ``key`` if it still maps to ``slot`` (after a failed read) and free
        the slot; True if dropped. Counts one checksum failure either way. One write txn."""
        check_key(key)

        def fn(op: NamespaceTxn) -> bool:
            op.deltas["checksum_failures"] += 1
            dropped = op.unpublish(key, slot)
            if dropped:
                op.free(slot)
            return dropped

        return self._write(fn)

    def flush_access(self) -> None:
        """Write the batched access ticks and hit/miss counts, and remove the bad records
        lookups met, in one write transaction (none when nothing is pending). Call
        periodically; every other write and close() flush them as well."""
        if self._pending or self._bad or any(self._counts.values()):
            self._write(lambda op: None)

    def drop_bad_records(self, keys: Sequence[bytes]) -> int:
        """Remove the entries of ``keys`` that are still bad records (malformed, or a
        slot outside the namespace: ``kv-offload verify --repair``), then the slot and
        LRU records they left (``sweep_orphans``, O(records)); return how many entries
        were removed. One write transaction."""

        def fn(op: NamespaceTxn) -> int:
            dropped = 0
            for key in keys:
                value = op.get("entries", key)
                if value is not None and op.parse_entry(value) is None:
                    op.discard_bad(key, value)
                    dropped += 1
            op.sweep_orphans()
            return dropped

        return self._write(fn)

    def take_removed(self) -> list[tuple[bytes, bytes | None]]:
        """The committed keys this index unpublished since the last call (evicted,
        dropped, bad), each with its blocks record (None: stored without one); their
        records are deleted. For the disk tier's KV events."""
        out, self._removed = self._removed, []
        return out

    def read_blocks(self, after: bytes, limit: int) -> list[tuple[bytes, bytes | None]]:
        """Up to ``limit`` committed keys past ``after`` (b"": from the first), in key
        order, each with its blocks record (None: stored without one). One short read
        transaction; what the disk tier announces after a restart, in batches."""
        self._check_open()
        out: list[tuple[bytes, bytes | None]] = []
        with self._env.read() as txn:
            op = NamespaceTxn(txn, self._dbs, self._namespace_id, record=self._record,
                              root=self._env.root)
            for key, value in op.scan("entries", after + b"\0" if after else b""):
                if len(out) >= limit:
                    break
                if len(value) == self._committed.size and value[0] == COMMITTED:
                    out.append((key, op.blocks(key)))
        return out

    def tail_of(self, key: bytes) -> tuple[bytes, tuple[int, ...]] | None:
        """(parent, token ids) of ``key`` if it is a request tail (checks, ``verify``)."""
        self._check_open()
        with self._env.read() as txn:
            return NamespaceTxn(txn, self._dbs, self._namespace_id, record=self._record,
                                root=self._env.root).tail_of(key)

    def tails_of(self, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids) of the committed request tails of ``parent`` (one short read
        transaction; ``find_prefix`` of a key gives its entry)."""
        self._check_open()
        with self._env.read() as txn:
            return NamespaceTxn(txn, self._dbs, self._namespace_id, record=self._record,
                                root=self._env.root).tails_of(parent)

    def num_pending_accesses(self) -> int:
        """Hits recorded in memory and not yet written (``flush_access``)."""
        return len(self._pending)

    def stats(self) -> dict:
        """Counts of this namespace: persistent counters plus this process's unflushed ones."""
        self._check_open()
        with self._env.read() as txn:
            op = NamespaceTxn(txn, self._dbs, self._namespace_id, root=self._env.root)
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
        with self._env.read() as txn:
            return NamespaceTxn(txn, self._dbs, self._namespace_id, record=self._record,
                                root=self._env.root).check()

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
            self._env.live_tokens.discard(self._token)
            release_env(self._env)

    def __enter__(self) -> DiskIndex:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("operation on a closed DiskIndex")

    def _tick(self) -> int:
        """A strictly increasing access tick: the clock in microseconds."""
        self._last_tick = max(int(self._clock() * 1e6), self._last_tick + 1)
        return self._last_tick

    def _write(self, fn: Callable[[NamespaceTxn], T]) -> T:
        """Run ``fn`` in one write transaction after removing the bad records lookups met
        and applying the pending accesses, which are cleared once it committed."""
        self._check_open()
        num_bad = 0

        def run(txn: lmdb.Transaction[bytes]) -> T:
            nonlocal num_bad
            op = NamespaceTxn(txn, self._dbs, self._namespace_id, record=self._record,
                              root=self._env.root)
            for key, value in self._bad.items():
                if op.get("entries", key) == value:
                    op.discard_bad(key, value)
            op.apply_accesses(self._pending, self._counts)
            result = fn(op)
            num_bad = op.deltas.get("bad_records", 0)
            op.finish()
            removed[:] = op.removed
            return result

        removed: list[tuple[bytes, bytes | None]] = []
        with self._env.lock:
            result = self._env.write(run)
            if self.track_removed:
                self._removed += removed
            self._pending, self._bad = {}, {}
            self._counts = dict.fromkeys(self._counts, 0)
        if num_bad:
            logger.warning("disk tier: removed %d bad index record(s) of namespace %s (cut "
                           "short, or naming a slot outside the slab); each was a miss",
                           num_bad, self._namespace_id)
        return result
