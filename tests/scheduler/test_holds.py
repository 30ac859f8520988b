"""Which finished requests vLLM must keep the blocks of (``BlockHolds``, invariant 3).

Holding too little lets a store copy read blocks vLLM gave to another request; holding a
request vLLM already keeps for its load frees it twice (vLLM asserts, the engine dies).
"""

from planner_support import make_request, make_scheduler

from kv_offload.jobs import WorkerReport
from kv_offload.scheduler.holds import BlockHolds


def test_a_request_finishing_while_its_blocks_are_copied_is_held_until_released():
    holds = BlockHolds()
    holds.copying(1, ["a", "b"])
    holds.copied(1)
    assert not holds.finish("b"), "its copy is done: nothing to hold"
    holds.copying(2, ["a"])
    assert holds.finish("a") and holds.take_new() == ("a",) and holds.num_held() == 1
    assert not holds.finish("a"), "held once"
    holds.released(["a"])
    assert holds.num_held() == 0 and not holds.is_copying("a")


def test_a_fenced_request_is_not_held_for_its_old_copies_but_for_new_ones():
    holds = BlockHolds()
    holds.copying(1, ["a", "b"])
    holds.forget(["a"])  # preempted: the fence protects its freed blocks
    assert not holds.is_copying("a") and not holds.finish("a")
    holds.copying(2, ["a"])  # it ran again and is being copied again
    holds.copied(1)
    assert holds.is_copying("a") and holds.finish("a")
    assert holds.is_copying("b") is False, "job 1 was b's only copy"


def test_a_request_waiting_for_its_load_is_never_held():
    """vLLM keeps its blocks until finished_recving by itself."""
    sched, blocks = make_scheduler()
    a = make_request("a", list(range(17)))
    sched.num_matched_tokens(a, 0)
    blocks["a"] = [0, 1, 2, 3, 4]
    (job,) = sched.plan_step([("a", 17)]).stores
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    b = make_request("b", list(range(17)))
    assert sched.num_matched_tokens(b, 0) == 16
    sched.plan_load(b, [10, 11, 12, 13, 14], 16)
    sched.holds.copying(99, ["b"])  # as if an older copy of its blocks were unreported
    assert sched.request_finished("b") is False


def test_a_request_preempted_and_resumed_in_one_step_is_held_for_its_new_copy():
    """Issue 27: vLLM's reset with running requests preempts a request and resumes it in
    the same schedule(). Its old copy is fenced, but the store job of its new blocks was
    planned before the fence and forgotten with it: had it finished before that copy
    ended, vLLM would have freed blocks under the copy and published wrong bytes."""
    sched, blocks = make_scheduler()
    r = make_request("r", list(range(17)))
    sched.num_matched_tokens(r, 0)
    blocks["r"] = [0, 1, 2, 3, 4]
    (old,) = sched.plan_step([("r", 8)]).stores  # chunk 0, still copying
    blocks["r"] = [5, 6, 7, 8, 9]  # preempted, resumed on new blocks
    plan = sched.plan_step([("r", 16)], preempted=["r"])
    (new,) = plan.stores
    assert plan.preempted == ("r",), "the old copy is fenced"
    assert [m.block_ids for m in new.chunks] == [(7, 8)]
    assert sched.holds.is_copying("r"), "the new copy must still protect its blocks"
    sched.on_report(WorkerReport(host_stored={old.job_id: 1}))
    assert sched.request_finished("r") is True, "held until the new copy is done"
    sched.on_report(WorkerReport(host_stored={new.job_id: 1}))
    assert sched.plan_step([]).held == ("r",)


def test_a_preempted_request_without_old_copies_is_not_fenced():
    sched, blocks = make_scheduler()
    r = make_request("r", list(range(17)))
    sched.num_matched_tokens(r, 0)
    blocks["r"] = [0, 1, 2, 3, 4]
    plan = sched.plan_step([("r", 8)], preempted=["r"])
    assert plan.preempted == () and len(plan.stores) == 1
    assert sched.holds.is_copying("r")


def _hybrid_scheduler():
    """A full-attention group and a sliding-window group of window 5 (tail: 1 block of
    the 2-block chunk), blocks of 4 tokens."""
    from kv_offload.groups import KVGroup
    from kv_offload.scheduler import OffloadScheduler, PlannerConfig

    tables: dict = {}
    config = PlannerConfig(chunk_tokens=8, block_size=4, tokens_per_hash=4, num_ranks=1,
                           num_cpu_slots=16, groups=(KVGroup("full_attention", 1, 4),
                                                     KVGroup("sliding_window", 1, 4, 5)))
    return OffloadScheduler(config, block_ids_of=lambda r: tables[r]), tables


def test_a_running_request_whose_window_block_was_freed_under_a_copy_is_fenced():
    """vLLM frees sliding-window blocks that left the window while the request runs and
    may give them to another request in the same schedule(): a copy still reading one
    must be fenced before that step's forward, like a preempted request's."""
    sched, tables = _hybrid_scheduler()
    r = make_request("r", list(range(17)))
    sched.num_matched_tokens(r, 0)
    tables["r"] = ([1, 2, 3], [11, 12, 13])
    (job,) = sched.plan_step([("r", 8)]).stores
    assert job.chunks[0].block_ids == (1, 2, 12), "the full chunk, then the window's tail"
    tables["r"] = ([1, 2, 3], [11, 12, 13])
    assert sched.plan_step([("r", 9)]).preempted == (), "nothing freed: no fence"
    tables["r"] = ([1, 2, 3], [0, 0, 13])  # the window moved on: 12 went back to the pool
    assert sched.plan_step([("r", 12)]).preempted == ("r",)
    assert not sched.holds.is_copying("r")
    assert sched.plan_step([("r", 13)]).preempted == (), "fenced once"


def test_a_window_block_freed_and_given_back_to_the_same_request_counts_as_freed():
    sched, tables = _hybrid_scheduler()
    r = make_request("r", list(range(17)))
    sched.num_matched_tokens(r, 0)
    tables["r"] = ([1, 2, 3], [11, 12, 13])
    sched.plan_step([("r", 8)])
    tables["r"] = ([1, 2, 3, 4], [0, 0, 13, 12])  # 12 now holds a later position
    assert sched.plan_step([("r", 13)]).preempted == ("r",)


def test_a_finishing_request_whose_window_block_vllm_freed_is_fenced_not_held():
    """vLLM frees a finishing request's out-of-window blocks before it calls
    request_finished_all_groups, so holding the request cannot keep them."""
    sched, tables = _hybrid_scheduler()
    for name, first in (("a", 0), ("b", 100)):
        req = make_request(name, list(range(first, first + 9)))
        sched.num_matched_tokens(req, 0)
    tables["a"], tables["b"] = ([1, 2, 3], [11, 12, 13]), ([4, 5, 6], [14, 15, 16])
    sched.plan_step([("a", 8), ("b", 8)])
    assert sched.request_finished("a", ([1, 2, 3], [0, 0, 13])) is False
    assert sched.request_finished("b", ([4, 5, 6], [14, 15, 16])) is True, "nothing freed"
    plan = sched.plan_step([])
    assert plan.preempted == ("a",) and plan.held == ("b",)
