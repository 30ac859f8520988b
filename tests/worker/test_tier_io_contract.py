"""The worker half of the tier contract with a tier that breaks it: a ``TierIO`` whose
write answers fewer results than it was given chunks left the store unreported forever
(its CPU slots pinned on the scheduler side); now its chunks count as not written."""

from __future__ import annotations

from worker_support import drain

from kv_offload.copy import make_copy_engine
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.jobs import ChunkMove, StoreJob
from kv_offload.testing.tiers import written_to
from kv_offload.tier_contract import Place
from kv_offload.worker import OffloadWorker

PLANE_BYTES, BPC = 128, 2
SLOT_BYTES = 2 * PLANE_BYTES * BPC


class ShortIO:
    """A TierIO with a bug: ``write`` answers nothing."""

    name = "short"
    write_batch = 4

    def bind(self, count, clock) -> None: ...

    def read(self, place, out) -> bool:
        return False

    def write(self, addresses, views):
        return []

    def take_broken(self):
        return None

    def close(self) -> None: ...


def test_a_short_write_answer_still_reports_the_store(planes):
    host = allocate_host_slots(4, SLOT_BYTES, pinned=False)
    worker = OffloadWorker(rank=0, engine=make_copy_engine(planes, host, BPC), host=host,
                           tiers=[ShortIO()], io_threads=2)
    try:
        worker.run_stores([StoreJob(1, (ChunkMove((3, 7), 1, sinks=(Place("short", 5),)),),
                                    req_ids=("r",))])
        reports, _, _ = drain(worker, until=lambda r, f, b: any(written_to(x, "short")
                                                                 for x in r))
        assert written_to(next(x for x in reports if written_to(x, "short")), "short") == {
            1: {0: (None,)}}
    finally:
        worker.close(timeout_s=1.0)
