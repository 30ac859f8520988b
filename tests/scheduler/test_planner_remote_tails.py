"""What a lookup costs in scheduler steps with request tails on the remote tier (a real
Redis), counted as vLLM sees it: the None answers of ``num_matched_tokens``.

Regression scenario: the tails question was asked only once the chunk question had
answered, each taking one "ask again next step" round, so every request whose run
stopped before its last token (every fresh prompt among them: a complete miss asks for
the tails of its seed) waited two steps where it had waited one before remote tails: a
TTFT regression on the most common lookup. The tails of the parents where a complete
miss and a full hit end are now asked alongside the chunks (``expect_tails``); only a
run that ends in between asks its parent's tails afterwards.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from planner_support import make_request, make_scheduler

from kv_offload.remote import RemoteTarget, RemoteTier
from kv_offload.remote.tail_records import RemoteTails
from kv_offload.scheduler.tails import tail_key, tail_seed
from kv_offload.testing.tiers import key_in

NS, SLOT, PREFIX = "5e" * 16, 512, "kvo-planner-tails"


@pytest.fixture
def remote(redis_server):
    redis_server.cli("flushall")
    tier = RemoteTier(RemoteTarget(redis_server.url), namespace=NS, num_ranks=1,
                      payload_bytes=SLOT, timeout_s=2.0, key_prefix=PREFIX,
                      lookup_budget_s=10.0)
    sched, _ = make_scheduler(remote=tier, partial_hits=True)
    yield tier, sched
    sched.close()


def put_chunks(tier: RemoteTier, keys) -> None:
    """Values of ``keys`` on the server, as another engine's stores leave them."""
    for key in keys:
        assert tier.write(bytes(key), 0, memoryview(np.zeros(SLOT, np.uint8).tobytes()))


def put_tail(tier: RemoteTier, parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """A request tail of ``parent`` on the server, its value and its record."""
    key = tail_key(parent, tokens)
    put_chunks(tier, [key])
    assert RemoteTails(tier).write([(parent, key, tokens)], stamp=time.time_ns())
    return key


def steps(sched, request) -> tuple[int, int]:
    """(the answer, how many steps vLLM was told to ask again first). Each step lasts
    until the server answered every question asked so far (a step outlasts a round
    trip): steps are counted, not the round trips' timing."""
    index = sched.tier("remote")
    deadline = time.monotonic() + 30  # bounds a hang only
    pending = 0
    while (answer := sched.num_matched_tokens(request, 0)) is None:
        pending += 1
        while index.num_pending():
            assert time.monotonic() < deadline, "the remote lookup never answered"
            time.sleep(0.001)
    return answer, pending


def test_a_fresh_prompt_waits_one_step_for_the_chunks_and_its_seeds_tails(remote):
    tier, sched = remote
    fresh = make_request("fresh", list(range(20)))  # nothing stored: a complete miss
    assert steps(sched, fresh) == (0, 1)
    short = make_request("short", list(range(100, 106)))  # an earlier prompt's tail
    key = put_tail(tier, tail_seed(short), tuple(range(100, 106)))
    again = make_request("again", list(range(100, 120)))  # no chunk stored, the seed's tail
    assert steps(sched, again) == (6, 1), "the seed's tail, asked alongside the chunks"
    sched.plan_load(again, [10, 11, 12, 13, 14], 6)
    (load,) = sched.plan_step([]).loads
    assert [key_in(m) for m in load.chunks] == [key]


def test_a_whole_chunk_hit_with_a_stored_tail_waits_one_step(remote):
    tier, sched = remote
    req = make_request("r", list(range(20)))  # 2 whole chunks and 4 tokens
    put_chunks(tier, [req.block_hashes[1], req.block_hashes[3]])
    key = put_tail(tier, req.block_hashes[3], (16, 17, 18, 19))
    assert steps(sched, req) == (19, 1)
    sched.plan_load(req, [10, 11, 12, 13, 14], 19)
    assert sched.hit_tokens_by_tier("r") == {"remote": 19}
    (load,) = sched.plan_step([]).loads
    assert [key_in(m) for m in load.chunks] == [req.block_hashes[1], req.block_hashes[3], key]


def test_a_run_ending_between_asks_its_parents_tails_after_the_chunks(remote):
    """Chunk 0 of 3 on the server: the run ends at its parent, which neither a complete
    miss nor a full hit names; its tails are asked afterwards (a step more) and the one
    sharing the most tokens with the request is served."""
    tier, sched = remote
    req = make_request("r", list(range(28)))  # 3 whole chunks and 4 tokens
    put_chunks(tier, [req.block_hashes[1]])
    put_tail(tier, req.block_hashes[1], (8, 9, 99))
    best = put_tail(tier, req.block_hashes[1], (8, 9, 10, 11, 12))
    put_tail(tier, req.block_hashes[5], tuple(range(24, 28)))  # past the gap: unused
    answer, pending = steps(sched, req)
    assert (answer, pending) == (13, 2), "its tails asked a step after the chunks"
    sched.plan_load(req, list(range(10, 17)), 13)
    (load,) = sched.plan_step([]).loads
    assert [key_in(m) for m in load.chunks] == [req.block_hashes[1], best]
