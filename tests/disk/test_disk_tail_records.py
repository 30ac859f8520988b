"""Request tail records of the disk index (issue 33) under damage: invariant 9, one bad
record costs one miss, never the disk tier."""

from __future__ import annotations

import lmdb

from kv_offload.disk import DiskIndex
from kv_offload.disk.namespace import namespace_prefix
from kv_offload.disk.records import TAIL_KEY_TAG, TAIL_TAG

SLOT = 64


def open_index(root) -> DiskIndex:
    return DiskIndex.open(root, namespace_id="ab", descriptor={"model": "toy"},
                          slot_bytes=SLOT, num_ranks=1, capacity_bytes=3 * SLOT)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def damage(root, name: bytes, value: bytes) -> None:
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(namespace_prefix("ab") + name, value, db=env.open_db(b"counters", txn=txn))
    env.close()


def test_a_damaged_tail_parent_record_is_dropped_with_its_entry(tmp_path):
    """A tail's parent record (``TAIL_KEY_TAG``) damaged to a value no parent has: the
    entry is still evicted, dropped and looked up without an error."""
    root = tmp_path / "store"
    index = open_index(root)
    (slot,) = index.allocate([key(1)])
    index.settle([(key(1), slot, (1,))], tails={key(1): (b"p" * 32, (5, 6, 7))})
    index.close()
    damage(root, TAIL_KEY_TAG + key(1), b"x" * 300)
    index = open_index(root)
    try:
        assert index.tail_of(key(1)) is None
        for i in (2, 3, 4):  # the third evicts key(1), the least recently used
            (slot,) = index.allocate([key(i)])
            index.settle([(key(i), slot, (i,))])
        assert index.find_prefix([key(1)]) == []
        assert index.check() == []
    finally:
        index.close()


def test_a_bad_lru_record_naming_a_tail_drops_its_tail_records(tmp_path):
    """An ``lru`` record one byte too long (damage) names a committed tail at its slot.
    Eviction meets it first, removes it and the entry it names: the tail's records go
    with the entry (before the fix they stayed, and ``tail_of`` still offered the tail
    of an entry that was gone), the removal is reported for the KV events, and its slot
    goes back to the free list."""
    root = tmp_path / "store"
    index = open_index(root)
    (slot,) = index.allocate([key(1)])
    index.settle([(key(1), slot, (1,))], tails={key(1): (b"p" * 32, (5, 6, 7))})
    index.close()
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        lru = env.open_db(b"lru", txn=txn)
        ((name, value),) = [(k, v) for k, v in txn.cursor(db=lru)
                            if k.startswith(namespace_prefix("ab"))]
        txn.delete(name, db=lru)
        tick_and_slot = name[len(namespace_prefix("ab")):]
        txn.put(namespace_prefix("ab") + b"\0" + tick_and_slot, value, db=lru)
    env.close()
    index = open_index(root)
    index.track_removed = True
    try:
        for i in (2, 3, 4):  # the third meets the bad record (the first in LRU order)
            (new,) = index.allocate([key(i)])
            index.settle([(key(i), new, (i,))])
        assert index.find_prefix([key(1)]) == []
        assert index.tail_of(key(1)) is None
        assert index.tails_of(b"p" * 32) == []
        assert key(1) in [k for k, _ in index.take_removed()]
        assert index.stats()["counters"]["bad_records"] == 1
        assert index.check() == []
    finally:
        index.close()
    with lmdb.open(str(root / "index"), max_dbs=16, readonly=True) as env, \
            env.begin() as txn:
        counters = env.open_db(b"counters", txn=txn, create=False)
        left = [k for k, _ in txn.cursor(db=counters) if TAIL_TAG in k or TAIL_KEY_TAG in k]
    assert left == []
