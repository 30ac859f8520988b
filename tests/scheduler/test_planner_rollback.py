"""A load or store whose planning raises midway gives back everything it took. vLLM's
hook guard then fails the load (the request recomputes) or skips the step's stores, and
no pin, staging or storing slot, disk pin or disk reservation is left behind to shrink
the tiers, or to end every later hit on the prefix at a chunk that never completes."""

import lmdb
import pytest
from planner_support import make_request, make_scheduler
from test_planner import store_two_chunks_on_disk

from kv_offload.disk import DiskIndex
from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import SlotState
from kv_offload.testing.tiers import place_in

BLOCKS = [40, 41, 42, 43, 44]


def failing_on_call(fn, n):
    """``fn``, except that its ``n``-th call raises RuntimeError."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(args)
        if len(calls) == n:
            raise RuntimeError("injected")
        return fn(*args, **kwargs)
    return wrapper


@pytest.mark.parametrize("fail_at", ["second disk pin", "second staging slot"])
def test_a_load_that_fails_while_planned_holds_nothing(disk_index, monkeypatch, fail_at):
    store_two_chunks_on_disk(disk_index)
    sched, _ = make_scheduler(num_ranks=2, disk_index=disk_index, num_cpu_slots=4)
    reader = make_request("x", list(range(17)))
    assert sched.num_matched_tokens(reader, 0) == 16  # both chunks staged from disk
    if fail_at == "second disk pin":
        monkeypatch.setattr(sched.tier("disk"), "pin", failing_on_call(sched.tier("disk").pin, 2))
    else:
        monkeypatch.setattr(sched.cpu, "reserve", failing_on_call(sched.cpu.reserve, 2))
    with pytest.raises(RuntimeError, match="injected"):
        sched.plan_load(reader, BLOCKS, 16)
    sched.fail_load("x", BLOCKS, 16)  # what the hook guard does next
    monkeypatch.undo()

    assert sched.cpu.counts()["free"] == 4, sched.cpu.counts()
    assert sched.cpu.counts()["pinned"] == 0
    assert all(sched.cpu.state(k) is None for k in reader.block_hashes)
    assert disk_index.stats()["pinned"] == 0
    (failed,) = sched.plan_step([]).loads
    assert [m.cpu_slot for m in failed.chunks] == [None]  # every block reported failed

    # the next request on the prefix stages both chunks anew, after no phantom job
    again = make_request("y", list(range(17)))
    assert sched.num_matched_tokens(again, 0) == 16
    sched.plan_load(again, BLOCKS, 16)
    (load,) = sched.plan_step([]).loads
    assert [m.after_job for m in load.chunks] == [None, None]
    assert all(place_in(m, "disk") is not None and m.cpu_slot is not None for m in load.chunks)
    assert {sched.cpu.state(k) for k in (again.block_hashes[1], again.block_hashes[3])} == {
        SlotState.STAGING}


def test_a_store_that_fails_while_planned_leaves_no_chunk_storing(disk_index, monkeypatch):
    sched, blocks = make_scheduler(num_ranks=2, disk_index=disk_index, num_cpu_slots=4)
    writer = make_request("w", list(range(17)))
    sched.num_matched_tokens(writer, 0)
    blocks["w"] = [0, 1, 2, 3, 4]
    monkeypatch.setattr(sched.cpu, "reserve", failing_on_call(sched.cpu.reserve, 2))
    with pytest.raises(RuntimeError, match="injected"):
        sched.plan_step([("w", 17)])
    monkeypatch.undo()

    assert sched.cpu.counts()["free"] == 4 and sched.cpu.counts()["storing"] == 0
    sched.plan_step([])  # vLLM's next step writes the queued releases
    assert disk_index.stats()["reserved"] == 0
    # another request on the same prompt finds nothing half-stored and stores it whole
    other = make_request("o", list(range(17)))
    assert sched.num_matched_tokens(other, 0) == 0
    blocks["o"] = [5, 6, 7, 8, 9]
    (job,) = sched.plan_step([("o", 17)]).stores
    assert len(job.chunks) == 2 and all(place_in(m, "disk") is not None for m in job.chunks)


def test_a_job_that_fails_to_complete_does_not_keep_the_others_of_its_report(monkeypatch):
    from kv_offload.jobs import WorkerReport

    sched, blocks = make_scheduler(num_cpu_slots=4)
    jobs = []
    for name, first in (("a", 0), ("b", 100)):
        req = make_request(name, list(range(first, first + 9)))
        sched.num_matched_tokens(req, 0)
        blocks[name] = [first, first + 1, first + 2]
        (job,) = sched.plan_step([(name, 9)]).stores
        jobs.append((req, job))
    (req_a, job_a), (req_b, job_b) = jobs
    on_copied = sched.stores.on_copied

    def broken_for_a(job_id, *args):
        if job_id == job_a.job_id:
            raise RuntimeError("injected")
        return on_copied(job_id, *args)
    monkeypatch.setattr(sched.stores, "on_copied", broken_for_a)
    sched.on_report(WorkerReport(host_stored={job_a.job_id: 1, job_b.job_id: 1}))

    assert sched.counters.hook_errors == 1
    assert sched.cpu.state(req_b.block_hashes[1]) is SlotState.READY
    assert sched.num_matched_tokens(make_request("c", list(range(100, 109))), 0) == 8


def test_an_unexpected_index_error_in_the_step_turns_the_tier_off_and_keeps_its_loads(
        tmp_path, monkeypatch):
    """An LMDB error that is no StoreError (growing the map failed) in the step's commit
    transaction escaped the disk tier's guard after plan_step had taken the step's loads:
    the connector's fallback plan found none, and the request waited for its load forever.
    Now the tier turns off (as for any index failure) and the loads go out."""
    index = DiskIndex.open(tmp_path / "s", namespace_id="ab" * 16, descriptor={},
                           slot_bytes=64, num_ranks=2, capacity_bytes=64 * 2 * 8)
    sched, blocks = make_scheduler(num_ranks=2, disk_index=index)
    a = make_request("a", list(range(17)))
    sched.num_matched_tokens(a, 0)
    blocks["a"] = [0, 1, 2, 3, 4]
    (job,) = sched.plan_step([("a", 17)]).stores
    sched.on_report(WorkerReport(host_stored={job.job_id: 2},
                                 written={job.job_id: {"disk": {0: (1, 2), 1: (3, 4)}}}))
    assert sched.tier("disk").has_queued()  # the commits wait for the next step's write
    b = make_request("b", list(range(17)))
    assert sched.num_matched_tokens(b, 0) == 16  # a CPU-tier hit
    sched.plan_load(b, [10, 11, 12, 13, 14], 16)

    def failing_write(fn):
        raise lmdb.Error("mdb_env_set_mapsize: Cannot allocate memory")
    monkeypatch.setattr(index._env, "write", failing_write)
    plan = sched.plan_step([], ())
    assert [load.req_id for load in plan.loads] == ["b"]
    assert not sched.disk_enabled
    monkeypatch.undo()
    index.close()
