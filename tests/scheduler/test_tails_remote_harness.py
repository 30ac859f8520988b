"""Request tails through the remote tier on vLLM's real Scheduler: engines that share a
real Redis (``redis_server``) serve each other's whole chunks and tails, while values
vanish from the server (evicted) at random, with and without async scheduling,
preemption (few blocks) and a disk tier that the remote tails fill.

Every request's tokens must equal those of an engine without partial hits (the fake
model fails a forward whose KV is not that of its prefix), and ``check_idle`` must find
every CPU and disk slot holding the KV of its key, tails filled from Redis included.
"""

from __future__ import annotations

import random

import pytest
import redis

pytestmark = pytest.mark.vllm_kernels


def _doc(n: int, base: int) -> list[int]:
    return [3 + (base + 7 * i) % 997 for i in range(n)]


def _serve(h, req_id: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    h.add(req_id, prompt, max_tokens=max_tokens)
    h.run(max_steps=50_000)
    assert h.requests[req_id].is_finished()
    return list(h.requests[req_id].output_token_ids)


def _check_idle(engines) -> None:
    """``check_idle`` of each engine, which knows the other engines' requests (a tail
    filled from Redis holds tokens of a request another engine served)."""
    for h in engines:
        for other in engines:
            if other is not h:
                h.requests.update({f"{id(other)}/{k}": r for k, r in other.requests.items()})
        assert h.check_idle() == []


def test_a_tail_another_engine_stored_in_redis_is_served_and_filled_into_the_disk(
        harness_factory, redis_server):
    redis_server.cli("flushall")
    writer = harness_factory(disk=False, remote_url=redis_server.url)
    reader = harness_factory(disk=True, remote_url=redis_server.url)
    reference = harness_factory(disk=False, partial_hits=False)
    first = _doc(40, 0)  # chunks 0 and 1, then a tail of 8 tokens
    second = _doc(37, 0) + _doc(10, 500)  # shares 2 chunks and 5 tokens of the tail
    _serve(writer, "a", first)
    assert writer.scheduler_side.tier("remote").wait_tails_written()
    assert _serve(reader, "b", second) == _serve(reference, "b", second)
    counters = reader.scheduler_side.counters
    assert counters.hit_tokens_remote == 32 + 5 and counters.hit_tokens_tail == 5
    _check_idle([writer, reader])


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_runs_with_remote_tails_and_evictions(harness_factory, redis_server, seed):
    redis_server.cli("flushall")
    client = redis.Redis.from_url(redis_server.url)
    rng = random.Random(seed)
    options = dict(remote_url=redis_server.url, cpu_slots=5, num_blocks=24, max_num_seqs=4,
                   async_scheduling=seed % 2 == 0)
    engines = [harness_factory(disk=i == 1, **options) for i in range(2)]
    reference = harness_factory(disk=False, partial_hits=False)
    bases = [_doc(48, 1000 * i) for i in range(3)]
    expected: dict[str, list[int]] = {}
    for batch in range(8):
        h = engines[batch % 2]
        ids = []
        for _ in range(rng.randrange(2, 6)):
            prompt = (rng.choice(bases)[:rng.randrange(1, 47)]
                      + _doc(rng.randrange(0, 20), rng.randrange(5000)))
            req_id = f"r{len(expected)}"
            expected[req_id] = _serve(reference, req_id, prompt)
            h.add(req_id, prompt, max_tokens=rng.randrange(1, 7))
            ids.append(req_id)
        for _ in range(50_000):
            if not h.busy():
                break
            h.step()
            if rng.random() < 0.05:  # the server evicts a value, maybe one of a tail
                names = list(client.scan_iter(match=b"*:r*of*", count=1000))
                if names:
                    client.delete(rng.choice(names))
        for req_id in ids:
            got = list(h.requests[req_id].output_token_ids)
            assert h.requests[req_id].is_finished() and got == expected[req_id][:len(got)]
        assert h.scheduler_side.tier("remote").wait_tails_written()
        if rng.random() < 0.5:
            assert h.reset_prefix_cache(reset_connector=rng.random() < 0.5)
    assert sum(h.scheduler_side.counters.hit_tokens_remote for h in engines) > 0
    _check_idle(engines)
