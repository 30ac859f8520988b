"""The planner with a mamba group in vLLM's "align" mode (docs/architecture.md, "Mamba
state entries"): a chunk is stored only with the state vLLM handed over for its end
boundary, a lookup serves a run of such chunks (so it ends where a state is stored), a
load writes the state of its last chunk into the last block of the mamba table, and a
store copy of a state block that vLLM frees while the copy runs is fenced.

Blocks of 4 tokens, chunks of 8 (2 blocks); group 0 full attention, group 1 mamba. A
mamba table entry i holds the state after (i + 1) x 4 tokens or vLLM's null block (0).
"""

from planner_support import make_request

from kv_offload.groups import KVGroup
from kv_offload.jobs import SKIP_BLOCK, WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig

STATE = "conv(3,8)float32+ssm(2,4,4)float32"


def _mamba_scheduler():
    tables: dict = {}
    config = PlannerConfig(chunk_tokens=8, block_size=4, tokens_per_hash=4, num_ranks=1,
                           num_cpu_slots=16, groups=(KVGroup("full_attention", 1, 4),
                                                     KVGroup("mamba", 1, 4, state=STATE)))
    return OffloadScheduler(config, block_ids_of=lambda r: tables[r]), tables


def _copied(sched, plan):
    for job in plan.stores:
        sched.on_report(WorkerReport(host_stored={job.job_id: 1}))


def test_a_chunk_is_stored_only_with_the_state_handed_over_for_its_end():
    """A prefill step of 24 tokens: vLLM wrote (and handed over) only the state at 24;
    chunks 0 and 1 end inside the step and are not stored, chunk 2 is, with its state
    block. Hand-offs at other boundaries (a block end, not a chunk end) are ignored."""
    sched, tables = _mamba_scheduler()
    r = make_request("r", list(range(25)))
    sched.num_matched_tokens(r, 0)
    tables["r"] = ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 30, 31])
    plan = sched.plan_step([("r", 24)], boundary_states={"r": [(1, 30, 24), (1, 31, 28)]})
    (job,) = plan.stores
    assert [m.block_ids for m in job.chunks] == [(5, 6, 30)]
    assert sched.counters.stores_without_state == 2
    assert sched.counters.stores_without_window == 0


def test_a_state_block_not_at_its_place_in_the_table_is_not_stored():
    """The fence finds a state block by its place in the table: one handed over that is
    not there (vLLM's copy-on-write block of a partial hit) is never copied."""
    sched, tables = _mamba_scheduler()
    r = make_request("r", list(range(9)))
    sched.num_matched_tokens(r, 0)
    tables["r"] = ([1, 2], [0, 20])
    assert sched.plan_step([("r", 8)], boundary_states={"r": [(1, 99, 8)]}).stores == ()


def test_a_lookup_ends_at_the_last_chunk_whose_state_is_stored():
    """Chunks 0 and 2 were stored (their ends were step ends), chunk 1 was not: a run
    breaks there, so a request sharing all three loads chunk 0 only, and its load writes
    chunk 0's state into the last block vLLM allocated in its mamba table."""
    sched, tables = _mamba_scheduler()
    first = make_request("a", list(range(25)))
    sched.num_matched_tokens(first, 0)
    tables["a"] = ([1, 2], [0, 20])
    _copied(sched, sched.plan_step([("a", 8)], boundary_states={"a": [(1, 20, 8)]}))
    tables["a"] = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 21])
    _copied(sched, sched.plan_step([("a", 24)], boundary_states={"a": [(1, 21, 24)]}))
    assert sched.counters.chunks_stored_cpu == 2
    second = make_request("b", list(range(25)))
    assert sched.num_matched_tokens(second, 0) == 8
    sched.plan_load(second, ([41, 42], [0, 50]), 8)
    (load,) = sched.take_pending_loads()
    assert [m.block_ids for m in load.chunks] == [(41, 42, 50)]


def test_only_the_last_chunk_of_a_load_loads_its_state():
    sched, tables = _mamba_scheduler()
    first = make_request("a", list(range(17)))
    sched.num_matched_tokens(first, 0)
    tables["a"] = ([1, 2], [0, 20])
    _copied(sched, sched.plan_step([("a", 8)], boundary_states={"a": [(1, 20, 8)]}))
    tables["a"] = ([1, 2, 3, 4], [0, 20, 0, 21])
    _copied(sched, sched.plan_step([("a", 16)], boundary_states={"a": [(1, 21, 16)]}))
    second = make_request("b", list(range(17)))
    assert sched.num_matched_tokens(second, 4) == 12, "from vLLM's local hit at 4 on"
    sched.plan_load(second, ([41, 42, 43, 44], [45, 0, 0, 50]), 12)
    (load,) = sched.take_pending_loads()
    assert [m.block_ids for m in load.chunks] == [(SKIP_BLOCK, 42, SKIP_BLOCK),
                                                  (43, 44, 50)]


def test_a_running_request_whose_state_block_vllm_freed_under_a_copy_is_fenced():
    """vLLM frees a state block two allocations later (the next state was copied from
    it) and may give it to any request in the same schedule(): a copy still reading it
    is fenced before that step's forward."""
    sched, tables = _mamba_scheduler()
    r = make_request("r", list(range(30)))
    sched.num_matched_tokens(r, 0)
    tables["r"] = ([1, 2], [0, 20])
    (job,) = sched.plan_step([("r", 8)], boundary_states={"r": [(1, 20, 8)]}).stores
    assert job.chunks[0].block_ids == (1, 2, 20)
    tables["r"] = ([1, 2, 3], [0, 20, 21])
    assert sched.plan_step([("r", 9)]).preempted == (), "not freed yet: no fence"
    tables["r"] = ([1, 2, 3], [0, 0, 21])  # freed: back in the pool
    assert sched.plan_step([("r", 10)]).preempted == ("r",)
    assert sched.plan_step([("r", 11)]).preempted == (), "fenced once"


def test_a_finishing_request_whose_state_block_vllm_freed_is_fenced_not_held():
    """vLLM frees a finishing request's skipped state blocks before it calls
    request_finished_all_groups: holding the request cannot keep them."""
    sched, tables = _mamba_scheduler()
    for name, first in (("a", 0), ("b", 100)):
        sched.num_matched_tokens(make_request(name, list(range(first, first + 9))), 0)
    tables["a"], tables["b"] = ([1, 2], [0, 20]), ([3, 4], [0, 22])
    sched.plan_step([("a", 8), ("b", 8)],
                    boundary_states={"a": [(1, 20, 8)], "b": [(1, 22, 8)]})
    assert sched.request_finished("a", ([1, 2], [0, 0])) is False
    assert sched.request_finished("b", ([3, 4], [0, 22])) is True, "nothing freed"
    plan = sched.plan_step([])
    assert plan.preempted == ("a",) and plan.held == ("b",)
