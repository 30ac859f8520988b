"""A seeded random workload for SchedulerHarness: shared prefixes, aborts (also while
loading), preemption under a small block pool, prefix-cache resets."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from vllm.v1.request import RequestStatus

from kv_offload.testing.scheduler_harness import SchedulerHarness


@dataclass
class WorkloadStats:
    requests: int = 0
    aborts: int = 0
    aborts_while_loading: int = 0
    resets: int = 0
    steps: int = 0
    preemptions: int = 0
    counters: dict = field(default_factory=dict)


def run_workload(harness: SchedulerHarness, seed: int, *, num_requests: int = 40,
                 p_abort: float = 0.03, p_reset: float = 0.03, max_tokens: int = 5
                 ) -> WorkloadStats:
    """Feed ``num_requests`` requests over time, then run until idle (or give up after
    a bounded number of steps: the caller then finds the stuck requests)."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 1000) for _ in range(rng.randrange(16, 72))] for _ in range(4)]
    stats = WorkloadStats()
    live: list[str] = []
    while stats.requests < num_requests or (harness.busy() and stats.steps < 3000):
        if stats.requests < num_requests and rng.random() < 0.5:
            doc = rng.choice(docs)
            prompt = doc[:rng.randrange(len(doc) // 2, len(doc) + 1)] + [
                rng.randrange(3, 1000) for _ in range(rng.randrange(1, 24))]
            req_id = f"s{seed}-r{stats.requests}"
            harness.add(req_id, prompt, max_tokens=rng.randrange(1, max_tokens + 1))
            live.append(req_id)
            stats.requests += 1
        live = [r for r in live if not harness.requests[r].is_finished()]
        if live and rng.random() < p_abort:
            _abort_one(harness, rng, live, stats)
        if rng.random() < p_reset:
            stats.resets += harness.reset_prefix_cache(reset_connector=rng.random() < 0.5)
        harness.step()
        stats.steps += 1
    stats.preemptions = sum(r.num_preemptions for r in harness.requests.values())
    stats.counters = harness.scheduler_side.counters.snapshot()
    return stats


def _abort_one(harness: SchedulerHarness, rng: random.Random, live: list[str],
               stats: WorkloadStats) -> None:
    loading = [r for r in live
               if harness.requests[r].status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    victim = rng.choice(loading) if loading and rng.random() < 0.7 else rng.choice(live)
    stats.aborts_while_loading += victim in loading
    harness.abort(victim)
    live.remove(victim)
    stats.aborts += 1
