"""Hits to the last cached token (issue 33) on vLLM's real Scheduler: a request that ends
with a whole chunk is served it up to its last token but one, and a request's tail (its
tokens past its last whole chunk) serves a later prompt that shares part of it.

The harness's fake model checks, before every forward, that each position before the
scheduled ones holds the KV of its prefix (a load that wrote wrong KV, or reported a
token it did not write, fails there), and ``check_idle`` that every CPU slot, tails
included, holds the KV of its key. Block size 8, chunk 16.
"""

from __future__ import annotations

import pytest

from kv_offload.testing.scheduler_harness import SchedulerHarness

pytestmark = pytest.mark.vllm_kernels


def _doc(n: int, base: int) -> list[int]:
    return [3 + (base + 7 * i) % 997 for i in range(n)]


@pytest.fixture
def harness(tmp_path):
    made: list[SchedulerHarness] = []

    def make(**kwargs) -> SchedulerHarness:
        made.append(SchedulerHarness(tmp_path / str(len(made)), **kwargs))
        return made[-1]

    yield make
    for h in made:
        h.close()


def _serve(h: SchedulerHarness, req_id: str, prompt: list[int], *, max_tokens: int = 3,
           reset: bool = True) -> list[int]:
    """Run one request to its end (vLLM's own prefix cache emptied first) and return its
    tokens."""
    if reset:
        assert h.reset_prefix_cache(reset_connector=False)
    h.add(req_id, prompt, max_tokens=max_tokens)
    h.run()
    assert h.requests[req_id].is_finished()
    return list(h.requests[req_id].output_token_ids)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_a_prompt_ending_with_a_whole_chunk_is_served_to_its_last_token_but_one(harness,
                                                                                 tier):
    h = harness(disk=tier == "disk")
    prompt = _doc(48, 0)  # 3 chunks
    cold = _serve(h, "a", prompt, reset=False)
    if tier == "disk":  # the CPU tier emptied: the chunks come from the disk tier
        assert h.reset_prefix_cache(reset_connector=True)
    before = h.scheduler_side.counters.snapshot()
    again = _serve(h, "b", prompt, reset=tier == "cpu")
    counters = h.scheduler_side.counters
    assert again == cold
    assert getattr(counters, f"hit_tokens_{tier}") - before[f"hit_tokens_{tier}"] == 47
    assert h.check_idle() == []


def test_a_tail_serves_the_tokens_a_later_prompt_shares_with_it(harness):
    h = harness(disk=False)
    reference = harness(disk=False, partial_hits=False)
    first = _doc(40, 0)  # chunks 0 and 1, then a tail of 8 tokens
    second = _doc(37, 0) + _doc(10, 500)  # shares 37 tokens: 2 chunks and 5 of the tail
    for run in (h, reference):
        _serve(run, "a", first, reset=False)
    out = _serve(h, "b", second)
    assert out == _serve(reference, "b", second)
    counters = h.scheduler_side.counters
    assert counters.tails_stored >= 1
    assert counters.hit_tokens_tail == 5
    assert counters.hit_tokens_cpu == 32 + 5
    assert reference.scheduler_side.counters.hit_tokens_cpu == 32  # whole chunks only
    assert h.check_idle() == [] and reference.check_idle() == []


def test_the_next_turn_of_a_conversation_supersedes_its_tail(harness):
    """A tail that a longer one of the same sequence extends gives its slot back, and the
    newest serves the turn after."""
    h = harness(disk=False)
    turn1 = _doc(40, 0)
    turn2 = turn1 + _doc(4, 300)  # same chunks, a longer tail under the same parent
    _serve(h, "t1", turn1, reset=False, max_tokens=1)
    _serve(h, "t2", turn2, max_tokens=1)
    tails = h.scheduler_side.tails
    assert tails is not None and len(tails) == 1
    (_, key, tokens), = tails.entries()
    assert len(tokens) == 12 and h.scheduler_side.cpu.hit(key) is not None
    before = h.scheduler_side.counters.hit_tokens_tail
    _serve(h, "t3", turn2 + _doc(20, 700))
    assert h.scheduler_side.counters.hit_tokens_tail - before == 12
    assert h.check_idle() == []


def test_a_tail_is_stored_once_its_prompt_is_computed_and_kept_across_preemption(harness):
    """The prompt's tail is copied after the forward that computes the prompt's last
    token, while the request decodes on (its next tokens land in the tail's last block:
    never reported by a load), not when it finishes: nothing more is held then."""
    h = harness(disk=False)
    h.add("a", _doc(40, 0), max_tokens=12)
    for _ in range(4):
        h.step()
    assert not h.requests["a"].is_finished()
    assert h.scheduler_side.counters.tails_stored == 1
    h.run()
    assert h.scheduler_side.holds.num_held() == 0
    out = _serve(h, "b", _doc(40, 0) + _doc(9, 800))
    assert h.scheduler_side.counters.hit_tokens_tail == 8
    assert len(out) == 3 and h.check_idle() == []


def test_a_tail_is_served_from_the_disk_tier_once_the_cpu_tier_lost_it(harness):
    """Tails are written to the disk tier with their parent and tokens (records of the
    disk index): once the CPU tier dropped everything, the disk tier serves the tail,
    staged into host RAM like any disk chunk; ``check_idle`` reads every disk slot back,
    tails included."""
    h = harness(disk=True)
    _serve(h, "a", _doc(40, 0), reset=False)
    assert h.reset_prefix_cache(reset_connector=True)  # the CPU tier is emptied
    assert h.scheduler_side.cpu.counts()["ready"] == 0
    out = _serve(h, "b", _doc(37, 0) + _doc(10, 500), reset=False)
    counters = h.scheduler_side.counters
    assert counters.hit_tokens_disk == 32 + 5 and counters.hit_tokens_tail == 5
    reference = harness(disk=False, partial_hits=False)
    assert out == _serve(reference, "b", _doc(37, 0) + _doc(10, 500), reset=False)
    assert h.check_idle() == []


@pytest.mark.parametrize("scheduling", ["same_step", "async_scheduling", "budget_off"])
def test_a_tail_under_a_block_past_vllms_own_hit_loads_only_same_step(harness, scheduling):
    """The chat benchmark's turn 1: vLLM's prefix cache holds the shared prefix to its last
    whole block (32 of 37 tokens) and a tail in the CPU tier 5 tokens more. Same-step, the
    5 tokens are served in the step that schedules the request; where the load would go
    asynchronously (async scheduling, same-step loads off) the request would wait a step
    outside the batch for them: not reported, vLLM computes them. Outputs equal either way."""
    options = {"same_step": {}, "async_scheduling": {"async_scheduling": True},
               "budget_off": {"sync_load_budget_ms": 0}}[scheduling]
    h = harness(disk=False, **options)
    reference = harness(disk=False, partial_hits=False)
    first = _doc(37, 0)  # chunks 0 and 1, then a tail of 5 tokens (a block and 5)
    second = _doc(37, 0) + _doc(10, 500)
    for run in (h, reference):
        _serve(run, "a", first, reset=False)
        assert run.scheduler_side.counters.tails_stored == (run is h)
    out = _serve(h, "b", second, reset=False)  # vLLM's cache keeps a's 4 whole blocks
    assert out == _serve(reference, "b", second, reset=False)
    served = 5 if scheduling == "same_step" else 0
    counters = h.scheduler_side.counters
    assert counters.hit_tokens_tail == counters.hit_tokens_cpu == served
    assert h.check_idle() == [] and reference.check_idle() == []
