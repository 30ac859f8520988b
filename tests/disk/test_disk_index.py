"""Contracts of DiskIndex: visibility, reservations, pins, LRU order, namespaces, reopen."""

from __future__ import annotations

import logging
import random
import threading

import pytest

from kv_offload.disk import (
    DiskIndex,
    NamespaceMismatchError,
    StoreError,
    StorePathError,
    clear,
    iter_entries,
    list_namespaces,
)

SLOT = 64


class FakeClock:
    """Seconds that advance by one millisecond per call: distinct, ordered ticks."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


def make_index(root, *, namespace_id="ab", num_slots=8, num_ranks=1, slot_bytes=SLOT, **kw):
    return DiskIndex.open(
        root, namespace_id=namespace_id, descriptor={"model": "toy", "ns": namespace_id},
        slot_bytes=slot_bytes, num_ranks=num_ranks,
        capacity_bytes=num_slots * slot_bytes * num_ranks, **kw,
    )


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def store(index: DiskIndex, keys, num_ranks: int = 1) -> list[int | None]:
    """Allocate and commit ``keys`` with made-up checksums; return the slots."""
    slots = index.allocate(keys)
    index.commit([(k, s, (s,) * num_ranks) for k, s in zip(keys, slots) if s is not None])
    return slots


@pytest.fixture
def index(tmp_path):
    ix = make_index(tmp_path / "store", clock=FakeClock())
    yield ix
    assert ix.check() == []
    ix.close()


def test_key_visible_only_after_commit(index):
    """Invariant 1: a reserved key is invisible to lookups until commit."""
    (slot,) = index.allocate([key(1)])
    assert slot is not None
    assert index.find_prefix([key(1)]) == []
    assert index.commit([(key(1), slot, (123,))]) == [True]
    (entry,) = index.find_prefix([key(1)])
    assert (entry.key, entry.slot, entry.checksums) == (key(1), slot, (123,))


def test_lookup_returns_longest_present_prefix(index):
    store(index, [key(1), key(2), key(4)])
    found = index.find_prefix([key(1), key(2), key(3), key(4)])
    assert [e.key for e in found] == [key(1), key(2)]
    assert index.find_prefix([]) == []


def test_allocate_skips_present_and_reserved_keys(index):
    first = index.allocate([key(1), key(1)])
    assert first[0] is not None and first[1] is None
    assert index.allocate([key(1)]) == [None]  # still reserved
    index.commit([(key(1), first[0], (0,))])
    assert index.allocate([key(1)]) == [None]  # now present


def test_reserved_slot_never_handed_out_twice(index):
    """Reserved slots are neither free nor evictable: a full reservation set means None."""
    slots = index.allocate([key(i) for i in range(8)])
    assert sorted(slots) == list(range(8))
    assert index.allocate([key(100)]) == [None]
    assert index.stats()["reserved"] == 8


def test_random_operations_keep_slots_unique(index, tmp_path):
    """Regression net: any mix of allocate/commit/release/drop/lookup keeps the index sound."""
    rng = random.Random(7)
    reserved: dict[int, bytes] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            keys = [key(rng.randrange(40)) for _ in range(rng.randint(1, 4))]
            for k, s in zip(keys, index.allocate(keys)):
                if s is not None:
                    assert s not in reserved, "slot handed out twice"
                    reserved[s] = k
        elif op < 0.7 and reserved:
            slot = rng.choice(list(reserved))
            assert index.commit([(reserved.pop(slot), slot, (slot,))]) == [True]
        elif op < 0.8 and reserved:
            slot = rng.choice(list(reserved))
            del reserved[slot]
            index.release([slot])
        elif op < 0.9:
            for entry in index.find_prefix([key(rng.randrange(40))]):
                assert entry.slot not in reserved
                index.drop(entry.key, entry.slot)
        else:
            index.find_prefix([key(rng.randrange(40)) for _ in range(3)])
        assert index.check() == []
    held = [e.slot for e, _ in iter_entries(tmp_path / "store", "ab")] + list(reserved)
    assert len(held) == len(set(held))


def test_pinned_slot_never_evicted(index):
    """Invariant 2: pinned slots are never chosen as victims, even when they are oldest."""
    slots = store(index, [key(i) for i in range(8)])
    index.pin(slots[:3])
    new = index.allocate([key(100 + i) for i in range(6)])
    assert new[:5] == slots[3:] and new[5] is None
    first_three = [key(0), key(1), key(2)]
    assert [e.key for e in index.find_prefix(first_three)] == first_three
    index.unpin(slots[:3])
    assert index.allocate([key(200)]) == [slots[0]]


def test_unpin_is_atomic_and_checked(index):
    index.pin([1, 1, 2])
    with pytest.raises(ValueError, match="not pinned"):
        index.unpin([1, 3])
    index.unpin([1, 1, 2])
    assert index.stats()["pinned"] == 0


def test_lru_eviction_follows_access_ticks(index):
    """Victims go in order of last access; a lookup refreshes an entry's position."""
    slots = store(index, [key(i) for i in range(8)])
    index.find_prefix([key(0)])
    index.find_prefix([key(3), key(4)])
    victims = index.allocate([key(100 + i) for i in range(8)])
    assert victims == [slots[i] for i in (1, 2, 5, 6, 7, 0, 3, 4)]


def test_access_ticks_batched_until_flush(tmp_path):
    """A hit costs no write transaction; flush_access (or close) persists the order."""
    clock = FakeClock()
    ix = make_index(tmp_path, num_slots=4, clock=clock)
    slots = store(ix, [key(i) for i in range(4)])
    ix.find_prefix([key(0)])
    ix.find_prefix([key(1)])
    ix.count_lookup(hits=2, misses=0)
    assert ix.stats()["pending_accesses"] == 2
    ix.flush_access()
    stats = ix.stats()
    assert stats["pending_accesses"] == 0 and stats["counters"]["hits"] == 2
    ix.find_prefix([key(2)])
    ix.close()
    ix = make_index(tmp_path, num_slots=4, clock=clock)
    assert ix.allocate([key(9)]) == [slots[3]]
    assert ix.allocate([key(10)]) == [slots[0]]
    ix.close()


def test_namespaces_never_see_each_others_keys(tmp_path):
    """Invariant 4: one store, two namespaces, same key: independent entries and slots."""
    a = make_index(tmp_path, namespace_id="aa")
    b = make_index(tmp_path, namespace_id="bb", num_slots=4)
    (slot_a,) = store(a, [key(1)])
    assert b.find_prefix([key(1)]) == []
    (slot_b,) = store(b, [key(1)])
    assert slot_a == slot_b == 0
    clear(tmp_path, "aa")
    assert a.find_prefix([key(1)]) == [] and len(b.find_prefix([key(1)])) == 1
    by_id = {ns["namespace_id"]: ns for ns in list_namespaces(tmp_path)}
    assert set(by_id) == {"bb"} and by_id["bb"]["counters"]["entries"] == 1
    assert by_id["bb"]["descriptor"] == {"model": "toy", "ns": "bb"}
    assert a.allocate([key(2)]) == [0]  # a cleared namespace is recreated on demand
    a.close()
    b.close()


def test_reopen_with_different_layout_is_a_clear_error(tmp_path):
    make_index(tmp_path).close()
    with pytest.raises(NamespaceMismatchError, match="slot_bytes=64.*slot_bytes=128.*clear"):
        make_index(tmp_path, slot_bytes=128)
    with pytest.raises(NamespaceMismatchError, match="num_ranks"):
        make_index(tmp_path, num_ranks=2, num_slots=4)
    make_index(tmp_path).close()  # the failed opens left the store usable


def test_capacity_grows_but_never_shrinks(tmp_path, caplog):
    make_index(tmp_path, num_slots=4).close()
    ix = make_index(tmp_path, num_slots=6)
    assert ix.stats()["num_slots"] == 6
    ix.close()
    with caplog.at_level(logging.WARNING):
        ix = make_index(tmp_path, num_slots=2)
    assert ix.stats()["num_slots"] == 6 and "shrinking is not supported" in caplog.text
    ix.close()


def test_entries_and_counters_survive_reopen(tmp_path):
    ix = make_index(tmp_path)
    store(ix, [key(1), key(2)])
    assert len(ix.find_prefix([key(1), key(3)])) == 1
    ix.count_lookup(hits=1, misses=1)
    ix.close()
    ix = make_index(tmp_path)
    assert [e.key for e in ix.find_prefix([key(1), key(2)])] == [key(1), key(2)]
    ix.count_lookup(hits=2, misses=0)
    counters = ix.stats()["counters"]
    assert (counters["hits"], counters["misses"], counters["commits"]) == (3, 1, 2)
    ix.close()


def test_list_namespaces_reports_oldest_and_newest_access(tmp_path):
    clock = FakeClock()
    ix = make_index(tmp_path, clock=clock)
    store(ix, [key(1)])
    first = clock.now
    store(ix, [key(2)])
    ix.find_prefix([key(2)])
    ix.count_lookup(hits=1, misses=0)
    ix.close()
    (info,) = list_namespaces(tmp_path)
    assert info["oldest_access"] == pytest.approx(first, abs=1e-3)
    assert info["newest_access"] == pytest.approx(clock.now, abs=1e-3)
    assert info["slot_bytes"] == SLOT and info["counters"]["hits"] == 1


def test_release_and_lost_reservation(index):
    (slot,) = index.allocate([key(1)])
    index.release([slot])
    assert index.commit([(key(1), slot, (0,))]) == [False]
    assert index.find_prefix([key(1)]) == []
    assert index.allocate([key(2)]) == [slot]  # back on the free list


def test_drop_only_if_key_still_maps_to_slot(index):
    (slot,) = store(index, [key(1)])
    assert not index.drop(key(1), slot + 1)
    assert index.drop(key(1), slot)
    assert index.find_prefix([key(1)]) == []
    assert index.stats()["counters"]["checksum_failures"] == 2


def test_close_releases_own_reservations(tmp_path):
    ix = make_index(tmp_path)
    ix.allocate([key(1), key(2)])
    ix.close()
    ix = make_index(tmp_path)
    assert ix.stats()["reserved"] == 0 and ix.check() == []
    assert ix.allocate([key(1)]) != [None]
    ix.close()


def test_concurrent_threads_share_one_index(index):
    """Thread-safety: four threads allocating overlapping keys never share a slot."""
    won: list[tuple[bytes, int]] = []

    def worker(offset: int) -> None:
        for i in range(20):
            keys = [key((offset + i + j) % 30) for j in range(3)]
            slots = index.allocate(keys)
            pairs = [(k, s) for k, s in zip(keys, slots) if s is not None]
            index.commit([(k, s, (s,)) for k, s in pairs])
            won.extend(pairs)
            index.find_prefix(keys)

    threads = [threading.Thread(target=worker, args=(n * 7,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert won and index.check() == []


def test_iter_entries_and_clear_whole_store(tmp_path):
    ix = make_index(tmp_path, num_slots=3000)
    for start in range(0, 2500, 500):
        store(ix, [key(i) for i in range(start, start + 500)])
    with pytest.raises(StoreError, match="open in this process"):
        clear(tmp_path)
    ix.close()
    entries = list(iter_entries(tmp_path, "ab"))
    assert len(entries) == 2500 and len({e.slot for e, _ in entries}) == 2500
    assert all(last_access > 0 for _, last_access in entries)
    clear(tmp_path)
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []
    assert list_namespaces(tmp_path) == []


def test_clear_refuses_a_directory_that_is_not_a_store(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(StorePathError, match="not a kv-offload disk store"):
        clear(tmp_path)
    assert (tmp_path / "precious.txt").exists()


@pytest.mark.parametrize("bad", ["", "AB", "../x", "ab/cd", "g1", "a" * 129, 12])
def test_namespace_id_must_be_lowercase_hex(tmp_path, bad):
    with pytest.raises(ValueError, match="namespace_id"):
        make_index(tmp_path, namespace_id=bad)


def test_a_tail_is_found_by_its_parent_after_a_reopen_and_leaves_with_its_entry(tmp_path):
    """Issue 33: a committed request tail's parent and token ids are recorded with it
    (found by the parent, also after the store is reopened) and deleted with the entry,
    when it is evicted or dropped; a record that does not parse is skipped."""
    parent, other = b"p" * 32, b"q" * 16
    index = make_index(tmp_path / "store", num_slots=3, clock=FakeClock())
    slots = index.allocate([key(1), key(2)])
    index.settle([(key(1), slots[0], (1,)), (key(2), slots[1], (2,))],
                 tails={key(1): (parent, (5, 6, 7)), key(2): (other, (9,))})
    index.close()
    index = make_index(tmp_path / "store", num_slots=3, clock=FakeClock())
    assert index.tails_of(parent) == [(key(1), (5, 6, 7))]
    assert index.tail_of(key(2)) == (other, (9,))
    assert index.tails_of(b"p" * 31) == []  # a parent that is a prefix of another's
    (entry,) = index.find_prefix([key(2)])
    assert index.drop(key(2), entry.slot)
    assert index.tails_of(other) == [] and index.tail_of(key(2)) is None
    store(index, [key(3), key(4), key(5)])  # evicts key(1), the least recently used
    assert index.find_prefix([key(1)]) == []
    assert index.tails_of(parent) == [] and index.tail_of(key(1)) is None
    assert index.check() == []
    index.close()
