"""OffloadScheduler contracts, driven with fake requests and completed by hand.

Covers invariants 1 and 2 (visibility only after every rank finished; pins protect
slots being read) and the plan shapes the workers rely on.
"""

import itertools

from planner_support import make_request, make_scheduler, store_request

from kv_offload.counters import SchedulerCounters
from kv_offload.disk import DiskIndex
from kv_offload.disk.tier import ACCESS_FLUSH_MAX_PENDING, DiskTier
from kv_offload.jobs import SKIP_BLOCK, WorkerReport
from kv_offload.remote.index import RemoteIndex
from kv_offload.scheduler import OffloadScheduler, PlannerConfig, SlotState
from kv_offload.scheduler.cpu_index import CpuIndex
from kv_offload.scheduler.loads import LoadPlanner
from kv_offload.scheduler.lookup import Source
from kv_offload.testing.tiers import place_in, secondary_tiers
from kv_offload.tier_contract import Place


def test_store_plans_full_chunks_with_their_blocks():
    sched, blocks = make_scheduler()
    req = make_request("a", list(range(20)))  # 2 full chunks + 4 tokens
    sched.num_matched_tokens(req, 0)
    blocks["a"] = [10, 11, 12, 13, 14]
    plan = sched.plan_step([("a", 20)])
    (job,) = plan.stores
    assert [m.block_ids for m in job.chunks] == [(10, 11), (12, 13)]
    assert len({m.cpu_slot for m in job.chunks}) == 2
    assert all(place_in(m, "disk") is None for m in job.chunks)
    # The same chunks are not stored twice.
    assert not sched.plan_step([("a", 20)]).stores


def test_chunk_is_invisible_until_every_rank_finished():
    sched, blocks = make_scheduler(num_ranks=2)
    req = make_request("a", list(range(17)))
    sched.num_matched_tokens(req, 0)
    blocks["a"] = list(range(5))
    (job,) = sched.plan_step([("a", 17)]).stores
    other = make_request("b", list(range(17)))
    assert sched.num_matched_tokens(other, 0) == 0
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    assert sched.num_matched_tokens(other, 0) == 0, "visible after one of two ranks"
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    assert sched.num_matched_tokens(other, 0) == 16


def test_hit_leaves_one_token_to_compute():
    sched, blocks = make_scheduler()
    req = make_request("a", list(range(16)))
    sched.num_matched_tokens(req, 0)
    store_request(sched, blocks, req, [0, 1, 2, 3])
    again = make_request("b", list(range(16)))
    # 16 tokens = 2 full chunks, but the last one is not loaded: vLLM must compute a token.
    assert sched.num_matched_tokens(again, 0) == 8


def test_lookup_is_side_effect_free_and_stops_at_first_miss():
    sched, blocks = make_scheduler()
    req = make_request("a", list(range(17)))
    sched.num_matched_tokens(req, 0)
    store_request(sched, blocks, req, [0, 1, 2, 3, 4])
    diverged = make_request("b", list(range(8)) + [99] * 9)
    before = sched.cpu.counts()
    assert sched.num_matched_tokens(diverged, 0) == 8
    assert sched.num_matched_tokens(diverged, 0) == 8
    assert sched.cpu.counts() == before


def test_load_pins_slots_until_done_and_skips_locally_computed_blocks():
    sched, blocks = make_scheduler(num_cpu_slots=2)
    req = make_request("a", list(range(17)))
    sched.num_matched_tokens(req, 0)
    store_request(sched, blocks, req, [0, 1, 2, 3, 4])
    reader = make_request("b", list(range(17)))
    # vLLM's own cache already has the first block: 4 tokens computed locally.
    assert sched.num_matched_tokens(reader, 4) == 12
    sched.plan_load(reader, [20, 21, 22, 23, 24], 12)
    plan = sched.plan_step([])
    (load,) = plan.loads
    assert [m.block_ids for m in load.chunks] == [(SKIP_BLOCK, 21), (22, 23)]
    assert sched.cpu.counts()["pinned"] == 2
    # The CPU tier is full and both slots are pinned: a new store is skipped, not blocking.
    newcomer = make_request("c", [7] * 9)
    sched.num_matched_tokens(newcomer, 0)
    blocks["c"] = [30, 31, 32]
    assert not sched.plan_step([("c", 9)]).stores
    assert sched.counters.skipped_stores == 1
    sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset()}}))
    assert sched.cpu.counts()["pinned"] == 0
    assert not sched.has_pending_work()


def store_two_chunks_on_disk(disk_index):
    """A 17-token request stored on both ranks of ``disk_index`` by another scheduler
    (an earlier engine); returns the request."""
    writer, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    req = make_request("a", list(range(17)))
    writer.num_matched_tokens(req, 0)
    blocks["a"] = list(range(5))
    (job,) = writer.plan_step([("a", 17)]).stores
    writer.on_report(WorkerReport(host_stored={job.job_id: 2},
                                  written={job.job_id: {"disk": {0: (1, 2), 1: (3, 4)}}}))
    writer.plan_step([])  # the commits are written with the writer's next step
    return req


def test_disk_commit_needs_every_rank_and_a_failed_rank_releases(disk_index):
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    req = make_request("a", list(range(17)))
    sched.num_matched_tokens(req, 0)
    blocks["a"] = list(range(5))
    (job,) = sched.plan_step([("a", 17)]).stores
    assert all(place_in(m, "disk") is not None for m in job.chunks)
    sched.on_report(WorkerReport(host_stored={job.job_id: 2},
                                 written={job.job_id: {"disk": {0: (11, 12)}}}))
    keys = [req.block_hashes[1], req.block_hashes[3]]
    assert disk_index.find_prefix(keys) == []
    # Rank 1 failed the second chunk: only the first is committed.
    sched.on_report(WorkerReport(written={job.job_id: {"disk": {1: (21, None)}}}))
    assert disk_index.find_prefix(keys) == [] and sched.has_pending_work()
    sched.plan_step([])  # one write transaction: the commit and the release
    (entry,) = disk_index.find_prefix(keys)
    assert entry.checksums == (11, 21)
    assert disk_index.stats()["reserved"] == 0, "the failed chunk's slot was released"
    assert sched.cpu.counts()["pinned"] == 0 and not sched.has_pending_work()


def test_disk_hit_is_staged_shared_and_dropped_on_failure(disk_index):
    req = store_two_chunks_on_disk(disk_index)
    # A fresh scheduler (a restarted engine) has an empty CPU tier.
    sched, _ = make_scheduler(num_ranks=2, disk_index=disk_index)
    first, second = make_request("x", list(range(17))), make_request("y", list(range(17)))
    assert sched.num_matched_tokens(first, 0) == 16
    sched.plan_load(first, [40, 41, 42, 43, 44], 16)
    assert sched.hit_tokens_by_tier("x") == {"disk": 16}
    assert sched.num_matched_tokens(second, 0) == 16
    sched.plan_load(second, [50, 51, 52, 53, 54], 16)
    load_x, load_y = sched.plan_step([]).loads
    assert all(place_in(m, "disk") is not None for m in load_x.chunks)
    assert [m.after_job for m in load_y.chunks] == [load_x.job_id] * 2
    assert all(place_in(m, "disk") is None for m in load_y.chunks)
    # Chunk 1 failed its checksum on rank 1: it is dropped from disk and CPU.
    sched.on_report(WorkerReport(loaded={load_x.job_id: {0: frozenset(), 1: frozenset({1})}},
                                 bad_reads={load_x.job_id: {1: frozenset({1})}}))
    assert sched.cpu.state(req.block_hashes[1]) is SlotState.READY
    assert sched.cpu.state(req.block_hashes[3]) is None
    assert [e.key for e in disk_index.find_prefix([req.block_hashes[1],
                                                      req.block_hashes[3]])] == [
        req.block_hashes[1]]
    sched.on_report(WorkerReport(loaded={load_y.job_id: {0: frozenset(), 1: frozenset({1})}}))
    assert sched.cpu.counts()["pinned"] == 0
    assert not sched.has_pending_work()


def test_disk_hits_are_counted_once_per_scheduled_request(disk_index):
    """Regression: vLLM asks again while a request waits, and plan_load looks the chunks
    up again to pin them; the store's persistent hit counter used to count them twice."""
    store_two_chunks_on_disk(disk_index)
    sched, _ = make_scheduler(num_ranks=2, disk_index=disk_index)
    reader = make_request("x", list(range(17)))
    for _ in range(3):
        assert sched.num_matched_tokens(reader, 0) == 16
    sched.plan_load(reader, [40, 41, 42, 43, 44], 16)
    disk_index.flush_access()
    assert disk_index.stats()["counters"]["hits"] == 2


def test_a_timed_out_disk_load_keeps_the_entries(disk_index):
    """Regression: a load that only timed out (slow disk) used to drop its good entries
    like a checksum failure; now only chunks a rank found damaged are dropped."""
    req = store_two_chunks_on_disk(disk_index)
    sched, _ = make_scheduler(num_ranks=2, disk_index=disk_index)
    reader = make_request("x", list(range(17)))
    sched.num_matched_tokens(reader, 0)
    sched.plan_load(reader, [40, 41, 42, 43, 44], 16)
    (load,) = sched.plan_step([]).loads
    everything = frozenset({0, 1})
    sched.on_report(WorkerReport(loaded={load.job_id: {0: everything, 1: everything}}))
    assert sched.counters.load_errors == 2
    assert len(disk_index.find_prefix([req.block_hashes[1], req.block_hashes[3]])) == 2
    # The reads succeeded (no bad read reported): the staged chunks are valid, kept.
    assert sched.cpu.state(req.block_hashes[1]) is SlotState.READY
    assert sched.cpu.counts()["pinned"] == 0 and len(sched.cpu) == 2


def test_a_step_writes_the_disk_index_once(disk_index, monkeypatch):
    """The commits a report brings and the next step's reservations share one LMDB
    write transaction (each costs the scheduler thread far more than its work inside a
    busy engine); a step with only commits writes once too, and no step writes for
    nothing."""
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    writes = []
    env_write = disk_index._env.write
    monkeypatch.setattr(disk_index._env, "write", lambda fn: writes.append(1) or env_write(fn))
    first, second = make_request("a", list(range(17))), make_request("b", list(range(50, 67)))
    for req, ids in ((first, [0, 1, 2, 3, 4]), (second, [5, 6, 7, 8, 9])):
        sched.num_matched_tokens(req, 0)
        blocks[req.request_id] = ids
    (job,) = sched.plan_step([("a", 17)]).stores
    writes.clear()
    sched.on_report(WorkerReport(host_stored={job.job_id: 2},
                                 written={job.job_id: {"disk": {0: (1, 2), 1: (3, 4)}}}))
    (job_b,) = sched.plan_step([("b", 17)]).stores  # a's commits + b's reservations
    assert len(writes) == 1
    assert len(disk_index.find_prefix([first.block_hashes[1], first.block_hashes[3]])) == 2
    assert all(place_in(m, "disk") is not None for m in job_b.chunks)
    writes.clear()
    sched.on_report(WorkerReport(host_stored={job_b.job_id: 2},
                                 written={job_b.job_id: {"disk": {0: (5, 6), 1: (7, 8)}}}))
    sched.plan_step([])  # nothing new to store: the commits alone
    sched.plan_step([])  # nothing at all
    assert len(writes) == 1 and not sched.has_pending_work()
    assert len(disk_index.find_prefix([second.block_hashes[1], second.block_hashes[3]])) == 2


def _key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def test_a_loads_disk_fills_never_evict_a_disk_chunk_the_same_load_reads(tmp_path):
    """A load of a chunk on disk, then two only in the remote tier, on a full disk: the
    disk slots reserved to keep the remote chunks locally evicted the disk chunk before
    it was pinned, so one job read a slot and wrote another chunk into it."""
    index = DiskIndex.open(tmp_path / "s", namespace_id="ab", descriptor={}, slot_bytes=64,
                           num_ranks=1, capacity_bytes=2 * 64)
    tier = DiskTier(index)
    for k in (_key(1), _key(0)):  # the namespace is full; _key(1) is the older
        (slot,) = index.allocate([k])
        index.commit([(k, slot, (1000 + slot,))])
    planner = LoadPlanner(cpu=CpuIndex(8), tiers=[tier, RemoteIndex(None)],
                          counters=SchedulerCounters(), job_ids=itertools.count(1), num_ranks=1)
    (entry,) = tier.find("r", [_key(0)])
    run = [Source(_key(0), None, entry), Source(_key(10), None, Place("remote", _key(10))),
           Source(_key(11), None, Place("remote", _key(11)))]
    assert planner.plan("r", [_key(0), _key(10), _key(11)], run, [(0,), (1,), (2,)]) == [
        "disk", "remote", "remote"]
    (job,) = planner.take_pending()
    fills = {p.address for m in job.chunks for p in m.sinks}
    assert entry.address not in fills and len(index.find_prefix([_key(0)])) == 1
    assert fills == {1 - entry.address}, "the older entry made room for one fill"
    index.close()


def test_chunks_that_find_no_cpu_slot_evict_nothing_on_disk(tmp_path):
    """A store that got one CPU slot for four chunks evicted four disk entries (one per
    chunk) and gave three of the slots back unused."""
    index = DiskIndex.open(tmp_path / "s", namespace_id="ab" * 16, descriptor={},
                           slot_bytes=64, num_ranks=1, capacity_bytes=64 * 4)
    old = [_key(i) for i in range(4)]
    index.commit(list(zip(old, index.allocate(old), [(7,)] * 4)))  # the disk is full
    sched, blocks = make_scheduler(num_ranks=1, num_cpu_slots=1, disk_index=index)
    req = make_request("a", list(range(33)))  # 4 chunks
    sched.num_matched_tokens(req, 0)
    blocks["a"] = list(range(9))
    (job,) = sched.plan_step([("a", 33)]).stores
    assert len(job.chunks) == 1 and sched.counters.skipped_stores == 3
    assert sum(len(index.find_prefix([k])) for k in old) == 3
    index.close()


def test_a_burst_of_disk_hits_is_written_in_bounded_steps(tmp_path):
    """Hits moved entries in the disk LRU order only every ACCESS_FLUSH_INTERVAL_S: a
    burst of disk hits piled up and was written in one long transaction on the scheduler
    thread (16k hits: ~0.1 s). Now a step writes them once ACCESS_FLUSH_MAX_PENDING wait."""
    num_chunks = ACCESS_FLUSH_MAX_PENDING + 4
    index = DiskIndex.open(tmp_path / "s", namespace_id="ab" * 16, descriptor={},
                           slot_bytes=64, num_ranks=1, capacity_bytes=64 * (num_chunks + 1))
    req = make_request("a", [i % 251 for i in range(8 * num_chunks + 1)])
    keys = req.block_hashes[1::2]
    index.commit(list(zip(keys, index.allocate(keys), [(7,)] * num_chunks)))
    config = PlannerConfig(chunk_tokens=8, block_size=4, tokens_per_hash=4, num_ranks=1,
                           num_cpu_slots=num_chunks + 1)
    sched = OffloadScheduler(config, tiers=secondary_tiers(index), block_ids_of=lambda rid: [],
                             clock=lambda: 0.0)  # the interval never passes
    sched.num_matched_tokens(req, 0)
    assert index.num_pending_accesses() == num_chunks
    sched.plan_step([])
    assert index.num_pending_accesses() == 0
    index.close()


def test_a_full_reset_forgets_every_chunk_and_stops_the_shared_tiers(disk_index):
    """vLLM resets connectors around weight updates (pause_generation(clear_cache=True)):
    KV computed before must not be served again. Only the CPU tier's unpinned chunks were
    dropped; the disk kept serving, and a store in flight published its chunk after."""
    req = store_two_chunks_on_disk(disk_index)
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    assert sched.num_matched_tokens(req, 0) == 16  # from disk
    other = make_request("o", list(range(100, 117)))
    sched.num_matched_tokens(other, 0)
    blocks["o"] = [20, 21, 22, 23, 24]
    (job,) = sched.plan_step([("o", 17)]).stores  # a store in flight across the reset
    sched.reset_all()
    sched.on_report(WorkerReport(host_stored={job.job_id: 2}))
    assert sched.num_matched_tokens(make_request("o2", list(range(100, 117))), 0) == 0
    assert sched.num_matched_tokens(make_request("again", list(range(17))), 0) == 0
    assert not sched.disk_enabled


def test_nothing_is_loaded_or_stored_while_a_rank_reports_its_kv_cache_released():
    """Issue 32: once a worker reports that vLLM took its KV cache away
    (unregister_kv_caches), lookups answer 0 and no store is planned until every rank
    reported it back; chunks completed meanwhile are stored after, and the CPU tier kept
    what it held."""
    sched, blocks = make_scheduler(num_ranks=2)
    stored = make_request("a", list(range(17)))
    sched.num_matched_tokens(stored, 0)
    store_request(sched, blocks, stored, [0, 1, 2, 3, 4], ranks=2)
    sched.on_report(WorkerReport(paused={0: True}).merge(WorkerReport(paused={1: True})))
    assert sched.paused
    again = make_request("b", list(range(17)))
    assert sched.num_matched_tokens(again, 0) == 0
    sched.plan_load(again, [5, 6, 7, 8, 9], 0)
    running = make_request("c", [7] * 17)
    sched.num_matched_tokens(running, 0)
    blocks["c"] = [10, 11, 12, 13, 14]
    plan = sched.plan_step([("c", 17)])
    assert not plan.stores and not plan.loads and not sched.has_pending_work()
    sched.on_report(WorkerReport(paused={0: False}))
    assert sched.paused, "rank 1 has not restored its KV cache"
    assert not sched.plan_step([("c", 17)]).stores
    sched.on_report(WorkerReport(paused={1: False}))
    assert not sched.paused
    (job,) = sched.plan_step([("c", 17)]).stores  # completed while paused, stored now
    assert [m.block_ids for m in job.chunks] == [(10, 11), (12, 13)]
    assert sched.num_matched_tokens(make_request("d", list(range(17))), 0) == 16
