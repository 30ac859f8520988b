"""Every number kv-offload reports, declared once: counters of each side and gauges.

Each counter is a typed field of ``SchedulerCounters`` (scheduler thread) or
``WorkerCounters`` (one rank's deltas); each gauge a field of ``SchedulerGauges``. The
field's metadata holds its Prometheus name, help text and labels, from which
``kv_offload.plugin.metrics`` derives the connector stats, the ``/metrics`` families and the log
summary, and docs/metrics.md documents each (checked by tests/test_metrics.py). A name that
is not a field here is a bug: ``spec`` raises ``UnknownMetricError``. Imports neither torch
nor vLLM (the scheduler side uses it).
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class UnknownMetricError(KeyError):
    """A counter or gauge name that no field here declares (a kv-offload bug)."""


class Side(enum.Enum):
    """Which process counts it: the scheduler, or every worker rank (summed over ranks)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class Kind(enum.Enum):
    COUNTER = "counter"  # deltas, summed over steps and ranks
    GAUGE = "gauge"  # the latest value wins


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One declared number: its field ``name`` (the key in connector stats), the
    Prometheus family ``metric`` it exports to, with ``labels`` telling the members of a
    family apart, and the ``help`` text."""

    name: str
    metric: str
    help: str
    side: Side
    kind: Kind
    labels: tuple[tuple[str, str], ...] = ()

    def sample(self) -> str:
        """The Prometheus sample name with labels, e.g. ``kv_offload_hit_tokens_total{tier=cpu}``."""
        return f"{self.metric}{{{','.join(f'{k}={v}' for k, v in self.labels)}}}"


_SPEC = "kv_offload"  # field metadata key


def _counter(metric: str, help: str, **labels: str) -> Any:
    """A counter field (default 0) exported as Prometheus counter ``metric``."""
    return dataclasses.field(default=0, metadata={_SPEC: (metric, help, labels)})


def _gauge(metric: str, help: str) -> Any:
    """A gauge field (None: not measured in this report) exported as ``metric``."""
    return dataclasses.field(default=None, metadata={_SPEC: (metric, help, {})})


_HIT = "Prompt tokens loaded"
_LOADED = "Chunks loaded"
_STORED = "Chunks stored"
_BYTES = ("Bytes moved by direction: load (host -> engine), store (engine -> host), "
          "disk_read, disk_write, remote_read, remote_write")
_SECONDS = "Seconds spent moving bytes, by direction (see transfer_bytes)"


@dataclass(slots=True)
class SchedulerCounters:
    """Monotonic counters since the connector started (scheduler thread only)."""

    hit_tokens_cpu: int = _counter("kv_offload_hit_tokens_total", _HIT, tier="cpu")
    hit_tokens_disk: int = _counter("kv_offload_hit_tokens_total", _HIT, tier="disk")
    hit_tokens_remote: int = _counter("kv_offload_hit_tokens_total", _HIT, tier="remote")
    miss_tokens: int = _counter("kv_offload_miss_tokens_total",
                                "Prompt tokens past vLLM's own hit that no tier held")
    lookup_skipped_tokens: int = _counter(
        "kv_offload_lookup_skipped_tokens_total",
        "Prompt tokens past vLLM's own hit of requests that must not read cached KV "
        "(prompt_logprobs): not looked up, neither hits nor misses")
    chunks_loaded_cpu: int = _counter("kv_offload_chunks_loaded_total", _LOADED, tier="cpu")
    chunks_loaded_disk: int = _counter("kv_offload_chunks_loaded_total", _LOADED, tier="disk")
    chunks_loaded_remote: int = _counter("kv_offload_chunks_loaded_total", _LOADED,
                                         tier="remote")
    chunks_stored_cpu: int = _counter("kv_offload_chunks_stored_total", _STORED, tier="cpu")
    chunks_stored_disk: int = _counter("kv_offload_chunks_stored_total", _STORED, tier="disk")
    chunks_stored_remote: int = _counter(  # written by every rank
        "kv_offload_chunks_stored_total", _STORED, tier="remote")
    skipped_stores: int = _counter("kv_offload_skipped_stores_total",
                                   "Chunks not stored because no CPU slot was free")
    stores_without_window: int = _counter(
        "kv_offload_stores_without_window_total",
        "Chunks not stored because vLLM had already freed a sliding-window block they need")
    stores_without_state: int = _counter(
        "kv_offload_stores_without_state_total",
        "Chunks not stored because vLLM handed over no mamba state for their end boundary")
    evictions_cpu: int = _counter("kv_offload_evictions_total", "Chunks evicted", tier="cpu")
    load_errors: int = _counter("kv_offload_load_errors_total",
                                "Chunks whose load failed and were recomputed")
    hit_tokens_tail: int = _counter(
        "kv_offload_tail_hit_tokens_total",
        "Prompt tokens loaded from request tails (the tokens past a request's last whole "
        "chunk; counted in kv_offload_hit_tokens_total too)")
    tails_stored: int = _counter(
        "kv_offload_tails_stored_total",
        "Request tails stored in the CPU tier: a prompt's tokens past its last whole "
        "chunk, one CPU slot each")
    loads_same_step: int = _counter(
        "kv_offload_loads_same_step_total",
        "Loads copied before the forward of the step that runs their request (no wait "
        "outside the batch)")
    loads_given_up: int = _counter(
        "kv_offload_loads_given_up_total",
        "Loads vLLM dropped as a whole after they failed from their first block; the "
        "request was recomputed without a new load")
    kv_events_dropped: int = _counter(
        "kv_offload_kv_events_dropped_total",
        "KV events for routers dropped: more than 16,384 waited between two engine steps")
    hook_errors: int = _counter(
        "kv_offload_hook_errors_total",
        "Exceptions caught in kv-offload's connector hooks (a kv-offload bug): answered "
        "as a miss, vLLM kept serving")
    remote_lookups: int = _counter(
        "kv_offload_remote_lookups_total",
        "Remote existence checks, one per request the local tiers could not serve (a miss "
        "without a call while the server backs off)")
    remote_lookup_errors: int = _counter(
        "kv_offload_remote_lookup_errors_total",
        "Remote existence checks that failed or ran past the budget (request tails' "
        "questions included)")
    seconds_remote_lookup: float = _counter(
        "kv_offload_remote_lookup_seconds_total",
        "Seconds the scheduler spent in remote existence checks (request tails' "
        "questions included)")

    def add_per_tier(self, what: str, tier: str, count: int) -> None:
        """Add ``count`` to the counter ``{what}_{tier}`` (``chunks_loaded_disk``...). The
        CPU, disk and remote tiers have them; another tier (a test's) is not counted here
        (its own ``stats`` may)."""
        name = f"{what}_{tier}"
        if name in _PER_TIER:
            setattr(self, name, getattr(self, name) + count)

    def snapshot(self) -> dict[str, float]:
        # Read every step (connector stats): attribute reads, not dataclasses.asdict,
        # which deep-copies each field (~50 us a call).
        return {name: getattr(self, name) for name in _SCHEDULER_FIELDS}


@dataclass(slots=True)
class WorkerCounters:
    """Counter deltas of one worker rank. Build one with the deltas to add
    (``WorkerCounters(remote_errors=1)``) and hand it to a ``WorkerTally``."""

    bytes_load: int = _counter("kv_offload_transfer_bytes_total", _BYTES, direction="load")
    bytes_store: int = _counter("kv_offload_transfer_bytes_total", _BYTES, direction="store")
    bytes_disk_read: int = _counter("kv_offload_transfer_bytes_total", _BYTES,
                                    direction="disk_read")
    bytes_disk_write: int = _counter("kv_offload_transfer_bytes_total", _BYTES,
                                     direction="disk_write")
    bytes_remote_read: int = _counter("kv_offload_transfer_bytes_total", _BYTES,
                                      direction="remote_read")
    bytes_remote_write: int = _counter("kv_offload_transfer_bytes_total", _BYTES,
                                       direction="remote_write")
    seconds_load: float = _counter("kv_offload_transfer_seconds_total", _SECONDS,
                                   direction="load")
    seconds_store: float = _counter("kv_offload_transfer_seconds_total", _SECONDS,
                                    direction="store")
    seconds_disk_read: float = _counter("kv_offload_transfer_seconds_total", _SECONDS,
                                        direction="disk_read")
    seconds_disk_write: float = _counter("kv_offload_transfer_seconds_total", _SECONDS,
                                         direction="disk_write")
    seconds_remote_read: float = _counter("kv_offload_transfer_seconds_total", _SECONDS,
                                          direction="remote_read")
    seconds_remote_write: float = _counter("kv_offload_transfer_seconds_total", _SECONDS,
                                           direction="remote_write")
    checksum_failures: int = _counter("kv_offload_checksum_failures_total",
                                      "Disk chunk reads whose checksum did not match")
    disk_read_errors: int = _counter(
        "kv_offload_disk_read_errors_total",
        "Disk chunk reads that failed: I/O error, slab file missing or cut short")
    disk_write_errors: int = _counter("kv_offload_disk_write_errors_total",
                                      "Failed slab writes")
    remote_errors: int = _counter(
        "kv_offload_remote_errors_total",
        "Remote reads that failed (server down, timeout) and were recomputed")
    remote_misses: int = _counter(
        "kv_offload_remote_misses_total",
        "Remote values gone since the lookup or failing verification")
    remote_skipped_stores: int = _counter(
        "kv_offload_remote_skipped_stores_total",
        "Remote writes that failed or were skipped while the server was down (per rank)")
    audit_chunks: int = _counter(
        "kv_offload_audit_chunks_total",
        "Chunks whose copy the runtime audit re-read and compared (audit_rate)")
    audit_mismatches: int = _counter(
        "kv_offload_audit_mismatches_total",
        "Audited chunks whose copy differed from the engine blocks: discarded, and the "
        "copy path fell back to the plainest")

    def add(self, other: WorkerCounters) -> None:
        """Add ``other``'s deltas to these (mutates self only)."""
        for name in _WORKER_FIELDS:
            value = getattr(other, name)
            if value:
                setattr(self, name, getattr(self, name) + value)

    def nonzero(self) -> dict[str, float]:
        """The counters that moved, by field name (the connector stats' keys)."""
        return {name: value for name in _WORKER_FIELDS if (value := getattr(self, name))}


@dataclass(slots=True)
class SchedulerGauges:
    """The scheduler's current levels, reported with its counter deltas; a field left
    None is not measured in this report (Prometheus keeps the last value)."""

    pending_jobs: int | None = _gauge("kv_offload_pending_jobs",
                                      "Load and store jobs in flight")
    cpu_used_bytes: int | None = _gauge("kv_offload_cpu_used_bytes",
                                        "Bytes of CPU-tier slots in use, per rank")
    cpu_capacity_bytes: int | None = _gauge("kv_offload_cpu_capacity_bytes",
                                            "CPU-tier size, per rank")
    disk_used_bytes: int | None = _gauge(
        "kv_offload_disk_used_bytes", "Bytes of disk slots in use in this namespace, all ranks")
    disk_capacity_bytes: int | None = _gauge("kv_offload_disk_capacity_bytes",
                                             "Disk budget of this namespace")
    disk_up: int | None = _gauge(
        "kv_offload_disk_up",
        "1 while the disk tier serves, 0 once it turned itself off for this run (a failing "
        "store directory)")
    remote_up: int | None = _gauge(
        "kv_offload_remote_up",
        "1 while the scheduler reaches the remote tier, 0 while it backs off")

    def measured(self) -> dict[str, int]:
        """The gauges measured in this report, by field name."""
        return {name: value for name in _GAUGE_FIELDS
                if (value := getattr(self, name)) is not None}


class WorkerTally:
    """Thread-safe sum of ``WorkerCounters`` deltas, added from any thread of a rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = WorkerCounters()

    def add(self, deltas: WorkerCounters) -> None:
        with self._lock:
            self._counts.add(deltas)

    def take(self) -> WorkerCounters:
        """The sum since the last call; starts a new one."""
        with self._lock:
            counts, self._counts = self._counts, WorkerCounters()
        return counts


def declared_metrics(cls: type, side: Side, kind: Kind) -> tuple[MetricSpec, ...]:
    """The metrics declared by the fields of dataclass ``cls``; raises UnknownMetricError
    for a field declared without its metric (``_counter``, ``_gauge``)."""
    specs = []
    for f in dataclasses.fields(cls):
        if _SPEC not in f.metadata:  # a field added without its metric: fail at import
            raise UnknownMetricError(f"{cls.__name__}.{f.name} declares no metric: declare "
                                     f"it with _counter or _gauge")
        metric, help, labels = f.metadata[_SPEC]
        specs.append(MetricSpec(f.name, metric, help, side, kind, tuple(labels.items())))
    return tuple(specs)


_SCHEDULER_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerCounters))
_WORKER_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerCounters))
_GAUGE_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerGauges))
COUNTERS: Mapping[str, MetricSpec] = {s.name: s for s in (
    *declared_metrics(SchedulerCounters, Side.SCHEDULER, Kind.COUNTER),
    *declared_metrics(WorkerCounters, Side.WORKER, Kind.COUNTER))}
GAUGES: Mapping[str, MetricSpec] = {
    s.name: s for s in declared_metrics(SchedulerGauges, Side.SCHEDULER, Kind.GAUGE)}


def spec(name: str) -> MetricSpec:
    """The declaration of counter or gauge ``name``; raises UnknownMetricError for a name
    no field declares (a bug: never dropped)."""
    found = COUNTERS.get(name) or GAUGES.get(name)
    if found is None:
        raise UnknownMetricError(f"kv-offload bug: {name!r} is not a declared counter or "
                                 "gauge (kv_offload.counters)")
    return found


_PER_TIER = frozenset(f.name for f in dataclasses.fields(SchedulerCounters)
                      if dict(f.metadata.get(_SPEC, ("", "", {}))[2]).get("tier"))
"""The scheduler counters that exist once per tier (a ``tier`` label)."""
