"""Request tails (issue 33) served only where their KV is right: when the disk tier changes
between a lookup and its load, when a disk tail record lies, across LoRA adapters. A load
never reports tokens its sources do not hold.

A disk store may be shared by several engines (another process evicts or drops entries at
any time), so a load is planned again from the tiers in ``plan_load``: chunks gone since
the lookup become failed moves (vLLM recomputes them). With partial hits the run planned
again may end in another source than the lookup's: a request tail that shares fewer of
the request's tokens, or the tail of an earlier chunk standing where a whole chunk was.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kv_offload.disk import DiskIndex
from kv_offload.jobs import WorkerReport
from kv_offload.scheduler import OffloadScheduler, PlannerConfig
from kv_offload.scheduler.tails import tail_key, tail_seed
from kv_offload.testing.requests import FakeRequest
from kv_offload.testing.tiers import secondary_tiers

BLOCK, CHUNK = 4, 8


def request(req_id: str, tokens: list[int]) -> FakeRequest:
    return FakeRequest(req_id, tokens, block_size=BLOCK)


@pytest.fixture
def disk(tmp_path):
    opened: list[DiskIndex] = []

    def open_index() -> DiskIndex:
        opened.append(DiskIndex.open(tmp_path / "store", namespace_id="ab" * 16,
                                     descriptor={"test": True}, slot_bytes=64, num_ranks=1,
                                     capacity_bytes=64 * 32))
        return opened[-1]

    yield open_index
    for index in opened:
        index.close()


def scheduler(disk_index: DiskIndex, blocks: dict) -> OffloadScheduler:
    config = PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                           num_ranks=1, num_cpu_slots=16, partial_hits=True)
    return OffloadScheduler(config, tiers=secondary_tiers(disk_index),
                            block_ids_of=lambda rid: blocks[rid])


def store(sched: OffloadScheduler, blocks: dict, req: FakeRequest, *,
          on_disk: bool = True) -> None:
    """``req`` computed whole: its chunks and tail copied, and written to disk."""
    blocks[req.request_id] = table = list(range(100, 100 + -(-req.num_tokens // BLOCK)))
    sched.num_matched_tokens(req, 0)
    sched.plan_load(req, [table], 0)
    plan = sched.plan_step([(req.request_id, req.num_tokens)])
    for job in plan.stores:
        sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
        if on_disk:
            sched.on_report(WorkerReport(written={job.job_id: {"disk": {0: (7,) * len(job.chunks)}}}))
    sched.plan_step([])  # the step's one transaction commits
    sched.request_finished(req.request_id)


PREFIX = list(range(10, 10 + CHUNK))  # chunk 0


def test_a_disk_tail_gone_since_the_lookup_is_not_replaced_by_a_shorter_one(disk):
    """The lookup finds, on disk, the tail that shares 7 tokens; another engine evicts it
    before the load is planned. The CPU tier still holds a tail of the same parent that
    shares 2: the load must not report 7 tokens from it (5 of them are another
    prompt's KV)."""
    blocks: dict = {}
    first = scheduler(disk(), blocks)
    store(first, blocks, request("a", PREFIX + [100, 101, 102, 103, 104, 105, 106]))
    first.close()
    sched = scheduler(disk(), blocks)  # a restart: the CPU tier is empty
    store(sched, blocks, request("b", PREFIX + [100, 101, 200, 201, 202]), on_disk=False)
    reader = request("c", PREFIX + [100, 101, 102, 103, 104, 105, 106, 107])
    assert sched.num_matched_tokens(reader, 0) == CHUNK + 7  # a's tail, from disk
    parent = reader.block_hashes[1]
    a_tail = tail_key(parent, [100, 101, 102, 103, 104, 105, 106])
    b_tail = tail_key(parent, [100, 101, 200, 201, 202])
    (entry,) = sched.tier("disk").index.find_prefix([a_tail])
    assert sched.tier("disk").index.drop(a_tail, entry.slot)  # another engine sharing the store
    table = list(range(200, 204))
    sched.plan_load(reader, [table], CHUNK + 7)
    (job,) = sched.take_pending_loads()
    b_hit = sched.cpu.hit(b_tail)
    assert b_hit is not None
    assert job.chunks[1].cpu_slot != b_hit.slot  # a failed move: vLLM recomputes


def test_a_whole_chunk_gone_since_the_lookup_is_not_replaced_by_an_earlier_tail(disk):
    """The lookup finds chunks 0 and 1 on disk and the request's tail after them; chunk 1
    vanishes before the load is planned. The run planned again ends with a tail of chunk
    0's parent: it must not be loaded into chunk 1's blocks as the whole chunk 1."""
    blocks: dict = {}
    first = scheduler(disk(), blocks)
    tokens = PREFIX + list(range(50, 50 + CHUNK)) + [300, 301, 302]
    store(first, blocks, request("a", tokens))
    store(first, blocks, request("b", PREFIX + [50, 51, 52]))  # a tail of chunk 0
    first.close()
    sched = scheduler(disk(), blocks)
    reader = request("c", tokens + [303])
    assert sched.num_matched_tokens(reader, 0) == 2 * CHUNK + 3
    chunk1 = reader.block_hashes[3]
    (entry,) = sched.tier("disk").index.find_prefix([chunk1])
    assert sched.tier("disk").index.drop(chunk1, entry.slot)
    sched.plan_load(reader, [list(range(200, 205))], 2 * CHUNK + 3)
    (job,) = sched.take_pending_loads()
    assert [m.cpu_slot is None for m in job.chunks] == [False, True, True]


def test_a_disk_tail_record_whose_tokens_do_not_make_its_key_is_not_served(disk):
    """Invariant 9: a tail record is checked before it is trusted. A record whose token
    ids are not those its key was made of (damage) would report tokens whose KV the slot
    does not hold; it costs a miss instead."""
    blocks: dict = {}
    first = scheduler(disk(), blocks)
    store(first, blocks, request("a", PREFIX + [100, 101, 102]))
    first.close()
    index = disk()
    parent = request("x", PREFIX).block_hashes[-1]
    (key, tokens), = index.tails_of(parent)
    assert tokens == (100, 101, 102)
    (entry,) = index.find_prefix([key])
    slot = index.allocate([b"k" * 32])[0]  # a well-formed record with other tokens
    index.settle([(b"k" * 32, slot, (7,))], tails={b"k" * 32: (parent, (100, 101, 555))})
    sched = scheduler(index, blocks)
    reader = request("c", PREFIX + [100, 101, 555, 556])
    assert sched.num_matched_tokens(reader, 0) == CHUNK + 2  # the shared 2 from key's tail


def test_a_seed_separates_adapters_of_one_name_at_other_paths():
    """vLLM hashes a LoRA request's adapter name and path into its blocks ("re-pointing a
    LoRA name at a different adapter does not reuse KV computed with the previous one"):
    a tail that starts at token 0, whose parent is the seed, must not be served across
    adapters of one name either."""
    def with_adapter(path: str) -> SimpleNamespace:
        lora = SimpleNamespace(lora_name="a", lora_int_id=1, lora_path=path)
        return SimpleNamespace(all_token_ids=[1, 2], lora_request=lora, cache_salt=None)

    assert tail_seed(with_adapter("/adapters/v1")) != tail_seed(with_adapter("/adapters/v2"))
    plain = SimpleNamespace(all_token_ids=[1, 2], lora_request=None, cache_salt=None)
    assert tail_seed(plain) not in (tail_seed(with_adapter("/adapters/v1")), None)


@pytest.mark.parametrize("hit", [CHUNK + 3, 3])
def test_a_partial_load_that_fails_to_plan_reports_every_block_it_would_write(tmp_path, hit):
    """When ``plan_load`` raises, the hook guard fails the load (``fail_load``): every
    block of the hit must be reported failed, the one it ends inside too, else vLLM
    counts tokens as loaded that nothing wrote (or waits for ever for a load of fewer
    tokens than a block)."""
    blocks: dict = {}
    sched = OffloadScheduler(PlannerConfig(chunk_tokens=CHUNK, block_size=BLOCK,
                                           tokens_per_hash=BLOCK, num_ranks=1,
                                           num_cpu_slots=16, partial_hits=True),
                             block_ids_of=lambda rid: blocks[rid])
    store(sched, blocks, request("a", PREFIX + [100, 101, 102]), on_disk=False)
    reader = request("c", PREFIX + [100, 101, 102, 103])
    local = CHUNK + 3 - hit  # vLLM's own prefix cache holds chunk 0 in the short case
    assert sched.num_matched_tokens(reader, local) == hit
    table = [200, 201, 202]  # tokens 0-3, 4-7, 8-11
    sched.fail_load("c", [table], hit)
    (load,) = sched.plan_step([]).loads
    failed = {b for m in load.chunks for b in m.block_ids if m.cpu_slot is None}
    assert failed == set(table[local // BLOCK:])
