"""The tiers' KV events (scheduler/events.py, kv_events.py): what routers learn of the CPU,
disk and remote tiers, in vLLM's block hash space, bounded, and announced after a restart."""

import logging
from types import SimpleNamespace

import pytest

from kv_offload.counters import SchedulerCounters
from kv_offload.disk import DiskIndex
from kv_offload.jobs import WorkerReport
from kv_offload.plugin.kv_events import connect, to_vllm
from kv_offload.scheduler.events import (
    ANNOUNCE_BATCH,
    ChunkBlocks,
    Tier,
    TierEvents,
    chunk_blocks,
    decode,
    encode,
)
from tests.scheduler.planner_support import BLOCK, CHUNK, make_request, make_scheduler


def tier_events(**kw) -> TierEvents:
    return TierEvents(chunk_tokens=CHUNK, block_size=BLOCK, **kw)


def index(events):
    """(tier, block hashes) -> stored?, replayed from ``events`` as a router would."""
    held: set = set()
    for e in events:
        for h in e.block_hashes:
            (held.add if e.stored else held.discard)((e.tier, h))
    return held


def test_a_chunk_payload_is_its_vllm_blocks():
    req = make_request("r", list(range(3 * CHUNK)))
    blocks = chunk_blocks(req, 1, chunk_tokens=CHUNK, block_size=BLOCK)
    per = CHUNK // BLOCK
    assert blocks.block_hashes == tuple(req.block_hashes[per:2 * per])
    assert blocks.parent_hash == req.block_hashes[per - 1]
    assert blocks.token_ids == tuple(range(CHUNK, 2 * CHUNK)) and blocks.block_size == BLOCK
    first = chunk_blocks(req, 0, chunk_tokens=CHUNK, block_size=BLOCK)
    assert first.parent_hash is None
    assert chunk_blocks(req, 3, chunk_tokens=CHUNK, block_size=BLOCK) is None  # not hashed yet


def test_the_disk_record_round_trips_and_a_damaged_one_is_none():
    extra = (("lora", ("mm-hash", 0), b"\x01embeds-digest"), None)  # vLLM's shapes
    blocks = ChunkBlocks((b"a" * 32, b"b" * 32), b"p" * 32, tuple(range(8)), 4, 3, "lora",
                         extra)
    assert decode(encode(blocks)) == blocks
    assert encode(ChunkBlocks((b"a" * 32,), None, (1, 2, 3, 4), 4, None, None,
                              ({"x"},))) == b""  # a key of unknown type: no record
    root = ChunkBlocks((b"a" * 32,), None, (1, 2, 3, 4), 4)
    assert decode(encode(root)) == root
    raw = encode(blocks)
    assert decode(None) is None and decode(raw[:20]) is None and decode(raw[:-3]) is None
    assert decode(b"\x09" + raw[1:]) is None  # unknown version


def test_the_queue_is_bounded_and_drops_are_counted_and_logged(caplog):
    counters = SchedulerCounters()
    events = tier_events(max_queued=2, counters=counters)
    req = make_request("r", list(range(3 * CHUNK)))
    keys = [req.block_hashes[(c + 1) * (CHUNK // BLOCK) - 1] for c in range(3)]
    events.capture(req, range(3), keys)
    with caplog.at_level(logging.WARNING, logger="kv_offload"):
        events.stored(Tier.CPU, keys)
    assert len(events.take()) == 2 and events.num_dropped == counters.kv_events_dropped == 1
    assert "KV events dropped" in caplog.text
    assert events.take() == []


def test_a_payload_vllm_cannot_describe_is_skipped_and_logged_never_raised(caplog):
    """Capture runs inside store planning: a failure there must cost only the event."""
    def broken(request, start, end):
        raise RuntimeError("an odd multimodal request")

    events = tier_events(extra_keys_of=broken)
    req = make_request("r", list(range(CHUNK)))
    with caplog.at_level(logging.ERROR, logger="kv_offload"):
        events.capture(req, [0], [req.block_hashes[-1]])
    assert events.payload(req.block_hashes[-1]) is None and events.num_uncaptured == 1
    assert "not announced" in caplog.text


def test_cpu_tier_announces_published_chunks_and_withdraws_evicted_ones():
    """A chunk is announced when READY (not while STORING), withdrawn when evicted, with the
    block hashes of the request; a failed store is never announced."""
    sched, blocks = make_scheduler(num_cpu_slots=2)
    events = tier_events()
    connect(sched, events)
    a = make_request("a", list(range(2 * CHUNK)))
    plan = schedule(sched, blocks, a)
    assert events.take() == []  # STORING: not loadable yet
    sched.on_report(WorkerReport(host_stored={plan.stores[0].job_id: 1}))
    stored = events.take()
    assert {(Tier.CPU, h) for h in a.block_hashes} == index(stored)
    assert stored[0].blocks.token_ids == tuple(range(CHUNK))
    b = make_request("b", list(range(100, 100 + 2 * CHUNK)))
    plan = schedule(sched, blocks, b)  # evicts both chunks of a
    removed = events.take()
    assert [e.stored for e in removed] == [False, False]
    assert index(stored + removed) == set()
    sched.on_report(WorkerReport(host_stored={}, host_failed={plan.stores[0].job_id: 1}))
    assert events.take() == []  # a failed copy publishes nothing


def schedule(sched, blocks, req):
    """Look ``req`` up (a miss), then schedule all its tokens: the plan of that step."""
    blocks[req.request_id] = list(range(req.num_tokens // BLOCK))
    assert sched.num_matched_tokens(req, 0) == 0
    return sched.plan_step([(req.request_id, req.num_tokens)])


def test_the_remote_tier_is_announced_remote_and_withdrawn_on_reset():
    never_asked = SimpleNamespace(close=lambda: None)  # lookups bound at start, unused
    remote = SimpleNamespace(close=lambda: None, health=SimpleNamespace(num_failures=0),
                             async_lookups=lambda clock, **kwargs: never_asked,
                             tail_records=lambda: SimpleNamespace(tails_many=None))
    sched, blocks = make_scheduler(remote=remote)
    events = tier_events()
    connect(sched, events)
    a = make_request("a", list(range(CHUNK)))
    job = schedule(sched, blocks, a).stores[0]
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    sched.on_report(WorkerReport(written={job.job_id: {"remote": {0: (True,)}}}))
    got = events.take()
    assert [(e.tier, e.stored) for e in got] == [(Tier.CPU, True), (Tier.REMOTE, True)]
    assert (Tier.REMOTE.medium, Tier.REMOTE.locality) == ("CPU", "REMOTE")
    sched.reset_all()
    assert index(got + events.take()) == set()


@pytest.fixture
def disk(tmp_path):
    opened = []

    def open_index(capacity_slots=4):
        idx = DiskIndex.open(tmp_path / "store", namespace_id="ab12", descriptor={"m": 1},
                             slot_bytes=4096, num_ranks=1, capacity_bytes=4096 * capacity_slots)
        opened.append(idx)
        return idx
    yield open_index
    for idx in opened:
        idx.close()


def store_on_disk(sched, blocks, req):
    job = schedule(sched, blocks, req).stores[0]
    sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
    sched.on_report(WorkerReport(written={job.job_id: {"disk": {0: (7,) * len(job.chunks)}}}))
    sched.plan_step([])  # the step's one transaction commits


def test_disk_tier_announces_commits_withdraws_evictions_and_a_restart_reannounces(disk):
    """Evictions in the disk index are withdrawn with the hashes kept in the index; after a
    restart, what the index holds is announced again, in batches, without any request."""
    idx = disk(capacity_slots=2)
    sched, blocks = make_scheduler(disk_index=idx, num_cpu_slots=8)
    events = tier_events()
    connect(sched, events)
    a, b = make_request("a", list(range(2 * CHUNK))), make_request("b", list(range(50, 50 + CHUNK)))
    store_on_disk(sched, blocks, a)
    seen = events.take()
    assert index(seen) == {(t, h) for t in (Tier.CPU, Tier.DISK) for h in a.block_hashes}
    store_on_disk(sched, blocks, b)  # the disk holds 2 chunks: a's first chunk goes
    seen += events.take()
    on_disk = {h for t, h in index(seen) if t is Tier.DISK}
    assert on_disk == set(a.block_hashes[2:]) | set(b.block_hashes)
    sched.tier("disk").flush()

    restarted = make_scheduler(disk_index=disk(capacity_slots=2))[0]
    events = tier_events()
    connect(restarted, events)
    assert events.has_queued()  # keeps vLLM stepping until announced
    again = events.take()
    assert events.take() == [] and not events.has_queued()
    assert {h for t, h in index(again) if t is Tier.DISK} == on_disk
    restarted.reset_all()  # the tier is off: everything it announced is withdrawn
    assert index(again + events.take()) == set()


def test_a_restart_announces_in_batches_and_skips_chunks_stored_without_blocks(disk):
    idx = disk(capacity_slots=ANNOUNCE_BATCH + 8)
    sched, blocks = make_scheduler(disk_index=idx, num_cpu_slots=ANNOUNCE_BATCH + 8)
    store_on_disk(sched, blocks, make_request("old", list(range(CHUNK))))  # events off: no record
    events = tier_events()
    connect(sched, events)
    events.take()
    for i in range(ANNOUNCE_BATCH + 2):
        store_on_disk(sched, blocks, make_request(f"r{i}", [i + 100] * CHUNK))
    sched.tier("disk").flush()
    restarted = make_scheduler(disk_index=disk(capacity_slots=ANNOUNCE_BATCH + 8))[0]
    events = tier_events()
    connect(restarted, events)
    first, second = events.take(), events.take()
    assert len(first) == ANNOUNCE_BATCH - 1 and len(second) == 3  # the old chunk: skipped
    assert events.take() == [] and events.num_not_announced == 1


def test_vllm_events_carry_the_gpu_events_fields():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as external

    req = make_request("r", list(range(CHUNK, 3 * CHUNK)))
    events = tier_events()
    keys = [req.block_hashes[(c + 1) * (CHUNK // BLOCK) - 1] for c in range(2)]
    events.capture(req, [1], keys)
    events.stored(Tier.DISK, [keys[1]])
    events.disk_removed([(keys[1], events.payload(keys[1]))])
    stored, removed = to_vllm(events.take(), [(0, "full_attention")])
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    hashes = [external(h) for h in req.block_hashes]  # as vLLM's GPU events spell them
    assert stored.block_hashes == hashes[2:4] == removed.block_hashes
    assert stored.parent_block_hash == hashes[1]
    assert stored.token_ids == list(range(2 * CHUNK, 3 * CHUNK)) and stored.block_size == BLOCK
    assert (stored.medium, stored.locality, stored.ownership, stored.group_idx) == (
        "STORAGE", "LOCAL", "disk", 0)
    assert (removed.medium, removed.group_idx) == ("STORAGE", 0)


def test_events_cost_nothing_unless_vllm_publishes_kv_events():
    """Off: nothing is captured or queued (no TierEvents at all). On: the full-attention
    groups at the hash block size are the ones the events name."""
    from types import SimpleNamespace

    import torch
    from vllm.config import KVEventsConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kv_offload.plugin.kv_events import attach_events

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64,
                             dtype=torch.float32)
    kv_cache = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    sched, _ = make_scheduler()
    off = SimpleNamespace(kv_events_config=None)
    assert attach_events(off, kv_cache, sched) is None and sched.events is None
    assert sched.cpu.events is None
    on = SimpleNamespace(kv_events_config=KVEventsConfig(enable_kv_cache_events=True))
    attached = attach_events(on, kv_cache, sched)
    assert attached is not None and attached.groups == [(0, "full_attention")]
    assert sched.events is sched.cpu.events is attached.events


@pytest.mark.parametrize("seed", range(3))
def test_replayed_events_equal_what_the_tiers_hold_through_a_random_workload(disk, seed):
    """Stores, hits staged from disk, evictions from both tiers, CPU resets and at last a
    full reset: after every step, a router's replay of the events holds exactly the CPU
    tier's READY chunks and the disk index's committed ones, block by block."""
    import random

    rng = random.Random(seed)
    idx = disk(capacity_slots=4)
    sched, blocks = make_scheduler(disk_index=idx, num_cpu_slots=3)
    events = tier_events()
    connect(sched, events)
    prefixes = [[rng.randrange(256) for _ in range(CHUNK)] for _ in range(3)]
    chunks: dict[bytes, tuple[bytes, ...]] = {}  # every chunk key seen -> its block hashes
    seen: list = []

    def truth() -> set:
        held = {(Tier.CPU, h) for k, hs in chunks.items() if sched.cpu.hit(k) is not None
                and sched.cpu.hit(k).staging_job is None for h in hs}
        if sched.disk_enabled:
            held |= {(Tier.DISK, h) for k, _ in idx.read_blocks(b"", 1000) for h in chunks[k]}
        return held

    for step in range(40):
        if rng.random() < 0.15:
            sched.reset_cpu_tier()
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(256) for _ in range(
                rng.choice([1, CHUNK, 2 * CHUNK]))]
            req = make_request(f"r{step}", tokens)
            per = CHUNK // BLOCK
            for c in range(len(req.block_hashes) // per):
                chunks[req.block_hashes[(c + 1) * per - 1]] = tuple(
                    req.block_hashes[c * per:(c + 1) * per])
            blocks[req.request_id] = list(range(len(tokens) // BLOCK + 1))
            hit = sched.num_matched_tokens(req, 0)
            sched.plan_load(req, blocks[req.request_id], hit)
            plan = sched.plan_step([(req.request_id, req.num_tokens)])
            for load in plan.loads:
                sched.on_report(WorkerReport(loaded={load.job_id: {0: frozenset()}}))
            for job in plan.stores:
                sched.on_report(WorkerReport(host_stored={job.job_id: 1}))
                sched.on_report(WorkerReport(written={job.job_id: {"disk": {0: (7,) * len(job.chunks)}}}))
            sched.request_finished(req.request_id)
            sched.plan_step([])  # the step's disk transaction
        seen += events.take()
        assert index(seen) == truth(), f"step {step}"
    assert sched.counters.evictions_cpu and idx.stats()["counters"]["evictions"]
    assert sched.counters.chunks_loaded_disk and sched.counters.chunks_loaded_cpu
    sched.reset_all()
    seen += events.take() + events.take()
    assert index(seen) == set()
