"""Which hits load in the step that schedules their request (issue 29): CPU-tier chunks
READY in host RAM, within the step's copy budget, on single-group layouts; everything
else waits outside the batch as before."""

from __future__ import annotations

import pytest
from planner_support import BLOCK, CHUNK, make_request, store_request

from kv_offload.groups import KVGroup
from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig
from kv_offload.scheduler.same_step import MIN_MEASURED_BYTES, SameStepBudget
from kv_offload.testing.tiers import secondary_tiers

MB = 1 << 20


def make(*, budget_s=0.01, chunk_bytes=MB, bytes_per_s=1e9, groups=(), disk_index=None,
         num_cpu_slots=16):
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=1, num_cpu_slots=num_cpu_slots, groups=groups,
                           same_step_budget_s=budget_s, chunk_bytes=chunk_bytes)
    blocks: dict = {}
    sched = OffloadScheduler(config, tiers=secondary_tiers(disk_index),
                             block_ids_of=lambda r: blocks[r])
    if sched.same_step is not None:
        sched.same_step.bytes_per_s = bytes_per_s
    return sched, blocks


def stored(sched, blocks, tokens=17):
    """A request of ``tokens`` tokens stored in the CPU tier (two chunks for 17)."""
    req = make_request("w", list(range(tokens)))
    sched.num_matched_tokens(req, 0)
    store_request(sched, blocks, req, list(range(tokens // BLOCK + 1)))
    return req


def test_a_cpu_tier_hit_within_the_budget_loads_in_the_same_step():
    sched, blocks = make()  # 10 ms at 1 GB/s: 10 chunks of 1 MiB
    stored(sched, blocks)
    reader = make_request("r", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16
    assert not sched.load_is_async("r")
    sched.plan_load(reader, [20, 21, 22, 23, 24], 16)
    blocks["r"] = [20, 21, 22, 23, 24]
    (load,) = sched.plan_step([("r", 17)]).loads
    assert load.same_step and [m.block_ids for m in load.chunks] == [(20, 21), (22, 23)]
    assert sched.counters.loads_same_step == 1
    assert sched.cpu.counts()["pinned"] == 2  # until the workers report it
    sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset()}}))
    assert sched.cpu.counts()["pinned"] == 0 and not sched.has_pending_work()


def test_hits_past_the_steps_budget_load_asynchronously_until_the_next_step():
    sched, blocks = make(budget_s=0.003)  # 3 chunks a step
    stored(sched, blocks)
    first, second = make_request("r1", list(range(17))), make_request("r2", list(range(17)))
    assert sched.num_matched_tokens(first, 0) == 16 and not sched.load_is_async("r1")
    assert sched.num_matched_tokens(second, 0) == 16 and sched.load_is_async("r2")
    sched.plan_step([])
    assert sched.num_matched_tokens(second, 0) == 16 and not sched.load_is_async("r2")


def test_the_budget_follows_the_measured_bandwidth():
    budget = SameStepBudget(0.01, MB, bytes_per_s=1e9)
    budget.observe(MIN_MEASURED_BYTES - 1, 1.0)  # too small to say anything
    assert budget.bytes_per_s == 1e9
    for _ in range(50):
        budget.observe(10 * MB, 0.1)  # 100 MiB/s
    assert budget.bytes_per_s == pytest.approx(100 * MB, rel=0.01)
    assert budget.take(1) and not budget.take(1)  # ~1 MiB a step now
    with pytest.raises(ValueError, match="chunk_bytes"):
        SameStepBudget(0.01, 0)


def test_disk_hits_and_staging_chunks_load_asynchronously(disk_index):
    from test_planner import store_two_chunks_on_disk

    store_two_chunks_on_disk(disk_index)
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=2, num_cpu_slots=16, same_step_budget_s=1.0,
                           chunk_bytes=64)
    sched = OffloadScheduler(config, tiers=secondary_tiers(disk_index), block_ids_of=lambda r: [])
    first, second = make_request("x", list(range(17))), make_request("y", list(range(17)))
    assert sched.num_matched_tokens(first, 0) == 16 and sched.load_is_async("x")
    sched.plan_load(first, [40, 41, 42, 43, 44], 16)
    assert not sched.take_pending_loads()[0].same_step
    # Its chunks are STAGING in the CPU tier now: still not loadable before a forward.
    assert sched.num_matched_tokens(second, 0) == 16 and sched.load_is_async("y")


@pytest.mark.parametrize("why", ["off", "groups"])
def test_no_same_step_loads_when_off_or_with_several_kv_cache_groups(why):
    groups = (KVGroup("full_attention", 1, BLOCK), KVGroup("sliding_window", 1, BLOCK, 5))
    sched, blocks = make(budget_s=0 if why == "off" else 0.01,
                         groups=groups if why == "groups" else ())
    assert sched.same_step is None
    if why == "off":
        stored(sched, blocks)
        assert sched.num_matched_tokens(make_request("r", list(range(17))), 0) == 16
        assert sched.load_is_async("r")


def test_a_chunk_evicted_between_lookup_and_allocation_fails_instead_of_staging():
    """vLLM runs a same-step request in the step it schedules it: a chunk that left the
    CPU tier meanwhile (another request's load staged over it) cannot be read from disk
    before the forward, so it is a failed move (vLLM recomputes it), not a staged one."""
    sched, blocks = make()
    writer = stored(sched, blocks)
    reader = make_request("r", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16 and not sched.load_is_async("r")
    sched.cpu.discard_all()  # what an eviction in between leaves
    sched.plan_load(reader, [20, 21, 22, 23, 24], 16)
    blocks["r"] = [20, 21, 22, 23, 24]
    (load,) = sched.plan_step([("r", 17)]).loads
    assert load.same_step and all(m.cpu_slot is None for m in load.chunks)
    assert sched.counters.load_errors == 2 and writer.request_id == "w"


def test_a_same_step_request_that_fails_to_plan_gets_a_same_step_failure():
    sched, blocks = make()
    stored(sched, blocks)
    reader = make_request("r", list(range(17)))
    sched.num_matched_tokens(reader, 0)
    sched.fail_load("r", [20, 21, 22, 23, 24], 16)
    (load,) = sched.plan_step([]).loads
    assert load.same_step and load.chunks[0].cpu_slot is None


def test_a_same_step_request_that_fails_to_plan_reports_its_hits_blocks():
    """A synchronous hit's table holds the hit's blocks and those of the tokens computed
    in this step: the failure names the hit's (vLLM truncates at the first one it finds
    below what it counts as computed), not the table's tail (review of issue 29)."""
    sched, blocks = make()
    stored(sched, blocks)
    reader = make_request("r", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16 and not sched.load_is_async("r")
    sched.fail_load("r", [20, 21, 22, 23, 24], 16)  # 24: the token this step computes
    (load,) = sched.plan_step([]).loads
    assert load.same_step and set(load.chunks[0].block_ids) == {20, 21, 22, 23}


def test_why_same_step_loads_are_off():
    from kv_offload.scheduler.same_step import why_off

    base = dict(async_scheduling=False, inflight_loads=False, remote_and_tp=False,
                prefix_cache_kept=False)
    assert why_off(**base) == ""
    for name in base:
        assert why_off(**{**base, name: True}), name


def test_an_asynchronous_hit_under_min_async_hit_tokens_past_vllms_hit_is_not_reported():
    """The chat benchmark's turn 1: vLLM's own prefix cache holds the shared system prompt
    to its last whole block, and a request tail in the CPU tier holds a few tokens more.
    Loaded asynchronously those few tokens cost the request a step outside the batch, more
    than computing them: not reported. Same-step, or more tokens past vLLM's hit (counted
    from ``num_computed_tokens``, not from 0), they are."""
    def planner(*, budget_s, min_tokens=BLOCK):
        config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                               num_ranks=1, num_cpu_slots=16, partial_hits=True,
                               same_step_budget_s=budget_s, chunk_bytes=MB,
                               min_async_hit_tokens=min_tokens)
        blocks: dict = {}
        sched = OffloadScheduler(config, block_ids_of=lambda r: blocks[r])
        stored_req = make_request("w", list(range(14)))  # chunk 0, then a 6-token tail
        sched.num_matched_tokens(stored_req, 0)
        store_request(sched, blocks, stored_req, [0, 1, 2, 3])
        assert sched.counters.tails_stored == 1
        return sched

    three_past = make_request("r", [*range(11), 100, 101, 102])  # 3 tail tokens past 8
    six_past = make_request("s", [*range(14), 100])
    sched = planner(budget_s=0)  # every hit loads asynchronously
    assert sched.num_matched_tokens(three_past, 8) == 0  # vLLM holds 2 blocks (8 tokens)
    assert sched.num_matched_tokens(three_past, 0) == 11  # the chunk and the 3 tokens
    assert sched.num_matched_tokens(six_past, 8) == 6
    assert planner(budget_s=0, min_tokens=0).num_matched_tokens(three_past, 8) == 3
    same_step = planner(budget_s=1.0)
    assert same_step.num_matched_tokens(three_past, 8) == 3
    assert not same_step.load_is_async("r")
