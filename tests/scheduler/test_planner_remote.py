"""OffloadScheduler with a remote tier (a fake: a set of keys and a call counter).

Regression scenarios: the scheduler asked the server itself, on vLLM's scheduler
thread (now: None while the lookup threads ask, then the memoised answer; requests
that cannot hit remotely never wait); one remote check per request however often vLLM
asks; chunks
fetched from the remote tier are published only after every rank loaded them and
also land on the local disk; a store keeps its CPU slot pinned until every rank's
remote write finished; a chunk gone between lookup and load is recomputed.
"""

from __future__ import annotations

import threading
import time

from planner_support import make_request, make_scheduler, store_request

from kv_offload.jobs import WorkerReport
from kv_offload.remote.health import RemoteHealth
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.scheduler import SlotState
from kv_offload.scheduler.tails import tail_key
from kv_offload.testing.clock import FakeClock
from kv_offload.testing.tiers import fill_of, key_in, until_answered


class FakeRemote:
    """Answers lookups from ``keys``; counts calls; ``down`` makes calls fail."""

    def __init__(self) -> None:
        self.keys: set[bytes] = set()
        self.calls = 0
        self.down = False
        self.health = RemoteHealth("fake")
        self.closed = False
        self.tails: dict[bytes, list] = {}  # parent -> [(key, tokens)] (FakeTails)
        self.gate: threading.Event | None = None  # set: tails questions wait for it

    def lookup(self, keys) -> int:
        self.calls += 1
        if self.down:
            self.health.record_failure("down")
            return 0
        hits = 0
        for key in keys:
            if key not in self.keys:
                break
            hits += 1
        return hits

    def lookup_many(self, requests) -> list[int]:
        return [self.lookup(keys) for keys in requests]

    def async_lookups(self, *, clock, **kwargs) -> RemoteLookups:
        kwargs.setdefault("num_threads", 1)
        made = RemoteLookups(self, budget_s=10.0, clock=clock, **kwargs)
        if "fetch" not in kwargs:
            self.lookups = made
        else:
            self.tail_lookups = made
        return made

    def tail_records(self) -> FakeTails:
        return FakeTails(self)

    def close(self) -> None:
        self.closed = True


class FakeTails:
    """The tails' records of a ``FakeRemote`` (``RemoteTails``): parent -> (key, tokens),
    a tail loadable while its key is in ``remote.keys``."""

    def __init__(self, remote: FakeRemote) -> None:
        self.remote = remote

    def tails_many(self, questions) -> list[dict]:
        if self.remote.gate is not None:
            self.remote.gate.wait(30)
        return [{bytes(p): [t for t in self.remote.tails.get(bytes(p), [])
                            if t[0] in self.remote.keys] for p in q} for q in questions]

    def write(self, records, *, stamp: int) -> bool:
        for parent, key, tokens in records:
            self.remote.tails.setdefault(parent, []).append((key, tuple(tokens)))
        return True


def remote_scheduler(remote, **kwargs):
    return make_scheduler(remote=remote, **kwargs)


def matched(sched, request, num_computed_tokens: int = 0) -> tuple[int, int]:
    """(the answer, how many times vLLM was told to ask again first): what vLLM does,
    one step after another, while the remote answer is pending."""
    return until_answered(lambda: sched.num_matched_tokens(request, num_computed_tokens),
                          "the remote lookup")


def test_remote_hits_extend_the_local_hit_with_one_check_per_request():
    remote = FakeRemote()
    sched, blocks = remote_scheduler(remote)
    writer = make_request("w", list(range(17)))
    matched(sched, writer)
    job = store_request(sched, blocks, writer, [0, 1, 2, 3, 4])
    sched.on_report(WorkerReport(written={job.job_id: {"remote": {0: (True, True)}}}))
    sched.cpu.discard(writer.block_hashes[3])  # chunk 2 left the CPU tier...
    remote.keys.add(writer.block_hashes[3])  # ...but another host stored it remotely
    reader = make_request("r", list(range(17)))
    calls = remote.calls
    assert sched.num_matched_tokens(reader, 0) is None, "asked off the scheduler thread"
    assert matched(sched, reader)[0] == 16
    for _ in range(3):  # vLLM asks again while the request waits for blocks
        assert sched.num_matched_tokens(reader, 0) == 16
    assert remote.calls == calls + 1
    sched.plan_load(reader, [10, 11, 12, 13, 14], 16)
    assert sched.hit_tokens_by_tier("r") == {"cpu": 8, "remote": 8}
    (load,) = sched.plan_step([]).loads
    cpu_move, remote_move = load.chunks
    assert key_in(cpu_move) is None and cpu_move.after_job is None
    assert key_in(remote_move) == writer.block_hashes[3]
    assert fill_of(remote_move) is None, "no disk tier, no fill"
    assert sched.cpu.state(writer.block_hashes[3]) is SlotState.STAGING
    sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset()}}))
    assert sched.cpu.state(writer.block_hashes[3]) is SlotState.READY
    assert sched.cpu.counts()["pinned"] == 0
    assert sched.counters.hit_tokens_remote == 8
    assert sched.counters.chunks_loaded_remote == 1


def test_remote_chunks_fill_the_disk_after_every_rank_wrote_them(disk_index):
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote, num_ranks=2, disk_index=disk_index)
    req = make_request("r", list(range(17)))
    keys = [req.block_hashes[1], req.block_hashes[3]]
    remote.keys.update(keys)
    assert matched(sched, req)[0] == 16
    sched.plan_load(req, [10, 11, 12, 13, 14], 16)
    (load,) = sched.plan_step([]).loads
    assert [key_in(m) for m in load.chunks] == keys
    assert all(fill_of(m) is not None for m in load.chunks)
    sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset(), 1: frozenset()}}))
    assert sched.cpu.state(keys[0]) is SlotState.READY, "usable before the fill finishes"
    assert sched.cpu.counts()["pinned"] == 2, "but pinned while the fill reads the slot"
    assert disk_index.find_prefix(keys) == []
    sched.on_report(WorkerReport(written={load.job_id: {"disk": {0: (1, 2)}}}))
    sched.on_report(WorkerReport(written={load.job_id: {"disk": {1: (3, None)}}}))
    assert sched.has_pending_work(), "the fills are written with the next step"
    sched.plan_step([])
    assert [e.checksums for e in disk_index.find_prefix(keys)] == [(1, 3)]
    assert disk_index.stats()["used_slots"] == 1, "the failed fill was released"
    assert sched.cpu.counts()["pinned"] == 0
    assert not sched.has_pending_work()


def test_a_remote_chunk_that_failed_to_load_is_recomputed_and_not_filled(disk_index):
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote, num_ranks=2, disk_index=disk_index)
    req = make_request("r", list(range(17)))
    keys = [req.block_hashes[1], req.block_hashes[3]]
    remote.keys.update(keys)
    matched(sched, req)
    sched.plan_load(req, [10, 11, 12, 13, 14], 16)
    (load,) = sched.plan_step([]).loads
    # Evicted between lookup and read on rank 1: the worker fails chunk 1 and skips its fill.
    sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset(), 1: frozenset({1})}},
                                 bad_reads={load.job_id: {1: frozenset({1})}},
                                 written={load.job_id: {"disk": {0: (1, 2), 1: (3, None)}}}))
    sched.plan_step([])  # writes the fill of chunk 0 and releases the slot of chunk 1
    assert sched.cpu.state(keys[1]) is None
    assert sched.counters.load_errors == 1
    assert [e.key for e in disk_index.find_prefix(keys)] == [keys[0]]
    assert sched.cpu.counts()["pinned"] == 0
    assert not sched.has_pending_work()


def test_store_writes_remote_and_keeps_the_slot_pinned_until_every_rank_did():
    remote = FakeRemote()
    sched, blocks = remote_scheduler(remote, num_ranks=2)
    req = make_request("a", list(range(17)))
    matched(sched, req)
    blocks["a"] = list(range(5))
    (job,) = sched.plan_step([("a", 17)]).stores
    assert [key_in(m) for m in job.chunks] == [req.block_hashes[1], req.block_hashes[3]]
    sched.on_report(WorkerReport(host_stored={job.job_id: 2}))
    assert sched.cpu.state(req.block_hashes[1]) is SlotState.READY
    assert sched.cpu.counts()["pinned"] == 2
    sched.on_report(WorkerReport(written={job.job_id: {"remote": {0: (True, True)}}}))
    assert sched.cpu.counts()["pinned"] == 2
    sched.on_report(WorkerReport(written={job.job_id: {"remote": {1: (True, False)}}}))
    assert sched.cpu.counts()["pinned"] == 0
    assert sched.counters.chunks_stored_remote == 1
    assert not sched.has_pending_work()


def test_remote_down_is_a_miss_and_counted():
    remote = FakeRemote()
    remote.down = True
    sched, _ = remote_scheduler(remote)
    req = make_request("r", list(range(17)))
    remote.keys.update(req.block_hashes)
    assert matched(sched, req)[0] == 0
    assert sched.counters.remote_lookups == 1
    assert sched.counters.remote_lookup_errors == 1
    sched.close()
    assert remote.closed


def test_requests_that_cannot_hit_remotely_never_wait_nor_ask():
    """Shorter than one chunk, or every chunk found locally: answered at once."""
    remote = FakeRemote()
    sched, blocks = remote_scheduler(remote)
    short = make_request("short", list(range(7)))
    assert sched.num_matched_tokens(short, 0) == 0
    writer = make_request("w", list(range(17)))
    assert matched(sched, writer)[0] == 0
    calls = remote.calls
    store_request(sched, blocks, writer, [0, 1, 2, 3, 4])
    local = make_request("local", list(range(17)))
    assert sched.num_matched_tokens(local, 0) == 16, "all local: no remote question"
    assert remote.calls == calls


def test_a_finished_request_asks_again_when_it_comes_back():
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote)
    req = make_request("r", list(range(17)))
    remote.keys.update(req.block_hashes)
    assert matched(sched, req)[0] == 16
    sched.request_finished("r")
    remote.keys.clear()
    assert matched(sched, make_request("r", list(range(17))))[0] == 0, "not the old memo"


def test_a_load_planned_after_the_local_run_changed_does_not_wait_for_the_remote():
    """plan_load finds the remote question no longer matches (a CPU chunk left since the
    lookup): it plans what it can now and fails the rest (recomputed), without waiting."""
    remote = FakeRemote()
    sched, blocks = remote_scheduler(remote)
    writer = make_request("w", list(range(17)))
    matched(sched, writer)
    store_request(sched, blocks, writer, [0, 1, 2, 3, 4])
    reader = make_request("r", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16
    sched.cpu.discard(writer.block_hashes[1])  # chunk 0 left the CPU tier meanwhile
    sched.plan_load(reader, [10, 11, 12, 13, 14], 16)
    (load,) = sched.plan_step([]).loads
    assert [m.cpu_slot for m in load.chunks] == [None, None], "both recomputed"


def test_the_lookup_threads_stop_with_the_scheduler():
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote)
    matched(sched, make_request("r", list(range(17))))
    assert remote.lookups.running
    sched.close()
    assert remote.closed and not remote.lookups.running


def test_the_tails_lookup_thread_starts_with_the_engine_and_stops_with_it():
    """Like the chunks' (test_planner_remote_start): the first tails question pays no
    thread start nor connection set-up within its budget."""
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote, partial_hits=True)
    assert remote.tail_lookups.running, "started at bind, before any question"
    sched.close()
    assert not remote.tail_lookups.running


def test_a_prompt_ending_with_a_whole_chunk_is_served_it_from_the_remote_tier_in_part():
    """Issue 33: the remote tier is asked for the whole chunk a prompt ends with too, and
    serves it up to the prompt's last token but one (the CPU and disk tiers do so by
    their own lookups); staged into the CPU tier like any remote chunk."""
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote, partial_hits=True)
    req = make_request("r", list(range(16)))  # two whole chunks, nothing after
    remote.keys.update([req.block_hashes[1], req.block_hashes[3]])
    assert matched(sched, req)[0] == 15
    sched.plan_load(req, [10, 11, 12, 13], 15)
    assert sched.hit_tokens_by_tier("r") == {"remote": 15}
    (load,) = sched.plan_step([]).loads
    assert [key_in(m) for m in load.chunks] == [req.block_hashes[1], req.block_hashes[3]]
    assert [m.block_ids for m in load.chunks] == [(10, 11), (12, 13)]
    remote.keys.discard(req.block_hashes[3])  # another request, only chunk 0 remotely
    other = make_request("o", list(range(16)))
    other.request_id = "o"
    sched2, _ = remote_scheduler(remote, partial_hits=True)
    assert matched(sched2, other)[0] == 8


def test_the_remote_tier_is_asked_for_the_final_chunk_when_the_local_tiers_hold_the_rest():
    """A one-chunk prompt, and one whose earlier chunks the CPU tier holds: the final
    whole chunk is asked of the remote tier too (the walk over the tiers asks each for the
    chunks no tier before it holds; a lookup once returned before asking it: 0 and one
    chunk fewer loaded)."""
    remote = FakeRemote()
    sched, blocks = remote_scheduler(remote, partial_hits=True)
    one = make_request("one", list(range(8)))
    remote.keys.add(one.block_hashes[1])
    assert matched(sched, one)[0] == 7
    writer = make_request("w", list(range(16)) + [99])
    matched(sched, writer)
    store_request(sched, blocks, writer, [0, 1, 2, 3, 4])  # the CPU tier: chunks 0 and 1
    sched.cpu.discard(writer.block_hashes[3])  # chunk 1 left it; only Redis holds it
    remote.keys.add(writer.block_hashes[3])
    reader = make_request("r", list(range(16)))
    assert matched(sched, reader)[0] == 15
    sched.plan_load(reader, [10, 11, 12, 13], 15)
    assert sched.hit_tokens_by_tier("r") == {"cpu": 8, "remote": 7}


def test_a_remote_answer_is_for_the_keys_asked_not_others_of_the_same_first_and_count():
    """The remote tier is asked for the chunks the CPU tier lacks, which need not be
    contiguous. When the CPU tier's hits change between two asks so that the misses are
    other keys with the same first key and count, the earlier answer must not be reused
    (review of the tier contract: a chunk the server never had was a remote hit; its
    read missed and vLLM recomputed it)."""
    remote = FakeRemote()
    sched, _ = remote_scheduler(remote)
    req = make_request("r", list(range(33)))  # 4 whole chunks + 1 token
    k0, k1, k2, k3 = (req.block_hashes[i] for i in (1, 3, 5, 7))
    remote.keys = {k0, k2, k3}  # not k1
    slot1 = _published(sched, k1)
    assert matched(sched, req)[0] == 32  # k0 remote, k1 CPU, k2 and k3 remote
    sched.cpu.discard_slot(slot1)  # k1 leaves the CPU tier, k3 arrives: misses k0, k1, k2
    _published(sched, k3)
    assert matched(sched, req)[0] == 8  # the server holds k0 of them


def _published(sched, key) -> int:
    """``key`` READY in the CPU tier, unpinned; its slot."""
    slot = sched.cpu.reserve(key, SlotState.STORING)
    sched.cpu.publish(slot)
    sched.cpu.unpin([slot])
    return slot


def _store_with_tail(sched, blocks, req, block_ids, *, ranks_ok):
    """Schedule ``req`` (ending inside a chunk) fully; every rank copies its stores, and
    the remote writes of its tail succeed on the ranks in ``ranks_ok`` (of 2). Returns
    the tail's key."""
    blocks[req.request_id] = block_ids
    plan = sched.plan_step([(req.request_id, req.num_tokens)])
    chunks = [j for j in plan.stores if j.audited]  # none when the CPU tier holds them
    (tail,) = [j for j in plan.stores if not j.audited]
    sched.on_report(WorkerReport(host_stored={j.job_id: 2 for j in plan.stores}))
    sched.on_report(WorkerReport(written={j.job_id: {"remote": {
        r: (True,) * len(j.chunks) for r in range(2)}} for j in chunks}))
    (move,) = tail.chunks
    assert key_in(move) is not None, "a request tail is written to the remote tier"
    sched.on_report(WorkerReport(written={tail.job_id: {"remote": {
        r: (True,) if r in ranks_ok else (None,) for r in range(2)}}}))
    assert sched.tier("remote").wait_tails_written()
    return key_in(move)


def test_a_request_tail_is_recorded_remotely_only_after_every_rank_wrote_it():
    """The record that makes a remote tail findable names tokens whose KV every rank's
    value holds: a tail one rank failed to write gets no record (a record without it
    would serve that rank's missing KV); one all ranks wrote does."""
    remote = FakeRemote()
    sched, blocks = remote_scheduler(remote, num_ranks=2, partial_hits=True)
    first = make_request("a", list(range(20)))  # 2 whole chunks, a tail of 4 tokens
    matched(sched, first)
    _store_with_tail(sched, blocks, first, [0, 1, 2, 3, 4], ranks_ok={0})
    assert remote.tails == {}, "rank 1 did not write it: no record"
    second = make_request("b", list(range(16)) + [50, 51, 52])
    matched(sched, second)
    key = _store_with_tail(sched, blocks, second, [5, 6, 7, 8, 9], ranks_ok={0, 1})
    assert remote.tails == {second.block_hashes[3]: [(key, (50, 51, 52))]}
    assert sched.counters.chunks_stored_remote == 3  # two chunks, the second tail
    assert sched.counters.tails_stored == 2, "both are in the CPU tier"


def test_a_remote_tail_is_pending_then_served_to_the_last_token_but_one(disk_index):
    """Issue 33 on the remote tier: another host stored a 20-token prompt (two chunks and
    a tail of 4 tokens) in Redis; this one asks for its chunks and, alongside (pending:
    vLLM asks again next step), for the tails of the last chunk, and loads 19 tokens from Redis, the
    tail staged into the CPU tier and filled into the local disk with its record (found
    there by its parent after a restart)."""
    remote = FakeRemote()
    writer_sched, blocks = remote_scheduler(remote, num_ranks=2, partial_hits=True)
    writer = make_request("w", list(range(20)))
    matched(writer_sched, writer)
    key = _store_with_tail(writer_sched, blocks, writer, [0, 1, 2, 3, 4], ranks_ok={0, 1})
    remote.keys.update([writer.block_hashes[1], writer.block_hashes[3], key])
    sched, _ = remote_scheduler(remote, num_ranks=2, partial_hits=True, disk_index=disk_index)
    reader = make_request("r", list(range(20)))
    answer, pending = matched(sched, reader)
    assert answer == 19 and pending >= 1, "the chunks' and the tail's answers are awaited"
    assert sched.num_matched_tokens(reader, 0) == 19, "memoised"
    sched.plan_load(reader, [10, 11, 12, 13, 14], 19)
    assert sched.hit_tokens_by_tier("r") == {"remote": 19}
    assert sched.counters.hit_tokens_tail == 3
    (load,) = sched.plan_step([]).loads
    assert [key_in(m) for m in load.chunks] == [writer.block_hashes[1],
                                                 writer.block_hashes[3], key]
    assert all(fill_of(m) is not None for m in load.chunks)
    sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset(), 1: frozenset()}}))
    sched.on_report(WorkerReport(written={load.job_id: {"disk": {0: (1, 2, 3), 1: (4, 5, 6)}}}))
    sched.plan_step([])
    disk = sched.tier("disk")
    assert disk.tails_of("x", writer.block_hashes[3]) == [(key, (16, 17, 18, 19))]


def test_a_remote_tail_is_not_served_when_the_tails_answer_times_out():
    """The tails question keeps the lookup budget: past it, the request loads its whole
    chunks only (a miss for the tail), and is never held longer."""
    remote = FakeRemote()
    clock = FakeClock()
    sched, _ = remote_scheduler(remote, partial_hits=True, clock=clock)
    req = make_request("r", list(range(20)))
    tail = tail_key(req.block_hashes[3], (16, 17, 18, 19))
    remote.keys.update([req.block_hashes[1], req.block_hashes[3], tail])
    remote.tails[req.block_hashes[3]] = [(tail, (16, 17, 18, 19))]  # served 19 if asked
    remote.gate = threading.Event()  # the tails' round trip does not come back
    answer = None
    for _ in range(10_000):  # vLLM's steps; the chunks' answer arrives on its own
        answer = sched.num_matched_tokens(req, 0)
        if answer is not None:
            break
        clock.now += 0.05  # the budget: 10 s
        time.sleep(0.001)
    assert answer == 16, "the tail's question timed out: whole chunks only"
    remote.gate.set()
    assert sched.num_matched_tokens(req, 0) == 16, "a miss, also once the answer came"
    # The round trip held past the budget marks the tails' questions slow: the next is
    # skipped (a miss at once) and its probe, answered in time, ends that.
    for _ in range(100):
        sched.request_finished("r")
        if matched(sched, make_request("r", list(range(20))))[0] == 19:
            break
        time.sleep(0.01)
    assert sched.num_matched_tokens(req, 0) == 19, "the timed-out miss was forgotten"
