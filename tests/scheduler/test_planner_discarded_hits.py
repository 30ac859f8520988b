"""Requests whose external hits vLLM discards (issue 32 §3): those asking for
``prompt_logprobs``. vLLM still asks the connector (0.32: ``skip_reading_prefix_cache``,
0.34: ``skip_reading_external_kv``) and then sets the answer to 0, so a lookup would only
cost tier reads and count a miss that was never one. They are not looked up, nothing is
pinned or planned, their tokens are counted apart, and their KV is still stored."""

import pytest
from planner_support import make_request, make_scheduler, skipping, store_request

from kv_offload.scheduler.lookup import hits_discarded


def test_which_requests_vllm_discards_the_hits_of():
    req = make_request("a", list(range(8)))
    assert not hits_discarded(req)  # no such attribute: a plain request
    assert hits_discarded(skipping(req, "skip_reading_external_kv"))
    assert hits_discarded(skipping(req, "skip_reading_prefix_cache"))
    assert not hits_discarded(skipping(req, "skip_reading_prefix_cache", False))
    # vLLM 0.34 answers for itself even where the sampling parameters allow local reads
    # (prompt_logprob_start with skip_reading_prefix_cache=False).
    both = skipping(skipping(req, "skip_reading_prefix_cache", False),
                    "skip_reading_external_kv")
    assert hits_discarded(both)


@pytest.mark.parametrize("attribute", ["skip_reading_external_kv", "skip_reading_prefix_cache"])
def test_a_request_whose_hits_vllm_discards_is_not_looked_up_but_is_stored(attribute):
    sched, blocks = make_scheduler()
    writer = make_request("w", list(range(17)))
    sched.num_matched_tokens(writer, 0)
    store_request(sched, blocks, writer, [0, 1, 2, 3, 4])  # chunks 0 and 1 in the CPU tier
    asked = []
    real_hits = sched.cpu.hits
    sched.cpu.hits = lambda keys: asked.append(keys) or real_hits(keys)

    reader = skipping(make_request("r", list(range(25))), attribute)  # chunk 2 is new
    assert sched.num_matched_tokens(reader, 0) == 0
    assert asked == []  # no tier was asked
    before = sched.cpu.counts()
    sched.plan_load(reader, [5, 6, 7, 8, 9, 10, 11], 0)  # vLLM passes 0 external tokens
    assert sched.cpu.counts() == before and not sched.cpu.counts().get("pinned")
    assert sched.counters.lookup_skipped_tokens == 24  # all but the token vLLM computes
    assert sched.counters.miss_tokens == 0
    assert not sched.plan_step([]).loads

    blocks["r"] = [5, 6, 7, 8, 9, 10, 11]
    (job,) = sched.plan_step([("r", 25)]).stores  # its KV is computed: stored as usual
    assert [m.block_ids for m in job.chunks] == [(9, 10)]  # chunks 0-1 were there already


def test_a_plain_request_is_still_counted_a_miss():
    sched, _ = make_scheduler()
    req = make_request("a", list(range(17)))
    assert sched.num_matched_tokens(req, 0) == 0
    sched.plan_load(req, [0, 1, 2, 3, 4], 0)
    assert sched.counters.miss_tokens == 16 and sched.counters.lookup_skipped_tokens == 0
