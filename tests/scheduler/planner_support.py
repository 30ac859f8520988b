"""Builders shared by the planner tests: fake requests with chained hashes, schedulers."""

import hashlib
from dataclasses import dataclass

from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig
from kv_offload.testing.tiers import secondary_tiers

BLOCK = 4  # tokens per block (and per hash)
CHUNK = 8  # tokens per chunk: 2 blocks


@dataclass
class FakeRequest:
    request_id: str
    block_hashes: list
    num_tokens: int
    num_prompt_tokens: int


@dataclass
class SkippingRequest(FakeRequest):
    """A request that must not read cached KV (``prompt_logprobs``), as each vLLM says it."""

    skip_reading_external_kv: bool | None = None  # vLLM 0.34's Request
    skip_reading_prefix_cache: bool | None = None  # vLLM 0.32's


def skipping(req: FakeRequest, attribute: str, value: bool = True) -> SkippingRequest:
    """``req`` with ``attribute`` (one of SkippingRequest's) set to ``value``."""
    out = SkippingRequest(req.request_id, req.block_hashes, req.num_tokens,
                          req.num_prompt_tokens)
    for name in ("skip_reading_external_kv", "skip_reading_prefix_cache"):
        setattr(out, name, getattr(req, name, None))
    setattr(out, attribute, value)
    return out


def make_request(req_id: str, tokens: list[int]) -> FakeRequest:
    hashes, parent = [], b"root"
    for i in range(len(tokens) // BLOCK):
        parent = hashlib.sha256(parent + bytes(tokens[i * BLOCK:(i + 1) * BLOCK])).digest()
        hashes.append(parent)
    return FakeRequest(req_id, hashes, len(tokens), len(tokens))


def make_scheduler(*, num_ranks=1, num_cpu_slots=16, disk_index=None, blocks=None,
                   remote=None, partial_hits=False):
    blocks = blocks if blocks is not None else {}
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=num_ranks, num_cpu_slots=num_cpu_slots,
                           partial_hits=partial_hits)
    sched = OffloadScheduler(config, tiers=secondary_tiers(disk_index, remote),
                             block_ids_of=lambda rid: blocks[rid])
    return sched, blocks


def store_request(sched, blocks, req, block_ids, *, ranks=1):
    """Schedule ``req`` fully and complete its store on ``ranks`` ranks; returns the job."""
    blocks[req.request_id] = block_ids
    plan = sched.plan_step([(req.request_id, req.num_tokens)])
    (job,) = plan.stores
    for _ in range(ranks):
        sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    return job
