"""OffloadWorker with the remote tier: real torch copy engine, slab file and Redis server.

Regression scenarios: bytes that went engine -> Redis come back bit-exact into another
worker's engine blocks (and onto its disk); a key evicted between lookup and read, or a
dead server, fails only that load (its blocks are recomputed) and never blocks a step.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_runner import NS, SLOT_BYTES, blocks_of, drain, make_worker

from kv_offload.checksum import checksum
from kv_offload.disk import SlabFile
from kv_offload.jobs import ChunkMove, LoadJob, StoreJob
from kv_offload.remote import RemoteTarget, RemoteTier
from kv_offload.testing.tiers import written_to
from kv_offload.tier_contract import Place

NUM_BLOCKS, PLANE_BYTES = 16, 128
KEY_A, KEY_B = b"\xaa" * 32, b"\xbb" * 32


def make_planes(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.uint8, generator=gen)
            for _ in range(2)]


def make_remote(redis_server, **kwargs) -> RemoteTier:
    tier = RemoteTier(RemoteTarget(redis_server.url), namespace=NS, num_ranks=1,
                      payload_bytes=SLOT_BYTES, timeout_s=1.0, key_prefix="kvo-test", **kwargs)
    tier.health.min_backoff_s = 0.05
    return tier


@pytest.fixture
def remote(redis_server):
    redis_server.cli("flushall")
    tier = make_remote(redis_server)
    yield tier
    tier.close()


def test_store_to_remote_then_load_on_another_worker_restores_bytes(remote, tmp_path):
    writer_planes = make_planes(1)
    writer = make_worker(writer_planes, None, remote=remote)
    original = blocks_of(writer_planes, [3, 7])
    writer.run_stores([StoreJob(1, (ChunkMove((3, 7), 0, sinks=(Place("remote", KEY_A),)),))])
    reports, _, _ = drain(writer, until=lambda r, f, b: any(written_to(x, "remote") for x in r))
    assert written_to(next(x for x in reports if written_to(x, "remote")), "remote") == {1: {0: (True,)}}
    assert remote.lookup([KEY_A]) == 1
    writer.close()

    planes = make_planes(2)  # another host: different engine contents
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    reader = make_worker(planes, slab, remote=remote)
    job = LoadJob(2, "req", (ChunkMove((9, 10), 1, Place("remote", KEY_A), sinks=(Place("disk", 4),)),))
    reader.start_loads([job])
    reports, finished, failed = drain(
        reader, until=lambda r, f, b: "req" in f and any(written_to(x, "disk") for x in r))
    assert not failed
    for p, orig in zip(planes, original):
        assert torch.equal(p[[9, 10]], orig)
    (fill_sum,) = written_to(next(x for x in reports if written_to(x, "disk")), "disk")[2][0]
    on_disk = bytearray(SLOT_BYTES)
    assert slab.read(4, memoryview(on_disk), fill_sum)
    assert checksum(on_disk) == fill_sum
    stats = reader.take_stats()
    assert stats["bytes_remote_read"] == SLOT_BYTES and stats["bytes_disk_write"] == SLOT_BYTES
    reader.close()


def test_evicted_key_fails_the_chunk_and_skips_its_fill(remote, tmp_path):
    planes = make_planes(3)
    slab = SlabFile(tmp_path, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
    worker = make_worker(planes, slab, remote=remote)
    worker.run_stores([StoreJob(1, (ChunkMove((1, 2), 0, sinks=(Place("remote", KEY_A),)),))])
    drain(worker, until=lambda r, f, b: any(written_to(x, "remote") for x in r))
    before = blocks_of(planes, [11, 12, 13, 14])
    job = LoadJob(2, "r", (ChunkMove((11, 12), 1, Place("remote", KEY_A)),
                           ChunkMove((13, 14), 2, Place("remote", KEY_B), sinks=(Place("disk", 0),))))
    worker.start_loads([job])
    reports, _, failed = drain(worker, until=lambda r, f, b: "r" in f
                               and any(written_to(x, "disk") for x in r))
    assert failed == {13, 14}
    assert torch.equal(planes[0][[11, 12]], planes[0][[1, 2]])
    assert torch.equal(planes[0][[13, 14]], before[0][2:]), "nothing written for the miss"
    assert next(x for x in reports if x.loaded).loaded[2] == {0: frozenset({1})}
    assert written_to(next(x for x in reports if written_to(x, "disk")), "disk")[2] == {0: (None, None)}
    assert worker.take_stats()["remote_misses"] == 1
    worker.close()


def test_dead_server_fails_fast_and_skips_stores(redis_server, monkeypatch):
    """A dead server costs one failed call (the backoff's clock stands still: the other
    call is skipped), made on the worker's I/O threads, never on the caller's (vLLM's)."""
    remote = make_remote(redis_server, clock=lambda: 0.0)  # its backoff never ends
    planes = make_planes(4)
    worker = make_worker(planes, None, remote=remote)
    callers = []
    for name in ("write", "read_into"):
        call = getattr(remote, name)
        monkeypatch.setattr(remote, name, lambda *a, call=call, **kw: callers.append(
            threading.current_thread()) or call(*a, **kw))
    redis_server.kill()
    try:
        worker.run_stores([StoreJob(1, (ChunkMove((1, 2), 0, sinks=(Place("remote", KEY_A),)),))])
        worker.start_loads([LoadJob(2, "r", (ChunkMove((5, 6), 1, Place("remote", KEY_B)),))])
        reports, _, failed = drain(worker, until=lambda r, f, b: "r" in f
                                   and any(written_to(x, "remote") for x in r))
        assert len(callers) == 2 and threading.current_thread() not in callers
        assert failed == {5, 6}
        assert written_to(next(x for x in reports if written_to(x, "remote")), "remote") == {1: {0: (None,)}}
        assert any(x.host_stored == {1: 1} for x in reports), "the CPU tier still stored it"
        stats = worker.take_stats()
        assert stats["remote_skipped_stores"] == 1 and stats["remote_errors"] == 1
    finally:
        redis_server.start()
        worker.close()
