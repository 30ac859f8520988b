"""Jobs and reports: the plain values that cross the scheduler/worker boundary.

Scheduler -> workers: ``LoadJob`` and ``StoreJob`` inside ``StepPlan``.
Workers -> scheduler: ``WorkerReport``, merged across ranks with ``merge``.
Everything here is small, immutable (or merge-only) and picklable; no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_offload.tier_contract import Place

SKIP_BLOCK = -1
"""A block id that means "do not copy this block of the chunk" (it is already computed)."""


@dataclass(frozen=True, slots=True)
class ChunkMove:
    """One chunk of a job on every rank.

    ``block_ids``: the engine blocks of the chunk in order, ``SKIP_BLOCK`` for blocks
    that must not be touched. ``cpu_slot``: the host slot; None in a load means the
    chunk vanished after lookup and must be reported as failed. ``source``: for loads,
    the secondary tier's place to read the chunk from into ``cpu_slot`` (None: the slot
    holds it). ``sinks``: the places ``cpu_slot`` is written to once it holds the chunk
    (a store's tiers; a load's fills of earlier tiers). ``after_job``: for loads, a job
    that is still filling ``cpu_slot`` from its source; this chunk is copied once that
    read is done (a shared load).
    """

    block_ids: tuple[int, ...]
    cpu_slot: int | None
    source: Place | None = None
    sinks: tuple[Place, ...] = ()
    after_job: int | None = None


@dataclass(frozen=True, slots=True)
class LoadJob:
    """A secondary tier -> host (a move's ``source``) -> engine blocks, for one request.

    ``same_step``: every chunk is in a READY CPU slot and vLLM runs the request in this
    very step (the connector answered its lookup with a synchronous hit): the workers copy
    it in ``start_load_kv``, before the step's forward, and report a failed chunk's blocks
    as load errors of this step, never as a finished receive."""

    job_id: int
    req_id: str
    chunks: tuple[ChunkMove, ...]
    same_step: bool = False


@dataclass(frozen=True, slots=True)
class StoreJob:
    """Engine blocks -> host slot -> the secondary tiers of each move's ``sinks``.

    ``req_ids``: per chunk, the request whose engine blocks it copies (empty when not
    known: then no request's blocks wait for this job). ``audited``: the runtime audit
    may re-read its blocks; False for request tails, whose last block the request's
    next steps write past the tail while the copy may still run (scheduler/tails.py)."""

    job_id: int
    chunks: tuple[ChunkMove, ...]
    req_ids: tuple[str, ...] = ()
    audited: bool = True


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the workers do this step: loads to start and stores to take after compute.

    ``held``: finished requests whose engine blocks vLLM keeps for kv-offload until
    every rank reports them in ``finished_sending`` (their engine -> host copies were in
    flight when they finished; invariant 3). ``preempted``: requests vLLM preempted this
    step; their blocks may be rewritten by this step's forward, so their copies are
    fenced before it."""

    loads: tuple[LoadJob, ...] = ()
    stores: tuple[StoreJob, ...] = ()
    held: tuple[str, ...] = ()
    preempted: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores or self.held or self.preempted)


Results = dict[int, tuple[object | None, ...]]
"""Rank -> per chunk of a job, what that rank's write to a tier returned (None: no sink
there, or not written)."""


@dataclass(slots=True)
class WorkerReport:
    """What workers finished since their last report (merged over ranks by the connector).

    ``host_stored``: store job -> number of ranks whose engine -> host copy finished.
    ``host_failed``: store job -> number of ranks whose engine -> host copy raised (the
    job's chunks are then discarded, never published).
    ``written``: job -> tier -> rank -> per chunk, the result of its write to that tier
    (a store's sinks, or a load's fills), once all of the job's writes to it ended.
    ``bad_reads``: load job -> rank -> staged chunks whose read (from their source tier)
    failed verification or I/O: their host slot does not hold the chunk (the CPU entry is
    discarded, the source's entry dropped). A staged chunk not listed was read intact,
    also when its job failed it (engine copy error, timeout): the scheduler then keeps it.
    ``loaded``: load job -> rank -> indexes of chunks that failed on that rank.
    ``broken``: tier -> why it keeps failing on a rank (its store directory deleted,
    read-only, I/O errors); the scheduler then stops using that tier.
    ``paused``: rank -> whether vLLM has taken that rank's KV cache away now
    (``unregister_kv_caches``; False once ``restore_kv_caches`` gave it back), for the
    ranks whose state changed since their last report. While any rank is paused the
    scheduler plans no load or store.
    """

    host_stored: dict[int, int] = field(default_factory=dict)
    host_failed: dict[int, int] = field(default_factory=dict)
    written: dict[int, dict[str, Results]] = field(default_factory=dict)
    loaded: dict[int, dict[int, frozenset[int]]] = field(default_factory=dict)
    bad_reads: dict[int, dict[int, frozenset[int]]] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)
    paused: dict[int, bool] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.host_stored or self.host_failed or self.written or self.loaded
                    or self.bad_reads or self.broken or self.paused)

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Fold ``other`` (another rank's report) into this one; returns self."""
        for job, count in other.host_stored.items():
            self.host_stored[job] = self.host_stored.get(job, 0) + count
        for job, count in other.host_failed.items():
            self.host_failed[job] = self.host_failed.get(job, 0) + count
        for job, tiers in other.written.items():
            mine = self.written.setdefault(job, {})
            for tier, by_rank in tiers.items():
                mine.setdefault(tier, {}).update(by_rank)
        for job, failed in other.loaded.items():
            self.loaded.setdefault(job, {}).update(failed)
        for job, bad in other.bad_reads.items():
            self.bad_reads.setdefault(job, {}).update(bad)
        for tier, why in other.broken.items():
            self.broken.setdefault(tier, why)
        self.paused.update(other.paused)
        return self
