"""Regressions of issue 17 at the planner level: a lookup reports only what it can stage
and pin; a staged chunk lives while any job uses it; a load vLLM gave up is not retried.

The scheduler-level versions (vLLM's real Scheduler) are in test_vllm_harness.py.
"""

from planner_support import make_request, make_scheduler, store_request
from test_planner import store_two_chunks_on_disk

from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import SlotState
from kv_offload.testing.tiers import place_in

BLOCKS = [40, 41, 42, 43, 44]


def test_a_cpu_chunk_past_a_cpu_miss_is_loaded_from_the_cpu_not_staged_twice(disk_index):
    """Bug 1: disk holds chunks 0 and 1, the CPU tier chunk 1 only; plan_load reserved a
    staging slot for chunk 1 too and CpuIndex.reserve raised KeyError into vLLM."""
    req = store_two_chunks_on_disk(disk_index)
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    again = make_request("b", list(range(17)))
    sched.num_matched_tokens(again, 0)
    store_request(sched, blocks, again, [0, 1, 2, 3, 4], ranks=2)
    sched.cpu.discard(req.block_hashes[1])  # chunk 0 left the CPU tier, chunk 1 stayed
    reader = make_request("x", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16
    sched.plan_load(reader, BLOCKS, 16)
    (load,) = sched.plan_step([]).loads
    disk_move, cpu_move = load.chunks
    assert place_in(disk_move, "disk") is not None and place_in(cpu_move, "disk") is None
    assert cpu_move.cpu_slot is not None and sched.counters.load_errors == 0
    assert sched.hit_tokens_by_tier("x") == {"disk": 8, "cpu": 8}


def test_a_chunk_being_stored_ends_the_hit_even_when_it_is_on_disk(disk_index):
    """Bug 1, STORING variant: the chunk's CPU entry is not complete and cannot be
    staged over; the hit stops before it."""
    req = store_two_chunks_on_disk(disk_index)
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    writer = make_request("w", list(range(17)))
    sched.num_matched_tokens(writer, 0)
    blocks["w"] = [0, 1, 2, 3, 4]
    sched.plan_step([("w", 17)])  # both chunks STORING, copies not reported yet
    sched.cpu.discard(req.block_hashes[1])
    reader = make_request("x", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 8
    sched.plan_load(reader, BLOCKS, 8)
    (load,) = sched.plan_step([]).loads
    assert [place_in(m, "disk") is not None for m in load.chunks] == [True]


def test_the_hit_stops_where_no_cpu_slot_is_left_to_stage_into(disk_index):
    """Bug 3's trigger: a hit that cannot be staged became a failed load."""
    store_two_chunks_on_disk(disk_index)
    sched, _ = make_scheduler(num_ranks=2, disk_index=disk_index, num_cpu_slots=1)
    reader = make_request("x", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 8
    sched.plan_load(reader, BLOCKS, 8)
    (load,) = sched.plan_step([]).loads
    assert len(load.chunks) == 1 and load.chunks[0].cpu_slot is not None
    second = make_request("y", list(range(8)) + [99] * 9)
    assert sched.num_matched_tokens(second, 0) == 8, "shares the staging chunk"
    assert sched.counters.load_errors == 0


def staged_and_shared(disk_index):
    """Job A stages chunk 0 from disk; job B hits it while it stages."""
    req = store_two_chunks_on_disk(disk_index)
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index, num_cpu_slots=4)
    first, second = make_request("a", list(range(9))), make_request("b", list(range(9)))
    assert sched.num_matched_tokens(first, 0) == 8
    sched.plan_load(first, BLOCKS, 8)
    assert sched.num_matched_tokens(second, 0) == 8
    sched.plan_load(second, [50, 51, 52], 8)
    load_a, load_b = sched.plan_step([]).loads
    assert load_b.chunks[0].after_job == load_a.job_id
    return sched, blocks, req, load_a, load_b


def fill_cpu_tier(sched, blocks, n):
    """Store n fresh one-chunk requests; returns the CPU slots their stores took."""
    slots = []
    for i in range(n):
        req = make_request(f"f{i}", [100 + i] * 9)
        sched.num_matched_tokens(req, 0)
        blocks[req.request_id] = [60 + i, 70 + i, 80 + i]
        plan = sched.plan_step([(req.request_id, 9)])
        slots += [m.cpu_slot for job in plan.stores for m in job.chunks]
    return slots


def test_a_staged_chunk_read_intact_survives_a_failed_job(disk_index):
    """Bug 2: A's engine copy failed (or A timed out) although its disk read succeeded;
    the chunk was discarded and its slot reused while B still copied from it."""
    sched, blocks, req, load_a, load_b = staged_and_shared(disk_index)
    slot = load_a.chunks[0].cpu_slot
    sched.on_report(WorkerReport(loaded={load_a.job_id: {0: frozenset({0}), 1: frozenset({0})}}))
    assert sched.cpu.state(req.block_hashes[1]) is SlotState.READY
    assert slot not in fill_cpu_tier(sched, blocks, 3), "B still pins the slot"
    sched.on_report(WorkerReport(loaded={load_b.job_id: {0: frozenset(), 1: frozenset()}}))
    assert sched.cpu.counts()["pinned"] == 3  # the three stores, not reported yet


def test_a_bad_read_discards_the_chunk_but_keeps_the_slot_while_shared(disk_index):
    """Bug 2, failed read: the chunk is dropped, and its slot is not handed out before
    B, which waits on the same read, released it."""
    sched, blocks, req, load_a, load_b = staged_and_shared(disk_index)
    slot = load_a.chunks[0].cpu_slot
    sched.on_report(WorkerReport(loaded={load_a.job_id: {0: frozenset(), 1: frozenset({0})}},
                                 bad_reads={load_a.job_id: {1: frozenset({0})}}))
    assert sched.cpu.state(req.block_hashes[1]) is None
    assert disk_index.find_prefix([req.block_hashes[1]]) == []
    assert sched.cpu.counts()["discarded"] == 1
    assert slot not in fill_cpu_tier(sched, blocks, 3)
    sched.on_report(WorkerReport(loaded={load_b.job_id: {0: frozenset({0}), 1: frozenset({0})}}))
    assert sched.cpu.counts()["discarded"] == 0 and sched.cpu.counts()["free"] == 1


def test_a_load_vllm_gave_up_is_answered_later_then_as_a_miss_until_it_ran(disk_index):
    """Bug 3: vLLM 0.32 stalls a request re-admitted with an asynchronous hit after its
    load failed from the first block (docs/vllm-bugs.md)."""
    store_two_chunks_on_disk(disk_index)
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index)
    reader = make_request("x", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16
    sched.plan_load(reader, BLOCKS, 16)
    sched.plan_step([])
    # vLLM freed the blocks after the failed load and looks the request up again.
    assert sched.num_matched_tokens(reader, 0) is None
    assert sched.num_matched_tokens(reader, 0) == 0
    sched.plan_load(reader, BLOCKS, 0)
    blocks["x"] = BLOCKS
    sched.plan_step([("x", 16)])  # it ran
    assert sched.num_matched_tokens(reader, 0) == 16
    assert sched.counters.loads_given_up == 1
