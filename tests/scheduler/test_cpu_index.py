"""CpuIndex contracts, run over every eviction policy."""

import pytest

from kv_offload.scheduler import CpuIndex, SlotState

POLICIES = ["lru", "fifo"]


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def fill(index: CpuIndex, n: int) -> None:
    for i in range(n):
        assert index.reserve(key(i), SlotState.STORING) is not None
        index.publish(key(i))
        index.unpin([key(i)])


@pytest.mark.parametrize("policy", POLICIES)
def test_slots_are_unique_and_storing_is_invisible(policy):
    index = CpuIndex(4, policy=policy)
    slots = [index.reserve(key(i), SlotState.STORING) for i in range(4)]
    assert sorted(slots) == [0, 1, 2, 3]
    assert index.lookup_prefix([key(0)]) == []
    index.publish(key(0))
    assert [h.slot for h in index.lookup_prefix([key(0), key(1)])] == [slots[0]]


@pytest.mark.parametrize("policy", POLICIES)
def test_full_of_pinned_or_pending_entries_means_no_room(policy):
    index = CpuIndex(2, policy=policy)
    index.reserve(key(0), SlotState.STORING)
    index.reserve(key(1), SlotState.STAGING, staging_job=7)
    before = index.counts()
    assert index.reserve(key(2), SlotState.STORING) is None
    assert index.counts() == before, "a failed reserve changes nothing"
    index.publish(key(0))  # READY but still pinned by its store
    assert index.reserve(key(2), SlotState.STORING) is None
    index.unpin([key(0)])
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
    index.reserve(key(0), SlotState.STAGING, staging_job=5)
    (hit,) = index.lookup_prefix([key(0)])
    assert hit.staging_job == 5
    index.publish(key(0))
    (hit,) = index.lookup_prefix([key(0)])
    assert hit.staging_job is None


def test_discard_frees_the_slot_and_clear_keeps_pinned():
    index = CpuIndex(3)
    fill(index, 3)
    index.pin([key(1)])
    index.discard(key(0))
    assert index.counts()["free"] == 1
    assert index.clear_unpinned() == 1
    assert key(1) in index and key(2) not in index
