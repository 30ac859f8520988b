"""Request tails on the remote tier against a real Redis: ``RemoteIndex`` (records
written after every rank wrote, ``tails_of`` pending then answered) over
``RemoteTails`` (the records: checked, capped, superseded, inside their namespace).

Regression scenarios (issue 33, the remote tier's last gap): the remote tier kept no
tails, so a prompt ending inside a chunk was served its whole chunks only; a record
whose tokens do not make its key, or whose value a rank lacks, must never be served.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import redis

from kv_offload.counters import SchedulerCounters
from kv_offload.remote import RemoteTarget, RemoteTier
from kv_offload.remote.index import RemoteIndex
from kv_offload.remote.inspect import inspect_remote
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.remote.tail_records import RemoteTails
from kv_offload.remote.values import encode_tail_record, tails_name
from kv_offload.scheduler.tails import MAX_TAILS_PER_PARENT, tail_key
from kv_offload.testing.clock import FakeClock
from kv_offload.testing.tiers import until_answered

NS, OTHER_NS = "7a" * 16, "7b" * 16
SLOT, RANKS, PREFIX = 1024, 2, "kvo-tails"
PARENT = b"P" * 32


def make_tier(redis_server, namespace: str = NS) -> RemoteTier:
    return RemoteTier(RemoteTarget(redis_server.url), namespace=namespace, num_ranks=RANKS,
                      payload_bytes=SLOT, timeout_s=2.0, key_prefix=PREFIX,
                      lookup_budget_s=10.0)


@pytest.fixture
def server(redis_server):
    redis_server.cli("flushall")
    return redis_server


@pytest.fixture
def index(server):
    made = RemoteIndex(make_tier(server))
    made.bind(SchedulerCounters(), time.monotonic)
    yield made
    made.close()


def payload(key: bytes, rank: int) -> memoryview:
    seed = int.from_bytes(key[:4], "big") + rank
    return memoryview(np.random.default_rng(seed).integers(0, 256, SLOT, np.uint8).tobytes())


def write_values(tier: RemoteTier, key: bytes, ranks=range(RANKS)) -> dict:
    """Every rank in ``ranks`` writes its value of ``key``; the ``written`` results."""
    return {r: (tier.write(key, r, payload(key, r)) if r in ranks else None,)
            for r in range(RANKS)}


def store_tail(index: RemoteIndex, parent: bytes, tokens: tuple[int, ...],
               ranks=range(RANKS)) -> bytes:
    """What the planner does with a request tail: note, reserve, every rank writes,
    ``written``; then waits for the record's writer."""
    key = tail_key(parent, tokens)
    index.note_tail(key, parent, tokens)
    places = index.reserve([key])
    index.written([key], places, write_values(index.remote, key, ranks))
    assert index.wait_tails_written()
    return key


def tails_of(index: RemoteIndex, parent: bytes, asker: str = "r/tail") -> tuple[list, int]:
    """(the answer, how many times it was pending first), asked as vLLM's steps do."""
    found, pending = until_answered(lambda: index.tails_of(asker, parent), "tails_of")
    index.forget(asker)
    return list(found), pending


def test_a_tail_is_recorded_only_after_every_rank_wrote_it(index, server):
    store_tail(index, PARENT, (1, 2, 3), ranks={0})
    assert server.cli("exists", tails_name(PREFIX, NS, PARENT).decode()).strip() == "0"
    assert tails_of(index, PARENT)[0] == []
    key = store_tail(index, PARENT, (4, 5, 6))
    found, pending = tails_of(index, PARENT)
    assert found == [(key, (4, 5, 6))]
    assert pending >= 1, "asked off the scheduler thread"


def test_an_answer_is_memoised_per_asker_and_a_found_tail_is_found_at_once(index):
    key = store_tail(index, PARENT, (7, 8))
    while index.tails_of("a/tail", PARENT) is None:
        time.sleep(0.001)
    assert index.tails_of("a/tail", PARENT) == [(key, (7, 8))]
    (place,) = index.find("a/tail", [key])  # no second round trip: never pending
    assert place.address == key
    index.forget("a/tail")
    assert index.tails_of("a/tail", PARENT) is None, "forgotten: a new question"


def test_a_tail_a_rank_lost_since_or_a_record_that_does_not_make_its_key_is_left_out(
        index, server):
    good = store_tail(index, PARENT, (1, 1, 1))
    lost = store_tail(index, PARENT, (2, 2, 2))
    server.cli("del", index.remote.name(lost, 1).decode())  # evicted on one rank
    name = tails_name(PREFIX, NS, PARENT)
    forged = tail_key(PARENT, (9, 9))  # its values exist, its record lies about tokens
    write_values(index.remote, forged)
    client = redis.Redis.from_url(server.url)
    client.hset(name, forged, encode_tail_record(time.time_ns(), (9, 9, 9)))
    client.hset(name, b"x" * 32, b"not a record")
    assert tails_of(index, PARENT)[0] == [(good, (1, 1, 1))]


def test_a_parent_keeps_its_newest_tails_and_a_longer_turn_supersedes_a_shorter(server):
    tails = RemoteTails(make_tier(server), max_per_parent=3)
    records = [(PARENT, tail_key(PARENT, (i,)), (i,)) for i in range(5)]
    for stamp, record in enumerate(records):
        assert tails.write([record], stamp=stamp)
    name = tails_name(PREFIX, NS, PARENT)
    client = redis.Redis.from_url(server.url)
    assert set(client.hkeys(name)) == {r[1] for r in records[2:]}, "the oldest two dropped"
    longer = (PARENT, tail_key(PARENT, (4, 40, 41)), (4, 40, 41))
    assert tails.write([longer], stamp=9)
    assert set(client.hkeys(name)) == {records[2][1], records[3][1], longer[1]}
    assert MAX_TAILS_PER_PARENT == 8  # the CPU tier's cap, and the remote tier's default


def test_tails_stay_inside_their_namespace(index, server):
    key = store_tail(index, PARENT, (3, 1, 4))
    other = RemoteIndex(make_tier(server, OTHER_NS))
    other.bind(SchedulerCounters(), time.monotonic)
    try:
        write_values(other.remote, key)  # even with values there under the same key
        assert tails_of(other, PARENT)[0] == []
        assert tails_of(index, PARENT)[0] == [(key, (3, 1, 4))]
    finally:
        other.close()


def test_inspect_counts_tail_records(index, server):
    store_tail(index, PARENT, (1,))
    store_tail(index, PARENT, (2,))
    store_tail(index, b"Q" * 32, (3,))
    report = inspect_remote(RemoteTarget(server.url), key_prefix=PREFIX)
    (ns,) = report["namespaces"]
    assert ns["tails"] == 3 and ns["chunks"] == 3, "tail values counted as chunks, records apart"


def test_inspect_counts_the_tails_whose_values_are_there_not_every_record(index, server):
    """A record outlives its values when the server evicts them (LRU: each lookup reads
    the records, not the values): such a tail is gone, and ``inspect`` counted the
    records: "2 chunks ..., 2 of them request tails" of a server holding a chunk and
    (one rank of) one tail."""
    store_tail(index, PARENT, (1,))
    lost = store_tail(index, PARENT, (2,))
    write_values(index.remote, b"C" * 32)  # a chunk
    for rank in range(RANKS):
        server.cli("del", index.remote.name(lost, rank).decode())
    server.cli("del", index.remote.name(tail_key(PARENT, (1,)), 0).decode())  # one rank
    (ns,) = inspect_remote(RemoteTarget(server.url), key_prefix=PREFIX)["namespaces"]
    assert ns["chunks"] == 2 and ns["partial"]
    assert ns["tails"] == 1, "the tail some rank still holds; not the one the server lost"


def test_a_tails_question_past_the_budget_is_a_miss():
    """The tails question keeps the lookups' rules: past its budget, [] (not a wait)."""

    class Silent:
        health = type("Health", (), {"up": True, "num_failures": 0})()

    clock = FakeClock()
    lookups = RemoteLookups(Silent(), budget_s=0.05, clock=clock, start=False,
                            fetch=lambda questions: [[(b"k", (1,))] for _ in questions],
                            miss=[])
    assert lookups.ask("r/tail", (PARENT,)) is None
    clock.now += 0.06
    assert lookups.ask("r/tail", (PARENT,)) == []
    lookups.run_once()  # the answer arrives late: the miss stands
    assert lookups.ask("r/tail", (PARENT,)) == []
    assert lookups.ask("s/tail", (PARENT,)) is None
    lookups.run_once()
    assert lookups.ask("s/tail", (PARENT,)) == [(b"k", (1,))]


def test_a_server_that_refuses_the_tails_commands_keeps_serving_chunks(server):
    """ACLs (or a managed service) may refuse the hash commands of the tails' records:
    then no tail is kept remotely, and the tier stays up. Such a refusal was counted as
    a failed call: the tier backed off (up to 30 s, again at every tail), and every chunk
    lookup meanwhile answered a miss on a server that held the chunks."""
    server.cli("acl", "setuser", "nohash", "on", ">pw", "~*", "+@all", "-@hash")
    tier = RemoteTier(RemoteTarget(server.url.replace("redis://", "redis://nohash@"),
                                   password="pw"), namespace=NS, num_ranks=RANKS,
                      payload_bytes=SLOT, timeout_s=2.0, key_prefix=PREFIX,
                      lookup_budget_s=10.0)
    index = RemoteIndex(tier)
    index.bind(SchedulerCounters(), time.monotonic)
    try:
        chunk = b"C" * 32
        write_values(tier, chunk)
        store_tail(index, PARENT, (1, 2, 3))  # its record is refused
        assert tails_of(index, PARENT)[0] == []  # so is the question
        assert tier.health.up and tier.health.num_failures == 0
        deadline = time.monotonic() + 30  # bounds a hang only
        while (found := index.find("r", [chunk])) is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert [p.address for p in found] == [chunk], "the chunks are still found"
    finally:
        index.close()
        server.cli("acl", "deluser", "nohash")
