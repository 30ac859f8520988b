"""vLLM's newer scheduler-side hooks and rules on its real Scheduler (issue 32 §3), in both
lanes: ``may_load_async`` with ``--max-num-inflight-kv-loads`` (vLLM 0.34: a load starts
while the batch is full), and requests whose external hits vLLM discards
(``prompt_logprobs``: 0.32 and 0.34)."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from kv_offload.testing import vllm_compat
from kv_offload.testing.fake_model import next_token, prefix_hashes
from kv_offload.testing.scheduler_harness import SchedulerHarness

PROMPT = list(range(3, 36))  # two chunks of 16 tokens and one more
ASYNC_LOADS = {"max_num_inflight_kv_loads": 2}  # turns same-step loads off (issue 29)


def expected_output(prompt: list[int], num_tokens: int) -> list[int]:
    """The tokens the fake model generates after ``prompt`` on the right KV."""
    tokens, hashes = list(prompt), []
    for _ in range(num_tokens):
        hashes = prefix_hashes(tokens, hashes)
        tokens.append(next_token(hashes[-1]))
    return tokens[len(prompt):]


@pytest.fixture
def make_harness(tmp_path):
    made: list[SchedulerHarness] = []

    def make(**kwargs) -> SchedulerHarness:
        made.append(SchedulerHarness(tmp_path / f"h{len(made)}", disk=False, **kwargs))
        return made[-1]

    yield make
    for harness in made:
        harness.close()


def stored_then_forgotten_by_vllm(harness: SchedulerHarness) -> None:
    """PROMPT's two chunks in the CPU tier, and not in vLLM's own prefix cache."""
    harness.add("writer", PROMPT, max_tokens=1)
    harness.run()
    assert harness.reset_prefix_cache(reset_connector=False)


def steps_to_first_token(harness: SchedulerHarness) -> int:
    """A request for PROMPT arrives while two others fill the batch (max_num_seqs 2) for
    20 more steps: engine steps from its arrival to its first token."""
    stored_then_forgotten_by_vllm(harness)
    for i in (1, 2):
        harness.add(f"busy{i}", [900 + i] * 5, max_tokens=20)
    harness.step()
    assert len(harness.scheduler.running) == 2
    reader = harness.add("reader", PROMPT + [7], max_tokens=3)
    steps = 0
    while not reader.num_output_tokens:
        harness.step()
        steps += 1
    harness.run()
    assert list(reader.output_token_ids) == expected_output(PROMPT + [7], 3)
    # two chunks, then the writer's one-token tail: to the reader's last token but one
    assert harness.scheduler_side.counters.hit_tokens_cpu == 32 + 1
    assert harness.check_idle() == []
    return steps


@pytest.mark.skipif(not vllm_compat.loads_while_batch_full(),
                    reason="vLLM before 0.34 has no may_load_async / --max-num-inflight-kv-loads")
def test_a_held_first_chunk_starts_its_load_while_the_batch_is_full(make_harness):
    """vLLM 0.34 asks ``may_load_async`` as a request arrives: kv-offload says yes when
    the CPU tier holds its first chunk (same-step loads are off with the option), so the
    request waits in ``async_kv_waiting`` and its load starts while the batch is full; it
    then joins the batch with its KV loaded (the fake forward checks every loaded token)
    and generates what recompute would. With the base class's answer (no) it waits for a
    slot, then for its load: more steps to its first token."""
    harness = make_harness(max_num_seqs=2, **ASYNC_LOADS)
    stored_then_forgotten_by_vllm(harness)
    for i in (1, 2):
        harness.add(f"busy{i}", [900 + i] * 5, max_tokens=20)
    harness.step()
    reader = harness.add("reader", PROMPT + [7], max_tokens=3)
    assert reader in harness.scheduler.async_kv_waiting
    harness.step()
    assert reader.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # loading, batch full
    assert {r.request_id for r in harness.scheduler.running} == {"busy1", "busy2"}
    harness.run()
    assert list(reader.output_token_ids) == expected_output(PROMPT + [7], 3)
    assert harness.check_idle() == []

    with_hook = steps_to_first_token(make_harness(max_num_seqs=2, **ASYNC_LOADS))
    without = make_harness(max_num_seqs=2, **ASYNC_LOADS)
    without.scheduler.connector.may_load_async = lambda request: False  # the base's answer
    assert with_hook < steps_to_first_token(without)


def test_a_prompt_logprobs_request_is_not_looked_up_and_is_stored(make_harness):
    """vLLM sets the external hits of a request asking for prompt_logprobs to 0 (0.32:
    ``skip_reading_prefix_cache``, 0.34: ``skip_reading_external_kv``): kv-offload does
    not look it up, counts its tokens apart (not as misses), loads nothing, and stores
    its KV, which a plain request then loads."""
    harness = make_harness()
    stored_then_forgotten_by_vllm(harness)
    counters = harness.scheduler_side.counters
    misses = counters.miss_tokens
    scorer = harness.add("scorer", PROMPT + [8] * 16 + [9], max_tokens=2, prompt_logprobs=1)
    harness.run()
    assert list(scorer.output_token_ids) == expected_output(PROMPT + [8] * 16 + [9], 2)
    assert counters.hit_tokens_cpu == 0 and counters.miss_tokens == misses
    assert counters.lookup_skipped_tokens == len(PROMPT) + 16
    assert counters.chunks_stored_cpu - counters.tails_stored == 3  # the writer's two, its third
    assert harness.reset_prefix_cache(reset_connector=False)
    harness.add("reader", PROMPT + [8] * 16 + [5], max_tokens=2)
    harness.run()
    # three chunks, and one token of the scorer's tail ([8, 9] after them; the reader's: [8, 5])
    assert counters.hit_tokens_cpu == 48 + 1
    assert harness.check_idle() == []
