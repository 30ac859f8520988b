"""A disk hit whose chunks are copied into the engine as their reads land, on vLLM's real
Scheduler (issue 29; ``OffloadWorker._copy_landed``, the CPU backend's synchronous engine).

The last read of the load is held back a few steps, so the first chunks are in the engine
while it still reads. However the load ends (the read lands, fails its checksum, the load
times out, the request is aborted meanwhile), every token is computed on the right KV
(the fake model runner checks each one) and the engine ends idle: no pin, reservation or
job left, every CPU and disk slot holding its key's KV.
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.request import RequestStatus

from kv_offload.testing.scheduler_harness import SchedulerHarness

CHUNKS = 5  # the reader's prompt: 5 whole chunks of 16 tokens and one token more
LAST_READ_DELAY = {"lands": 5, "damaged": 5, "times_out": 12, "aborted": 12}


@pytest.fixture(autouse=True)
def quiet_injected_faults(caplog):
    caplog.set_level(logging.CRITICAL, logger="kv_offload")


def _prompt() -> list[int]:
    return [3 + (11 * i) % 997 for i in range(16 * CHUNKS + 1)]


@pytest.mark.parametrize("ending", sorted(LAST_READ_DELAY))
def test_a_disk_load_copied_as_its_reads_land_ends_right_however_its_last_read_ends(
        harness_factory, monkeypatch, ending):
    reads: list[object] = []  # the reader's chunk moves, in submission order

    def delays(fn, args):
        if getattr(fn, "__name__", "") != "_read":
            return None
        reads.append(args[0])
        return LAST_READ_DELAY[ending] if len(reads) == CHUNKS else 0

    harness: SchedulerHarness = harness_factory(
        num_blocks=64, cpu_slots=8, copy_thread=False, delay_rule=delays,
        load_timeout_steps=6, sync_load_budget_ms=0)
    prompt = _prompt()
    harness.add("writer", prompt, max_tokens=1)
    harness.run()
    assert harness.reset_prefix_cache(reset_connector=True)  # the disk alone holds it
    reads.clear()
    if ending == "damaged":  # the held-back read fails its checksum
        disk = harness.worker.tiers["disk"]
        read = disk.read
        monkeypatch.setattr(disk, "read", lambda place, out: (
            False if place is reads[-1].source else read(place, out)))
    copies: list[tuple[int, int]] = []  # (step, chunks) of each engine copy of a load
    load = harness.worker.engine.load

    def recording_load(slots, block_ids, *, after=None):
        copies.append((harness.step_index, len(slots)))
        return load(slots, block_ids, after=after)

    monkeypatch.setattr(harness.worker.engine, "load", recording_load)
    harness.add("reader", prompt, max_tokens=4)
    for _ in range(3):  # the lookup, then steps while the held-back read runs
        harness.step()
    assert len(reads) == CHUNKS, "the reader's hit is not a disk load of every chunk"
    assert harness.requests["reader"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sum(n for _, n in copies) == CHUNKS - 1, "the chunks read are in the engine"
    if ending == "aborted":
        harness.abort("reader")
    harness.run(max_steps=60)
    assert not harness.busy()
    assert harness.check_idle() == []
    if ending != "aborted":
        assert harness.requests["reader"].status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert harness.runner.num_checked_tokens > 0
