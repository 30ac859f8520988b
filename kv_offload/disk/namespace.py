"""One namespace's records inside one LMDB transaction: reserve, publish, evict, free,
reclaim and check. The state changes DiskIndex makes, each a few record writes.

An entry is RESERVED (a slot being written, invisible) or COMMITTED (visible, in the LRU
order); ``slots`` names the key of every reserved or committed slot, ``free`` lists
released slots below the high-water mark ``hwm``. Counter changes collect in ``deltas``
until ``finish()``.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import lmdb

from kv_offload.disk.errors import NamespaceMismatchError, StoreError
from kv_offload.disk.records import (
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
    transaction, on its thread; writes only through that transaction."""

    def __init__(self, txn: lmdb.Transaction[bytes], dbs: dict, namespace_id: str) -> None:
        self.txn, self.dbs, self.namespace_id = txn, dbs, namespace_id
        self.p = namespace_prefix(namespace_id)
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
        return NamespaceRecord.unpack(
            self.txn.get(self.namespace_id.encode(), db=self.dbs["namespaces"]))

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
            if value is None or value[0] != COMMITTED:
                continue
            _, slot, old = EntryRecord.head(value)
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
        cursor = self.txn.cursor(db=self.dbs[db])
        if not cursor.set_range(self.p):
            return None
        for key, value in cursor:
            if not key.startswith(self.p):
                return None
            slot = SlotKey.unpack(key)
            if slot not in pins:
                cursor.delete()
                if db == "lru":  # an eviction; reserve() overwrites the slots record
                    self.delete("entries", value)
                    self.deltas["entries"] -= 1
                    self.deltas["evictions"] += 1
                return slot
        return None

    def reserve(self, key: bytes, slot: int, owner: Owner, tick: int) -> None:
        self.put("entries", key, EntryRecord.pack(RESERVED, slot, tick))
        self.put("slots", SlotKey.pack(slot), key)
        self.put("reservations", SlotKey.pack(slot), OwnerRecord.pack(owner, time.time()))
        self.deltas["reserved"] += 1

    def owner_of(self, slot: int) -> Owner | None:
        raw = self.get("reservations", SlotKey.pack(slot))
        return None if raw is None else OwnerRecord.owner(raw)

    def _entry_at(self, key: bytes, state: EntryState, slot: int) -> bytes | None:
        """The entries record of ``key`` if it is in ``state`` at ``slot``, else None."""
        value = self.get("entries", key)
        if value is None:
            return None
        now_state, now_slot, _ = EntryRecord.head(value)
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
        """Forget the reservation of ``slot`` and put the slot on the free list."""
        key = self.get("slots", SlotKey.pack(slot))
        self.delete("reservations", SlotKey.pack(slot))
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
        self.deltas["entries"] -= 1
        return True

    def free(self, slot: int) -> None:
        self.put("free", SlotKey.pack(slot), b"")
        self.deltas["free"] += 1
        self.free_exhausted = False

    def reclaim(self, keep: Callable[[Owner], bool]) -> int:
        """Unreserve every reservation whose owner ``keep`` rejects; return how many."""
        doomed = [SlotKey.unpack(slot) for slot, raw in self.scan("reservations")
                  if not keep(OwnerRecord.owner(raw))]
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
            state, slot, tick = EntryRecord.head(value)
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
