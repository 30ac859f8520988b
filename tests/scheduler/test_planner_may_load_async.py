"""``OffloadScheduler.may_load_async`` (vLLM 0.34's question as a request enters the
waiting queues; issue 32 §3): yes when the CPU tier holds the request's first chunk and a
load could take it, from the CPU index alone, with no side effect."""

from planner_support import BLOCK, CHUNK, make_request, make_scheduler, skipping, store_request

from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig


def stored_scheduler(**kwargs):
    """A scheduler whose CPU tier holds chunks 0 and 1 of ``list(range(17))``."""
    sched, blocks = make_scheduler(**kwargs)
    writer = make_request("w", list(range(17)))
    sched.num_matched_tokens(writer, 0)
    store_request(sched, blocks, writer, [0, 1, 2, 3, 4], ranks=kwargs.get("num_ranks", 1))
    return sched, blocks


def test_yes_when_the_cpu_tier_holds_the_first_chunk_and_a_load_could_take_it():
    sched, _ = stored_scheduler()
    before = sched.cpu.counts()
    assert sched.may_load_async(make_request("r", list(range(9))))  # chunk 0 + 1 token
    assert sched.may_load_async(make_request("r", list(range(8)) + [99] * 9))  # diverges later
    assert not sched.may_load_async(make_request("r", list(range(CHUNK))))  # no token left
    assert not sched.may_load_async(make_request("r", [99] + list(range(1, 17))))
    assert not sched.may_load_async(make_request("r", list(range(3))))  # no full hash
    assert sched.cpu.counts() == before and not sched.has_pending_work()  # read-only


def test_another_salt_or_adapter_never_matches():
    """Keys are vLLM's chained block hashes: a cache_salt or LoRA changes every hash of
    the prompt (modelled here by another root), so the same tokens do not match."""
    sched, _ = stored_scheduler()
    salted = make_request("r", list(range(17)))
    salted.block_hashes = [b"salt" + h for h in salted.block_hashes]
    assert not sched.may_load_async(salted)


def test_no_for_a_chunk_still_being_stored_while_paused_or_when_hits_are_discarded():
    sched, blocks = make_scheduler(num_ranks=2)
    writer = make_request("w", list(range(17)))
    sched.num_matched_tokens(writer, 0)
    blocks["w"] = [0, 1, 2, 3, 4]
    (job,) = sched.plan_step([("w", 17)]).stores
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))  # one rank of two
    reader = make_request("r", list(range(17)))
    assert not sched.may_load_async(reader)  # STORING: no load may read it yet
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    assert sched.may_load_async(reader)
    assert not sched.may_load_async(skipping(reader, "skip_reading_external_kv"))
    sched.on_report(WorkerReport(paused={0: True}))
    assert not sched.may_load_async(reader)


def test_no_while_same_step_loads_are_on():
    """With same-step loads (issue 29) a READY CPU-tier hit is answered synchronously: a
    yes would be wrong, and vLLM would hold the request (and every load behind it) at the
    head of its queue while the batch is full."""
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=1, num_cpu_slots=16, same_step_budget_s=0.01,
                           chunk_bytes=1 << 20)
    blocks: dict = {}
    sched = OffloadScheduler(config, block_ids_of=lambda r: blocks[r])
    writer = make_request("w", list(range(17)))
    sched.num_matched_tokens(writer, 0)
    store_request(sched, blocks, writer, [0, 1, 2, 3, 4])
    reader = make_request("r", list(range(17)))
    assert not sched.may_load_async(reader)
    assert sched.num_matched_tokens(reader, 0) == 16 and not sched.load_is_async("r")
