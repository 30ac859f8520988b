"""The tier contract, the same checks over every secondary tier: the disk's, the remote's
and the in-memory test tier (``test_memory_tier``), both halves together, two ranks.

What the planner relies on: a reserved place is invisible until every rank wrote it and
``written`` committed it; a rank's failed write, or a chunk named ``failed``, is never
committed; what is found reads back the bytes each rank wrote; a tier turned off finds
and reserves nothing while what was handed out is still released. A tier that keeps
request tails (all three) finds a noted tail by its parent once every rank wrote it,
answering ``tails_of`` at once or pending first (the remote tier), and then ``find``s
it at once; ``expect_tails`` (a hint) changes no answer, and on the remote tier one
question answers every expected parent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import test_memory_tier as memory

from kv_offload.counters import SchedulerCounters
from kv_offload.disk import DiskIndex, SlabFile
from kv_offload.disk.io import DiskIO
from kv_offload.disk.tier import DiskTier
from kv_offload.remote import RemoteTarget, RemoteTier
from kv_offload.remote.index import RemoteIndex
from kv_offload.remote.io import RemoteIO
from kv_offload.scheduler.tails import tail_key

SLOT_BYTES, RANKS = 256, 2
NS = "c0417ac7" * 4


@dataclass
class Tier:
    scheduler: Any
    ranks: list[Any]  # the worker half of each rank
    shared: bool  # a shared server: drop forgets nothing (another writer may have it)


def disk_tier(tmp_path) -> Tier:
    index = DiskIndex.open(tmp_path, namespace_id=NS, descriptor={"contract": 1},
                           slot_bytes=SLOT_BYTES, num_ranks=RANKS,
                           capacity_bytes=64 * SLOT_BYTES * RANKS)
    slabs = [SlabFile(tmp_path, namespace_id=NS, rank=r, num_ranks=RANKS,
                      slot_bytes=SLOT_BYTES) for r in range(RANKS)]
    return Tier(DiskTier(index), [DiskIO(s, slot_bytes=SLOT_BYTES, rank=r)
                                  for r, s in enumerate(slabs)], shared=False)


def remote_tier(redis_server) -> Tier:
    redis_server.cli("flushall")

    def connect() -> RemoteTier:
        return RemoteTier(RemoteTarget(redis_server.url), namespace=NS, num_ranks=RANKS,
                          payload_bytes=SLOT_BYTES, timeout_s=2.0, key_prefix="contract")

    return Tier(RemoteIndex(connect()), [RemoteIO(connect(), rank=r) for r in range(RANKS)],
                shared=True)


def memory_tier(_) -> Tier:
    data: dict = {}
    return Tier(memory.MemoryTier(data, RANKS, capacity=64),
                [memory.MemoryIO(data, r) for r in range(RANKS)], shared=False)


@pytest.fixture(params=["disk", "remote", "memory"])
def tier(request, tmp_path):
    if request.param == "remote":
        made = remote_tier(request.getfixturevalue("redis_server"))
    else:
        made = {"disk": disk_tier, "memory": memory_tier}[request.param](tmp_path)
    made.scheduler.bind(SchedulerCounters(), time.monotonic)
    for io in made.ranks:
        io.bind(lambda deltas: None, time.monotonic)
    yield made
    made.scheduler.close()
    for io in made.ranks:
        io.close()


def payload(key: bytes, rank: int) -> memoryview:
    seed = int.from_bytes(key[:4], "big") + rank
    return memoryview(np.random.default_rng(seed).integers(0, 256, SLOT_BYTES, np.uint8)
                      .tobytes())


def find(tier: Tier, keys: list[bytes]) -> list:
    """``find`` until it answers (the remote tier answers off the calling thread)."""
    deadline = time.monotonic() + 30  # bounds a hang only
    while (found := tier.scheduler.find("r", keys)) is None:
        assert time.monotonic() < deadline, "find never answered"
        time.sleep(0.001)
    tier.scheduler.forget("r")  # the next question is a new one
    return list(found)


def store(tier: Tier, keys: list[bytes], *, failing_rank: int | None = None,
          failed: frozenset[int] = frozenset()) -> int:
    """Reserve, write on every rank (``failing_rank`` writes nothing: None), commit."""
    places = tier.scheduler.reserve(keys)
    results = {}
    for rank, io in enumerate(tier.ranks):
        if rank == failing_rank:
            results[rank] = (None,) * len(keys)
            continue
        mine = [(p, payload(k, rank)) for k, p in zip(keys, places) if p is not None]
        answers = iter(io.write([p.address for p, _ in mine], [v for _, v in mine]))
        results[rank] = tuple(None if p is None else next(answers) for p in places)
    committed = tier.scheduler.written(keys, places, results, failed)
    tier.scheduler.end_step()
    return committed


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_a_chunk_is_found_only_once_every_rank_wrote_it(tier):
    places = tier.scheduler.reserve([key(1)])
    assert find(tier, [key(1)]) == [], "reserved, not written: invisible"
    address = places[0].address
    results = {0: tuple(tier.ranks[0].write([address], [payload(key(1), 0)]))}
    tier.scheduler.end_step()
    assert find(tier, [key(1)]) == [], "one rank of two wrote it: invisible"
    results[1] = tuple(tier.ranks[1].write([address], [payload(key(1), 1)]))
    tier.scheduler.end_step()
    # The remote tier commits nothing: every rank's value there is the hit.
    assert (find(tier, [key(1)]) == []) is not tier.shared, "written, not committed"
    assert tier.scheduler.written([key(1)], places, results) == 1
    tier.scheduler.end_step()
    assert len(find(tier, [key(1)])) == 1


def test_what_is_found_reads_back_each_ranks_bytes_in_order(tier):
    assert store(tier, [key(2), key(3), key(4)]) == 3
    found = find(tier, [key(2), key(3), key(5), key(4)])
    assert len(found) == 2, "the leading chunks held: 2 and 3, not 4 past the gap"
    for place, k in zip(found, [key(2), key(3)]):
        tier.scheduler.pin([place])
        for rank, io in enumerate(tier.ranks):
            out = memoryview(bytearray(SLOT_BYTES))
            assert io.read(place, out) and bytes(out) == bytes(payload(k, rank))
        tier.scheduler.unpin([place])


def test_a_failed_write_or_a_failed_chunk_is_never_committed(tier):
    assert store(tier, [key(6)], failing_rank=1) == 0
    assert store(tier, [key(7), key(8)], failed=frozenset({0})) == 1
    assert find(tier, [key(6)]) == []  # rank 0's bytes alone are no hit
    assert find(tier, [key(8)]) != []
    if not tier.shared:
        assert find(tier, [key(7)]) == []


def test_a_released_place_is_never_found(tier):
    places = tier.scheduler.reserve([key(9)])
    tier.scheduler.release([p for p in places if p is not None])
    tier.scheduler.end_step()
    assert find(tier, [key(9)]) == []


def test_a_dropped_chunk_is_forgotten_unless_the_tier_is_shared(tier):
    assert store(tier, [key(10)]) == 1
    (place,) = find(tier, [key(10)])
    tier.scheduler.drop(place, key(10))
    tier.scheduler.end_step()
    assert (find(tier, [key(10)]) == []) is not tier.shared


def test_a_disabled_tier_finds_and_reserves_nothing_and_still_releases(tier):
    assert store(tier, [key(11)]) == 1
    places = tier.scheduler.reserve([key(12)])
    tier.scheduler.disable("test", failed=False)
    assert not tier.scheduler.enabled
    assert tier.scheduler.find("r", [key(11)]) == []
    assert tier.scheduler.reserve([key(13)]) == [None]
    tier.scheduler.release([p for p in places if p is not None])  # jobs in flight end
    tier.scheduler.end_step()


def tails_of(tier: Tier, parent: bytes, until: int) -> list:
    """``tails_of`` until it answers with ``until`` tails (the remote tier answers off the
    calling thread, and writes its records on a thread of its own); each try a new
    question."""
    deadline = time.monotonic() + 30  # bounds a hang only
    while True:
        found = tier.scheduler.tails_of("r/tail", parent)
        if found is not None:
            tier.scheduler.forget("r/tail")
            if len(found) >= until:
                return list(found)
        assert time.monotonic() < deadline, "tails_of never answered"
        time.sleep(0.001)


def test_a_request_tail_is_found_by_its_parent_once_every_rank_wrote_it(tier):
    parent = key(20)
    lost, kept = (parent, (1, 2, 3)), (parent, (1, 2, 3, 4))
    lost_key, kept_key = tail_key(*lost), tail_key(*kept)
    tier.scheduler.note_tail(lost_key, *lost)
    assert store(tier, [lost_key], failing_rank=1) == 0
    tier.scheduler.note_tail(kept_key, *kept)
    assert store(tier, [kept_key]) == 1
    assert tails_of(tier, parent, until=1) == [(kept_key, (1, 2, 3, 4))], \
        "a tail one rank did not write is never reported"
    while tier.scheduler.tails_of("s/tail", parent) is None:
        time.sleep(0.001)
    assert len(tier.scheduler.find("s/tail", [kept_key])) == 1, "found at once"
    assert tails_of(tier, key(21), until=0) == []


def test_expected_tails_are_answered_by_tails_of_as_without_the_hint(tier):
    """``expect_tails`` is a hint (the planner's, while a chunk question is pending): a
    tier answers ``tails_of`` of each expected parent as it would have without it; the
    remote tier asks for them all in one question, so once one is answered the others
    are too, at once, and ``find`` of a tail it reported answers at once."""
    parent, bare = key(22), key(23)
    kept = tail_key(parent, (5, 6, 7))
    tier.scheduler.note_tail(kept, parent, (5, 6, 7))
    assert store(tier, [kept]) == 1
    assert tails_of(tier, parent, until=1) == [(kept, (5, 6, 7))]  # its record is there
    tier.scheduler.expect_tails("e/tail", [bare, parent, bare])
    deadline = time.monotonic() + 30  # bounds a hang only
    while (found := tier.scheduler.tails_of("e/tail", parent)) is None:
        assert time.monotonic() < deadline, "tails_of never answered"
        time.sleep(0.001)
    assert list(found) == [(kept, (5, 6, 7))]
    assert tier.scheduler.tails_of("e/tail", bare) == [], "answered with it"
    assert len(tier.scheduler.find("e/tail", [kept])) == 1, "found at once"
    tier.scheduler.expect_tails("e/tail", [parent])  # answered already: nothing asked
    assert list(tier.scheduler.tails_of("e/tail", parent)) == [(kept, (5, 6, 7))]
