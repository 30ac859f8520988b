"""CpuIndex contracts, run over every eviction policy."""

import pytest

from kv_offload.scheduler import CpuIndex, SlotState

POLICIES = ["lru", "fifo"]


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def fill(index: CpuIndex, n: int) -> list[int]:
    slots = []
    for i in range(n):
        slot = index.reserve(key(i), SlotState.STORING)
        assert slot is not None
        index.publish(slot)
        index.unpin([slot])
        slots.append(slot)
    return slots


@pytest.mark.parametrize("policy", POLICIES)
def test_slots_are_unique_and_storing_is_invisible(policy):
    index = CpuIndex(4, policy=policy)
    slots = [index.reserve(key(i), SlotState.STORING) for i in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert index.hit(key(0)) is None and index.hits([key(0)]) == []
    index.publish(slots[0])
    assert [h.slot for h in index.hits([key(0)])] == [slots[0]]
    assert index.hits([key(0), key(1)]) == [index.hit(key(0))]  # up to a STORING key


@pytest.mark.parametrize("policy", POLICIES)
def test_full_of_pinned_or_pending_entries_means_no_room(policy):
    index = CpuIndex(2, policy=policy)
    slot = index.reserve(key(0), SlotState.STORING)
    index.reserve(key(1), SlotState.STAGING, staging_job=7)
    before = index.counts()
    assert index.num_reservable() == 0
    assert index.reserve(key(2), SlotState.STORING) is None
    assert index.counts() == before, "a failed reserve changes nothing"
    index.publish(slot)  # READY but still pinned by its store
    assert index.reserve(key(2), SlotState.STORING) is None
    index.unpin([slot])
    assert index.num_reservable() == 1
    assert index.reserve(key(2), SlotState.STORING) is not None
    assert key(0) not in index and index.num_evictions == 1


def test_lru_evicts_least_recently_used_and_fifo_ignores_hits():
    for policy, survivor in (("lru", 0), ("fifo", 1)):
        index = CpuIndex(2, policy=policy)
        fill(index, 2)
        index.touch([key(0)])
        index.reserve(key(9), SlotState.STORING)
        assert key(survivor) in index, policy


def test_staging_entries_are_visible_with_their_job():
    index = CpuIndex(2)
    slot = index.reserve(key(0), SlotState.STAGING, staging_job=5)
    hit = index.hit(key(0))
    assert hit is not None and hit.staging_job == 5
    index.publish(slot)
    hit = index.hit(key(0))
    assert hit is not None and hit.staging_job is None


def test_discard_frees_the_slot_and_clear_keeps_pinned():
    index = CpuIndex(3)
    slots = fill(index, 3)
    index.pin([slots[1]])
    index.discard(key(0))
    assert index.counts()["free"] == 1
    assert index.clear_unpinned() == 1
    assert key(1) in index and key(2) not in index


def test_a_discarded_slot_stays_reserved_until_its_last_pin():
    """Regression (issue 17, bug 2): a failed load discarded a STAGING chunk and freed
    its slot while another job still pinned it; the next store took the slot and the
    other job copied foreign bytes into the engine."""
    index = CpuIndex(2)
    slot = index.reserve(key(0), SlotState.STAGING, staging_job=1)
    index.pin([slot])  # a second job shares the staging read
    index.discard_slot(slot)
    index.unpin([slot])  # the first job's pin
    assert key(0) not in index and index.counts()["discarded"] == 1
    other = index.reserve(key(1), SlotState.STORING)
    assert other != slot and index.reserve(key(2), SlotState.STORING) is None
    index.unpin([slot])  # the second job's pin: now the slot is free
    assert index.counts()["free"] == 1 and index.counts()["discarded"] == 0
    assert index.reserve(key(2), SlotState.STORING) == slot


def test_unpin_by_slot_never_touches_a_newer_entry_of_the_same_key():
    """Regression (issue 17, bug 2): unpin by key stripped a pin from a new entry."""
    index = CpuIndex(3)
    old = index.reserve(key(0), SlotState.STAGING, staging_job=1)
    index.pin([old])
    index.discard(key(0))
    new = index.reserve(key(0), SlotState.STORING)
    index.unpin([old, old])
    index.publish(new)
    assert index.counts()["pinned"] == 1, "the new entry keeps its own pin"
    index.unpin([new])
    assert index.counts()["pinned"] == 0 and index.num_reservable() == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_num_reservable_counts_free_and_evictable_slots_except_kept_hits(policy):
    index = CpuIndex(4, policy=policy)
    slots = fill(index, 3)
    hits = [h for h in index.hits([key(0), key(1)]) if h is not None]
    assert len(hits) == 2
    assert index.num_reservable() == 4
    assert index.num_reservable(hits) == 2
    index.pin([slots[2]])
    assert index.num_reservable(hits) == 1
    index.pin(h.slot for h in hits)
    for _ in range(index.num_reservable()):
        assert index.reserve(key(10 + _), SlotState.STORING) is not None
    assert index.reserve(key(99), SlotState.STORING) is None
