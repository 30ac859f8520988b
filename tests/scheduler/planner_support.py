"""Builders shared by the planner tests: fake requests with chained hashes, schedulers."""

import time

from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig
from kv_offload.testing.requests import FakeRequest
from kv_offload.testing.tiers import secondary_tiers

BLOCK = 4  # tokens per block (and per hash)
CHUNK = 8  # tokens per chunk: 2 blocks


def make_request(req_id: str, tokens: list[int], **attributes) -> FakeRequest:
    """A request of ``tokens`` (all of them its prompt) hashed at ``BLOCK`` tokens per block;
    ``attributes``: the optional ones of vLLM's Request (``FakeRequest``)."""
    return FakeRequest(req_id, tokens, block_size=BLOCK, **attributes)


def skipping(req: FakeRequest, attribute: str, value: bool = True) -> FakeRequest:
    """A copy of ``req`` that must not read cached KV (``prompt_logprobs``), as each vLLM
    says it: ``attribute`` (``skip_reading_external_kv``, vLLM 0.34's, or
    ``skip_reading_prefix_cache``, 0.32's) set to ``value``."""
    return req.with_attributes(**{attribute: value})


def make_scheduler(*, num_ranks=1, num_cpu_slots=16, disk_index=None, blocks=None,
                   remote=None, partial_hits=False, clock=time.monotonic):
    blocks = blocks if blocks is not None else {}
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=num_ranks, num_cpu_slots=num_cpu_slots,
                           partial_hits=partial_hits)
    sched = OffloadScheduler(config, tiers=secondary_tiers(disk_index, remote),
                             block_ids_of=lambda rid: blocks[rid], clock=clock)
    return sched, blocks


def store_request(sched, blocks, req, block_ids, *, ranks=1):
    """Schedule ``req`` fully and complete its stores on ``ranks`` ranks; returns the job of
    its whole chunks (with ``partial_hits`` its tail, past them, is a job of its own)."""
    blocks[req.request_id] = block_ids
    plan = sched.plan_step([(req.request_id, req.num_tokens)])
    (job,) = [j for j in plan.stores if j.audited]
    for _ in range(ranks):
        sched.on_report(WorkerReport(host_stored={j.job_id: 1 for j in plan.stores}))
    return job
