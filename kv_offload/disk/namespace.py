"""One namespace's records inside one LMDB transaction: reserve, publish, evict, free,
reclaim and check. The state changes DiskIndex makes, each a few record writes.

An entry is RESERVED (a slot being written, invisible) or COMMITTED (visible, in the LRU
order); ``slots`` names the key of every reserved or committed slot, ``free`` lists
released slots below the high-water mark ``hwm``. Counter changes collect in ``deltas``
until ``finish()``.

Every record read is checked before it is trusted (invariant 9): an entry of the wrong
size or state, or whose slot lies outside the namespace (``slot_ok``), is treated as
absent, and a slot outside the namespace never reaches the free list or a reservation.
Such records are removed where they are met (``discard_bad``, ``take_slot``) and counted
in ``bad_records``: one bad record costs one miss.
"""

from __future__ import annotations

import itertools
import logging
import struct
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from kv_offload.disk.env import clear_hint
from kv_offload.disk.errors import NamespaceMismatchError, StoreCorruptError, StoreError
from kv_offload.disk.records import (
    BLOCKS_TAG,
    TAIL_KEY_TAG,
    TAIL_TAG,
    CounterRecord,
    EntryRecord,
    EntryState,
    LruKey,
    NamespaceRecord,
    Owner,
    OwnerRecord,
    SlotKey,
    namespace_prefix,
)

logger = logging.getLogger(__name__)

RESERVED, COMMITTED = EntryState.RESERVED, EntryState.COMMITTED


class NamespaceTxn:
    """The records of one namespace inside one LMDB transaction. Lives as long as its
    transaction, on its thread; writes only through that transaction.

    ``record``: the namespace record as the caller knows it (its rank count and a lower
    bound of its slot count), saving a read; ``root`` names the store in messages.
    """

    def __init__(self, txn: lmdb.Transaction[bytes], dbs: dict, namespace_id: str, *,
                 record: dict | None = None, root: object = None) -> None:
        self.txn, self.dbs, self.namespace_id, self.root = txn, dbs, namespace_id, root
        self.p = namespace_prefix(namespace_id)
        self.deltas: dict[str, int] = defaultdict(int)
        self.hwm: int | None = None  # cached high-water mark (take_slot)
        self.free_exhausted = False  # the free list has no unpinned slot (take_slot)
        self.removed: list[tuple[bytes, bytes | None]] = []  # committed keys gone, blocks
        self._num_ranks: int | None = record["num_ranks"] if record else None
        self._num_slots: int = record["num_slots"] if record else 0

    def get(self, db: str, key: bytes) -> bytes | None:
        return self.txn.get(self.p + key, db=self.dbs[db])

    def put(self, db: str, key: bytes, value: bytes) -> None:
        self.txn.put(self.p + key, value, db=self.dbs[db])

    def delete(self, db: str, key: bytes) -> None:
        self.txn.delete(self.p + key, db=self.dbs[db])

    def record(self) -> dict | None:
        """The namespace record; None if there is none. StoreCorruptError if damaged."""
        raw = self.txn.get(self.namespace_id.encode(), db=self.dbs["namespaces"])
        try:
            record = NamespaceRecord.unpack(raw)
        except ValueError as exc:
            where = f" in {self.root}" if self.root else ""
            raise StoreCorruptError(
                f"the index record of namespace {self.namespace_id}{where} is damaged "
                f"({exc}); " + (clear_hint(self.root) if isinstance(self.root, Path) else
                                "the store is only a cache: clear it")) from None
        if record is not None:
            self._num_ranks, self._num_slots = record["num_ranks"], record["num_slots"]
        return record

    def slot_ok(self, slot: int) -> bool:
        """Whether ``slot`` lies inside the namespace. Beyond the slot count known so far
        the record is read again: another process may have grown the namespace."""
        if 0 <= slot < self._num_slots:
            return True
        record = self.record()
        return record is not None and 0 <= slot < record["num_slots"]

    def parse_entry(self, value: bytes) -> tuple[EntryState, int, int] | None:
        """(state, slot, tick) of an ``entries`` value; None when it is malformed or its
        slot lies outside the namespace (or the namespace has no record)."""
        if self._num_ranks is None and self.record() is None:
            return None
        parsed = EntryRecord.parse(value, self._num_ranks or 0)
        return parsed if parsed is not None and self.slot_ok(parsed[1]) else None

    def why_bad(self, value: bytes) -> str:
        """Why ``parse_entry`` refuses an ``entries`` value, for messages."""
        parsed = EntryRecord.parse(value, self._num_ranks or 0)
        if parsed is not None:
            return f"slot {parsed[1]} lies outside the namespace's {self._num_slots} slots"
        if len(value) < EntryRecord.HEAD.size:
            return f"cut short: {len(value)} bytes"
        if value[0] not in (RESERVED, COMMITTED):
            return f"unknown state {value[0]}"
        size = EntryRecord.HEAD.size + (8 * (self._num_ranks or 0) if value[0] else 0)
        return f"{len(value)} bytes where a {EntryState(value[0]).name.lower()} record has {size}"

    def blocks(self, key: bytes) -> bytes | None:
        """The stored vLLM blocks record of ``key`` (records.py, ``BLOCKS_TAG``)."""
        return self.get("counters", BLOCKS_TAG + key)

    def put_blocks(self, key: bytes, raw: bytes) -> None:
        self.put("counters", BLOCKS_TAG + key, raw)

    def _forget_blocks(self, key: bytes) -> None:
        """``key`` stops being loadable: note it in ``removed`` with its blocks record,
        which is deleted, and delete its tail records (``put_tail``) if it is a tail."""
        raw = self.blocks(key)
        if raw is not None:
            self.delete("counters", BLOCKS_TAG + key)
        self.removed.append((key, raw))
        parent = self.get("counters", TAIL_KEY_TAG + key)
        if parent is not None:
            self.delete("counters", TAIL_KEY_TAG + key)
            if len(parent) <= MAX_PARENT:  # else damaged: no tail record names it
                self.delete("counters", _tail_prefix(parent) + key)

    def put_tail(self, key: bytes, parent: bytes, tokens: Sequence[int]) -> None:
        """Record that committed entry ``key`` is a request tail of ``parent`` holding
        ``tokens`` (records.py, ``TAIL_TAG``)."""
        self.put("counters", _tail_prefix(parent) + key,
                 struct.pack(f"<{len(tokens)}I", *tokens))
        self.put("counters", TAIL_KEY_TAG + key, parent)

    def num_tails(self) -> int:
        """How many committed entries are request tails (a scan of their records)."""
        return sum(1 for name, _ in itertools.takewhile(
            lambda item: item[0].startswith(TAIL_KEY_TAG), self.scan("counters", TAIL_KEY_TAG)))

    def tail_of(self, key: bytes) -> tuple[bytes, tuple[int, ...]] | None:
        """(parent, token ids) of ``key`` if it is a recorded tail."""
        parent = self.get("counters", TAIL_KEY_TAG + key)
        found = dict(self.tails_of(parent)) if parent is not None else {}
        return (parent, found[key]) if parent is not None and key in found else None

    def tails_of(self, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token ids) of the tails recorded under ``parent``; a record that does not
        parse is skipped (invariant 9)."""
        if len(parent) > MAX_PARENT:  # a damaged parent record (``tail_of``)
            return []
        prefix = _tail_prefix(parent)
        out = []
        for name, value in self.scan("counters", prefix):
            if not name.startswith(prefix):
                break
            key = name[len(prefix):]
            if key and len(value) % 4 == 0 and 0 < len(value) // 4 <= 1 << 20:
                out.append((key, struct.unpack(f"<{len(value) // 4}I", value)))
        return out

    def discard_bad(self, key: bytes, value: bytes) -> None:
        """Remove the malformed entries record ``value`` of ``key`` and the records that
        name it; count it in ``bad_records``. Its slot goes back to the free list only if
        it lies inside the namespace and this record alone held it."""
        self.delete("entries", key)
        self._forget_blocks(key)
        self.deltas["bad_records"] += 1
        if len(value) < EntryRecord.HEAD.size:
            return
        _, slot, tick = EntryRecord.head(value)
        if self.get("slots", SlotKey.pack(slot)) != key:
            return
        self.delete("slots", SlotKey.pack(slot))
        if self.get("lru", LruKey.pack(tick, slot)) == key:
            self.delete("lru", LruKey.pack(tick, slot))
            self.deltas["entries"] -= 1
        if self.get("reservations", SlotKey.pack(slot)) is not None:
            self.delete("reservations", SlotKey.pack(slot))
            self.deltas["reserved"] -= 1
        if self.slot_ok(slot):
            self.free(slot)

    def put_record(self, record: dict) -> None:
        self.txn.put(self.namespace_id.encode(), NamespaceRecord.pack(record),
                     db=self.dbs["namespaces"])

    def counter(self, name: str) -> int:
        return CounterRecord.unpack(self.get("counters", name.encode())) + self.deltas.get(name, 0)

    def finish(self) -> None:
        """Write the counter deltas."""
        for name, delta in list(self.deltas.items()):
            if delta:
                self.put("counters", name.encode(), CounterRecord.pack(max(self.counter(name), 0)))
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
            parsed = None if value is None else self.parse_entry(value)
            if value is None or parsed is None or parsed[0] != COMMITTED:
                continue
            _, slot, old = parsed
            if tick > old:
                self.delete("lru", LruKey.pack(old, slot))
                self.put("lru", LruKey.pack(tick, slot), key)
                self.put("entries", key, EntryRecord.with_tick(value, tick))
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
        """The first unpinned slot of the ``free`` list or the ``lru`` order, removed
        from it. A record that is malformed or names a slot outside the namespace is
        removed on the way and counted (``bad_records``), never handed out."""
        cursor = self.txn.cursor(db=self.dbs[db])
        key_len = len(self.p) + (SlotKey.STRUCT.size if db == "free" else LruKey.STRUCT.size)
        found = cursor.set_range(self.p)
        while found:
            key, value = cursor.key(), cursor.value()
            if not key.startswith(self.p):
                return None
            slot = SlotKey.unpack(key)
            if len(key) != key_len or not self.slot_ok(slot):
                cursor.delete()  # moves to the next record (b"" past the last)
                self._forget_listed(db, value, slot)
                found = cursor.key() != b""
                continue
            if slot not in pins:
                cursor.delete()
                if db == "lru":  # an eviction; reserve() overwrites the slots record
                    self._evict_entry(value, slot)
                return slot
            found = cursor.next()
        return None

    def _evict_entry(self, key: bytes, slot: int) -> None:
        """Unpublish the entry an ``lru`` record of ``slot`` named; an entry at another
        slot (the record was left behind by a bad record) stays."""
        value = self.get("entries", key)
        parsed = None if value is None else self.parse_entry(value)
        if value is not None and (parsed is None or parsed[1] == slot):
            self.delete("entries", key)
            self._forget_blocks(key)
            if parsed is None:
                self.deltas["bad_records"] += 1
        self.deltas["entries"] -= 1
        self.deltas["evictions"] += 1

    def sweep_orphans(self) -> int:
        """Remove the ``lru`` and ``slots`` records that name no entry at their slot (a
        bad record removed, its records found by a damaged head) and free their slots;
        how many. O(records): for ``kv-offload verify --repair``."""
        def entry_at(key: bytes) -> tuple[EntryState, int, int] | None:
            value = self.get("entries", key)
            return None if value is None else self.parse_entry(value)

        removed = 0
        for key, value in list(self.scan("lru")):
            tick, slot = LruKey.STRUCT.unpack(key) if len(key) == 16 else (-1, -1)
            if entry_at(value) != (COMMITTED, slot, tick):
                self.delete("lru", key)
                self.deltas["entries"] -= 1
                removed += 1
                slot_key = SlotKey.pack(max(slot, 0))
                if (self.slot_ok(slot) and self.get("slots", slot_key) is None
                        and self.get("free", slot_key) is None):
                    self.free(slot)
        for key, value in list(self.scan("slots")):
            slot = SlotKey.unpack(key) if len(key) == 8 else -1
            entry = entry_at(value)
            if entry is None or entry[1] != slot:
                self.delete("slots", key)
                removed += 1
                if self.slot_ok(slot) and self.get("free", key) is None:
                    self.free(slot)
        return removed

    def _forget_listed(self, db: str, value: bytes, slot: int) -> None:
        """Counters and cross-records of a bad ``free`` or ``lru`` record just deleted.
        For ``lru``: the entry it names at ``slot`` (or a bad one) is removed with its
        blocks and tail records (``_forget_blocks``), and a slot its ``slots`` record
        held goes back to the free list if it lies inside the namespace."""
        self.deltas["bad_records"] += 1
        self.deltas["free" if db == "free" else "entries"] -= 1
        if db == "lru":  # value: the key of the entry it listed
            entry = self.get("entries", value)
            if entry is not None and (self.parse_entry(entry) is None
                                      or EntryRecord.head(entry)[1] == slot):
                self.delete("entries", value)
                self._forget_blocks(value)
            if slot >= 0 and self.get("slots", SlotKey.pack(slot)) == value:
                self.delete("slots", SlotKey.pack(slot))
                if self.slot_ok(slot) and self.owner_of(slot) is None:  # else unreserve() does
                    self.free(slot)

    def reserve(self, key: bytes, slot: int, owner: Owner, tick: int) -> None:
        self.put("entries", key, EntryRecord.pack(RESERVED, slot, tick))
        self.put("slots", SlotKey.pack(slot), key)
        self.put("reservations", SlotKey.pack(slot), OwnerRecord.pack(owner, time.time()))
        self.deltas["reserved"] += 1

    def owner_of(self, slot: int) -> Owner | None:
        raw = self.get("reservations", SlotKey.pack(slot))
        return None if raw is None else OwnerRecord.owner(raw)

    def _entry_at(self, key: bytes, state: EntryState, slot: int) -> bytes | None:
        """The entries record of ``key`` if it is well-formed, in ``state`` at ``slot``."""
        value = self.get("entries", key)
        parsed = None if value is None else self.parse_entry(value)
        if parsed is None:
            return None
        now_state, now_slot, _ = parsed
        return value if now_state == state and now_slot == slot else None

    def publish(self, key: bytes, slot: int, checksums: Sequence[int], tick: int,
                owner: Owner) -> bool:
        """Turn ``owner``'s reservation of ``slot`` for ``key`` into a committed entry."""
        if self._entry_at(key, RESERVED, slot) is None or self.owner_of(slot) != owner:
            return False
        self.put("entries", key, EntryRecord.pack(COMMITTED, slot, tick, tuple(checksums)))
        self.put("lru", LruKey.pack(tick, slot), key)
        self.delete("reservations", SlotKey.pack(slot))
        for name, n in (("reserved", -1), ("entries", 1), ("commits", 1)):
            self.deltas[name] += n
        return True

    def unreserve(self, slot: int) -> None:
        """Forget the reservation of ``slot`` and put the slot on the free list; a stray
        reservation record of a committed slot (damage) is only deleted."""
        key = self.get("slots", SlotKey.pack(slot))
        self.delete("reservations", SlotKey.pack(slot))
        if key is not None and self._entry_at(key, COMMITTED, slot) is not None:
            self.deltas["bad_records"] += 1
            return
        self.delete("slots", SlotKey.pack(slot))
        if key is not None and self._entry_at(key, RESERVED, slot) is not None:
            self.delete("entries", key)
        self.deltas["reserved"] -= 1
        self.free(slot)

    def unpublish(self, key: bytes, slot: int) -> bool:
        """Remove ``key`` if it is committed at ``slot``; the caller decides the slot's fate."""
        value = self._entry_at(key, COMMITTED, slot)
        if value is None:
            return False
        self.delete("entries", key)
        self.delete("lru", LruKey.pack(EntryRecord.head(value)[2], slot))
        self.delete("slots", SlotKey.pack(slot))
        self._forget_blocks(key)
        self.deltas["entries"] -= 1
        return True

    def free(self, slot: int) -> None:
        """Put ``slot`` on the free list; a slot outside the namespace (from a damaged
        record) is counted in ``bad_records`` instead."""
        if not self.slot_ok(slot):
            self.deltas["bad_records"] += 1
            return
        self.put("free", SlotKey.pack(slot), b"")
        self.deltas["free"] += 1
        self.free_exhausted = False

    def reclaim(self, keep: Callable[[Owner], bool]) -> int:
        """Unreserve every reservation whose owner ``keep`` rejects, or whose record is
        malformed; return how many."""
        doomed, malformed = [], []
        for key, raw in self.scan("reservations"):
            owner = OwnerRecord.owner(raw)
            if len(key) != SlotKey.STRUCT.size:
                malformed.append(key)
            elif owner is None or not keep(owner):
                doomed.append(SlotKey.unpack(key))
        for key in malformed:
            self.delete("reservations", key)
            self.deltas["bad_records"] += 1
        for slot in doomed:
            self.unreserve(slot)
        self.deltas["reclaimed"] += len(doomed)
        return len(doomed)

    def check(self, *, list_bad_records: bool = True) -> list[str]:
        """Every cross-reference violation in this namespace (see DiskIndex.check); bad
        entry records too unless not ``list_bad_records`` (verify lists them itself)."""
        problems: list[str] = []
        holder: dict[int, bytes] = {}
        found = {"entries": 0, "reserved": 0}
        for key, value in self.scan("entries"):
            parsed = self.parse_entry(value)
            if parsed is None:
                if list_bad_records:
                    problems.append(f"entry {key.hex()} is a bad record ({self.why_bad(value)})")
                continue
            state, slot, tick = parsed
            if slot in holder:
                problems.append(f"slot {slot} held by {holder[slot].hex()} and {key.hex()}")
            holder[slot] = key
            if self.get("slots", SlotKey.pack(slot)) != key:
                problems.append(f"slots record of slot {slot} does not name {key.hex()}")
            if state == COMMITTED and self.get("lru", LruKey.pack(tick, slot)) != key:
                problems.append(f"committed {key.hex()} is missing from the LRU order")
            if state == RESERVED and self.owner_of(slot) is None:
                problems.append(f"reserved {key.hex()} has no reservation record")
            found["entries" if state == COMMITTED else "reserved"] += 1
        free = {SlotKey.unpack(k) for k, _ in self.scan("free")}
        problems += [f"free slot {s} lies outside the namespace"
                     for s in sorted(free) if not self.slot_ok(s)]
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


def open_namespace(op: NamespaceTxn, record: dict, *, create: bool, root: object,
                   keep: Callable[[Owner], bool]) -> dict:
    """Create or validate the namespace record, then reclaim the reservations ``keep``
    rejects (those of dead processes); return the stored record. ``root`` names the
    store in messages."""
    ns, stored = op.namespace_id, op.record()
    if stored is None:
        if not create:
            raise StoreError(f"namespace {ns} does not exist in the disk store {root}")
        op.put_record(stored := record)
    for name in ("slot_bytes", "num_ranks"):
        if stored[name] != record[name]:
            raise NamespaceMismatchError(
                f"namespace {ns} exists in the disk store {root} with {name}="
                f"{stored[name]}, but this process asks for {name}={record[name]}; the namespace "
                f"fingerprint should cover the KV layout. Run `kv-offload clear {root} "
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
    reclaimed = op.reclaim(keep)
    if reclaimed:
        logger.info("disk tier: reclaimed %d slots reserved by dead processes", reclaimed)
    op.finish()
    return stored


MAX_PARENT = 255
"""The longest parent a tail record can name (one length byte, ``_tail_prefix``)."""


def _tail_prefix(parent: bytes) -> bytes:
    return TAIL_TAG + bytes([len(parent)]) + parent
