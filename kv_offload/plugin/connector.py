"""KVOffloadConnector: the thin vLLM ``KVConnectorBase_V1`` adapter.

vLLM builds it twice: in the scheduler process (role SCHEDULER), where it routes calls
to ``OffloadScheduler``, and in every worker (role WORKER), where it routes them to
``OffloadWorker``. The two halves talk only through ``StepPlan`` (in the connector
metadata) and ``WorkerReport`` (in the worker metadata).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kv_offload.config import OffloadConfig, format_size
from kv_offload.jobs import StepPlan, WorkerReport
from kv_offload.layout import num_cpu_slots
from kv_offload.plugin.engine_info import (
    UnsupportedEngineError,
    aliased_layers,
    layer_names,
    layout_from_vllm,
)
from kv_offload.plugin.metrics import OffloadPromMetrics, OffloadStats, SchedulerStats
from kv_offload.tier_plugins import TierContext, build_tiers

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kv_offload.plugin.worker_setup import KVPlacement
    from kv_offload.scheduler import OffloadScheduler
    from kv_offload.worker.runner import OffloadWorker

logger = logging.getLogger("kv_offload")


class OffloadConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's plan; ``idle``: vLLM runs no forward this step."""

    def __init__(self, plan: StepPlan | None, idle: bool = False) -> None:
        self.plan = plan  # None: the hook and its fallback failed (workers do nothing)
        self.idle = idle


class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: a ``WorkerReport``, merged over ranks by vLLM."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, OffloadWorkerMetadata):
            self.report.merge(other.report)
        return self


def _adopt_vllm_logging() -> None:
    """Send the "kv_offload" loggers through vLLM's handler (its format, level and stream).

    vLLM configures only the "vllm" logger; without this, kv-offload's INFO lines (start-up,
    summaries) are dropped and its warnings print bare, without level or time. A no-op if
    the application configured "kv_offload" itself or vLLM's logging is off."""
    ours, theirs = logging.getLogger("kv_offload"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def _vllm_evicts_cached_blocks() -> bool:
    """Whether vLLM's KV cache manager can drop blocks from its prefix cache by id
    (``KVCacheManager.evict_blocks``, vLLM 0.32-0.34): what lets a failed same-step load's
    blocks be dropped (``KVOffloadConnector._uncache_failed_blocks``)."""
    try:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
    except ImportError:
        return False
    return callable(getattr(KVCacheManager, "evict_blocks", None))


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads prefix KV to host RAM, local disk and a shared Redis; loads it back asynchronously.

    ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on for sliding-window models
    (each KV cache group's blocks are stored as ``kv_offload/groups.py`` says)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        _adopt_vllm_logging()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = OffloadConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, self.config)
        self.namespace = self.layout.fingerprint()
        reproducible = ((self.config.disk_enabled or self.config.remote_enabled
                         or bool(self.config.extra_tiers)) and self._check_hash_reproducible())
        self.persistent = self.config.disk_enabled and reproducible
        self.remote_enabled = self.config.remote_enabled and reproducible
        # Like the disk and remote tiers, a tier may outlive this process: keys must too.
        self.extra_tiers = list(self.config.extra_tiers or []) if reproducible else []
        self._scheduler: OffloadScheduler | None = None
        self._worker: OffloadWorker | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}  # as registered (restore_kv_caches)
        self._kv_placement: KVPlacement = ()
        self._pending_failed_blocks: set[int] = set()
        self._pending_failed_reqs: set[str] = set()
        self._stores_issued_for: StepPlan | None = None  # the last plan _issue_stores ran
        self._read_failed_load: StepPlan | None = None  # a plan whose same-step load failed
        self._uncache_missing_logged = False  # _uncache_failed_blocks' error, logged once
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
            if (self.persistent or self.remote_enabled) and not self.config.verify_checksums:
                logger.warning(
                    "kv-offload: verify_checksums is off: a chunk damaged on disk, or one "
                    "that another vLLM instance sharing this disk_path or remote tier "
                    "replaces while this one reads it, is loaded as is and gives wrong "
                    "tokens. Turn it off only for a store no other instance uses.")
            if self.remote_enabled and self.config.remote_password_in_config:
                logger.warning(
                    "kv-offload: the remote server's password is written in remote_url (or "
                    "remote_cluster_nodes), and vLLM prints kv_connector_extra_config at "
                    "start-up ('vllm serve' also shows it on its command line to every user "
                    "of the host). Put it in an environment variable or a file and name that "
                    "with remote_password_env or remote_password_file (README, remote tier).")
        remote = "off"
        if self.remote_enabled:
            from kv_offload.remote import RemoteTarget

            remote = RemoteTarget(self.config.remote_url,
                                  tuple(self.config.remote_cluster_nodes or ())).describe()
        logger.info(
            "kv-offload %s: chunk %d tokens (%s per rank), CPU tier %s, disk tier %s, "
            "remote tier %s, namespace %s", role.name.lower(), self.layout.chunk_tokens,
            format_size(self.layout.slot_bytes), format_size(self.config.cpu_bytes),
            self.config.disk_path if self.persistent else "off", remote, self.namespace)
        if self.layout.groups:
            logger.info("kv-offload %s: %d KV cache groups (vLLM's hybrid KV cache manager): "
                        "%s; a chunk holds %d blocks", role.name.lower(),
                        len(self.layout.groups), ", ".join(
                            f"{g.kind}{f'({g.window})' if g.window else ''} x{g.num_layers}"
                            for g in self.layout.groups), self.layout.blocks_per_chunk)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is only a future miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.33+: refuse ``--enable-sleep-mode`` before the engine starts (as
        ``layout_from_vllm`` does on every version: vLLM 0.32 sleeps without telling the
        connector). kv-offload follows vLLM taking the KV cache away and giving it back
        (``unregister_kv_caches``/``restore_kv_caches``), but sleep mode has not been
        run with it on a GPU yet."""
        return False

    def _check_hash_reproducible(self) -> bool:
        if self.layout.hashes_reproducible(os.environ.get("PYTHONHASHSEED")):
            return True
        if self._role != KVConnectorRole.SCHEDULER:
            return False  # the scheduler side says it, once
        logger.warning(
            "kv-offload: prefix_caching_hash_algo=%s without PYTHONHASHSEED gives block "
            "hashes that change on every restart and between hosts, so the disk, remote "
            "and extra tiers could never hit; they are OFF for this run. Fix: set "
            "PYTHONHASHSEED to the same value for every instance, or use "
            "--prefix-caching-hash-algo sha256.", self.layout.hash_algo)
        return False

    # ==== scheduler side =====================================================================

    def _init_scheduler(self) -> None:
        from kv_offload.plugin.kv_events import attach_events
        from kv_offload.scheduler import OffloadScheduler, PlannerConfig
        from kv_offload.scheduler.hook_guard import HookGuard

        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning(
                "kv-offload: kv_load_failure_policy is %r, so a chunk that fails its "
                "checksum fails the request instead of being recomputed. Add "
                "\"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config "
                "(OffloadConfig.to_json() does).",
                self._kv_transfer_config.kv_load_failure_policy)
        tiers: list[Any] = []  # the secondary tiers, in the order a lookup asks them
        if self.persistent and self.config.disk_path is not None:
            from kv_offload.disk import DiskIndex
            from kv_offload.disk.tier import DiskTier

            tiers.append(DiskTier(DiskIndex.open(
                self.config.disk_path, namespace_id=self.namespace,
                descriptor=self.layout.descriptor(), slot_bytes=self.layout.slot_bytes,
                num_ranks=self.layout.tp_size, capacity_bytes=self.config.disk_bytes,
                allow_unsafe_permissions=self.config.disk_allow_unsafe_permissions)))
        if self.remote_enabled:
            from kv_offload.remote import remote_tier_for
            from kv_offload.remote.index import RemoteIndex

            # Lookups run on their own threads: remote_lookup_budget_ms bounds each
            # request's wait (RemoteLookups); the connection keeps remote_timeout_s, so
            # that a far or TLS server can connect and a loaded host's hiccup is no failure.
            remote = remote_tier_for(self.config, self.layout, namespace=self.namespace,
                                     who="scheduler")
            remote.publish_descriptor(self.layout.descriptor())
            tiers.append(RemoteIndex(remote))
        tiers += build_tiers(self.extra_tiers, TierContext(
            "scheduler", self.namespace, self.layout.tp_size, 0, self.layout.slot_bytes,
            self.config))
        planner_config = PlannerConfig(
            chunk_tokens=self.layout.chunk_tokens, block_size=self.layout.block_size,
            tokens_per_hash=self.layout.tokens_per_hash, num_ranks=self.layout.tp_size,
            num_cpu_slots=num_cpu_slots(self.config, self.layout),
            store_generated=self.config.store_generated,
            eviction_policy=self.config.eviction_policy, groups=self.layout.groups,
            same_step_budget_s=self._same_step_budget_s(),
            chunk_bytes=self.layout.slot_bytes, partial_hits=self.config.partial_hits,
            min_async_hit_tokens=self.layout.block_size)
        self._scheduler = OffloadScheduler(planner_config, block_ids_of=self._block_ids_of,
                                           tiers=tiers)
        self._guard = HookGuard(self._scheduler.counters)
        self._events = attach_events(self._vllm_config, self._kv_cache_config, self._scheduler)
        self._stats = SchedulerStats(self._scheduler, self.layout)

    def _same_step_budget_s(self) -> float:
        """``sync_load_budget_ms`` in seconds, 0 where same-step loads are off
        (``same_step.why_off``, logged)."""
        from kv_offload.scheduler.same_step import why_off

        scheduler = self._vllm_config.scheduler_config
        why = why_off(async_scheduling=bool(getattr(scheduler, "async_scheduling", False)),
                      inflight_loads=bool(getattr(scheduler, "max_num_inflight_kv_loads", 0)),
                      remote_and_tp=self.remote_enabled and self.layout.tp_size > 1,
                      prefix_cache_kept=not _vllm_evicts_cached_blocks())
        if why and self.config.sync_load_budget_ms:
            logger.info("kv-offload: same-step loads are off %s; hits load asynchronously", why)
            return 0.0
        return self.config.sync_load_budget_ms / 1000

    @property
    def _sched(self) -> OffloadScheduler:
        """The scheduler half; vLLM calls scheduler-side hooks on that role only."""
        if self._scheduler is None:
            raise RuntimeError(f"kv-offload: a scheduler-side hook was called on the "
                               f"{self._role.name.lower()} side or after shutdown")
        return self._scheduler

    def _block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block table of every KV cache group."""
        if self._kv_cache_manager is None:
            raise RuntimeError("kv-offload: vLLM has not bound its KV cache manager "
                               "(bind_kv_cache_manager) before scheduling")
        return self._kv_cache_manager.get_block_ids(req_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        hit = self._guard.call("get_num_new_matched_tokens", lambda: 0,
                               self._sched.num_matched_tokens, request, num_computed_tokens)
        if hit is None:
            return None, False
        # A same-step hit runs in this step: loaded in start_load_kv, before the forward.
        return hit, hit > 0 and bool(self._guard.call(
            "get_num_new_matched_tokens (async)", lambda: True, self._sched.load_is_async,
            request.request_id))

    def may_load_async(self, request: Request) -> bool:
        # vLLM 0.34, with --max-num-inflight-kv-loads: a yes lets the request's load start
        # while the batch is full. The CPU tier holds its first chunk (O(1), no I/O).
        return bool(self._guard.call("may_load_async", lambda: False,
                                     self._sched.may_load_async, request))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        # Past a failure the request already waits for its load: fail it, never hang.
        self._guard.call("update_state_after_alloc", lambda: self._sched.fail_load(
            request.request_id, block_ids, num_external_tokens),
            self._sched.plan_load, request, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0:
            return {}
        tiers = self._guard.call(
            "get_external_cache_hit_sources", dict[str, int], self._sched.hit_tokens_by_tier,
            request.request_id) or {}
        out = {CacheHitSource.HOST: tiers.get("cpu", 0), CacheHitSource.DISK: tiers.get("disk", 0),
               CacheHitSource.EXTERNAL_UNSPECIFIED: tiers.get("remote", 0)}
        return {k: v for k, v in out.items() if v}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        num_scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens or {}

        def computed_after(req_id: str, before: int) -> int:
            return before + num_scheduled.get(req_id, 0) - len(spec.get(req_id, ()))

        scheduled = [(r.req_id, computed_after(r.req_id, r.num_computed_tokens))
                     for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += [(rid, computed_after(rid, n))
                      for rid, n in zip(cached.req_ids, cached.num_computed_tokens)]
        preempted = tuple(getattr(scheduler_output, "preempted_req_ids", None) or ())
        # Mamba "align" state hand-offs (vLLM 0.32+, drained every step; docs/
        # architecture.md, "Mamba state entries"); None without mamba groups.
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        states = getattr(block_state, "boundary_state_offloads", None) or None
        plan = self._guard.call("build_connector_meta", lambda: StepPlan(
            self._sched.take_pending_loads()), self._sched.plan_step, scheduled,
            preempted, states)
        self._guard.call("build_connector_meta (summary)", lambda: None,
                         self._stats.maybe_log_summary)
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
        return OffloadConnectorMetadata(plan, idle=idle)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        failed = getattr(connector_output, "invalid_block_ids", None)
        if failed:  # before vLLM frees or reuses a block of this output's requests
            self._guard.call("update_connector_output (failed loads)", lambda: None,
                             self._uncache_failed_blocks, failed)
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, OffloadWorkerMetadata):
            self._guard.call("update_connector_output", lambda: None,
                             self._sched.on_report, meta.report)
        if connector_output.finished_sending:  # vLLM frees these held requests' blocks
            self._guard.call("update_connector_output (sent)", lambda: None,
                             self._sched.blocks_released, connector_output.finished_sending)
        stats = connector_output.kv_connector_stats
        if isinstance(stats, OffloadStats):  # worker-side deltas, for the log summary
            self._stats.add_worker(stats.data)
            budget = self._sched.same_step
            if budget is not None:  # the load bandwidth that sizes same-step loads
                budget.observe(stats.data.get("bytes_load", 0),
                               stats.data.get("seconds_load", 0))

    def _uncache_failed_blocks(self, failed: set[int]) -> None:
        """Drop the blocks a failed load spoiled (``OffloadScheduler.blocks_spoiled_by``)
        from vLLM's prefix cache. Under "recompute" vLLM (0.32-0.34) keeps a failed
        synchronous load's blocks cached, counting on the request to recompute them in
        place; a preemption or an abort first leaves their wrong KV to the next request
        with that prefix (docs/vllm-bugs.md). Called from ``update_from_output``, after
        vLLM truncated the requests and before it frees any of their blocks or schedules
        again; an asynchronous load's blocks are not cached yet (a no-op for them). The
        requests keep their blocks; a block dropped here is not cached again when its
        request recomputes it (a future prefix-cache miss, never wrong KV)."""
        evict = getattr(self._kv_cache_manager, "evict_blocks", None)
        if evict is None:
            if not self._uncache_missing_logged:
                self._uncache_missing_logged = True
                logger.error("kv-offload: vLLM's KV cache manager has no evict_blocks; a "
                             "failed load's blocks stay in its prefix cache and may be "
                             "served with wrong KV (docs/vllm-bugs.md)")
            return
        evict(self._sched.blocks_spoiled_by(failed))

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # Engine -> host copies run in the background (the step never waits for them):
        # blocks with a copy in flight are held until every rank reports the request in
        # finished_sending (invariant 3; scheduler.holds). On a failure, free them.
        held = self._guard.call("request_finished", lambda: False,
                                self._sched.request_finished, request.request_id)
        return bool(held), None

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # SupportsHMA: vLLM calls this instead of request_finished, after freeing the
        # request's out-of-window sliding-window blocks (the planner fences copies of those).
        held = self._guard.call("request_finished", lambda: False,
                                self._sched.request_finished, request.request_id, block_ids)
        return bool(held), None

    def take_events(self) -> list[KVCacheEvent]:  # the tiers' chunks, for routers
        return (self._guard.call("take_events", list, self._events.take) or []) if self._events else []

    def has_pending_block_frees(self) -> bool:
        # Held blocks come back within a step or two: vLLM waits rather than preempting.
        return self._scheduler is not None and bool(self._guard.call(
            "has_pending_block_frees", lambda: False, self._scheduler.holds.num_held))

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping until workers report their disk writes.
        return self._scheduler is not None and bool(self._guard.call(
            "has_pending_push_work", lambda: False, self._scheduler.has_pending_work))

    def reset_cache(self) -> bool | None:
        if self._scheduler is None:
            return True
        reset = (self._scheduler.reset_all if self.config.connector_reset == "all"
                 else self._scheduler.reset_cpu_tier)
        return self._guard.call("reset_cache", lambda: None, reset) is not None

    # ==== metrics (both sides) ===============================================================

    def get_kv_connector_stats(self) -> OffloadStats | None:
        if self._scheduler is not None:  # vLLM calls it in update_from_output: guarded
            data = self._guard.call(
                "get_kv_connector_stats", dict[str, float], self._stats.take)
        elif self._worker is not None:
            data = self._worker.take_stats()
        else:
            return None
        return OffloadStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> OffloadStats:
        return OffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> OffloadPromMetrics:
        return OffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ==== worker side ========================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kv_offload.plugin.worker_setup import build_worker, kv_placement

        tensors = self._checked_kv_tensors(kv_caches)
        self._worker = build_worker(
            tensors=tensors, names=layer_names(self._kv_cache_config), layout=self.layout,
            config=self.config, num_blocks=int(self._kv_cache_config.num_blocks),
            namespace=self.namespace, persistent=self.persistent,
            extra_tiers=self.extra_tiers)
        self._kv_caches, self._kv_placement = dict(kv_caches), kv_placement(tensors)

    def _checked_kv_tensors(self, kv_caches: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The KV tensor of each layer kv-offload copies (``layer_names``), once every
        layer has one and the layers of other KV cache groups are views of them."""
        names = layer_names(self._kv_cache_config)
        missing = [n for n in names if n not in kv_caches]
        if missing:
            raise UnsupportedEngineError(
                f"kv-offload: KV tensors missing for layers {missing[:3]}...; this "
                f"engine's KV cache layout is not supported")
        for aliases in aliased_layers(self._kv_cache_config):  # groups over one tensor
            first = kv_caches[aliases[0]]
            for name in aliases[1:]:
                other = kv_caches.get(name)
                if other is None or (other.data_ptr(), other.shape, other.stride()) != (
                        first.data_ptr(), first.shape, first.stride()):
                    raise UnsupportedEngineError(
                        f"kv-offload: layer {name}'s KV tensor is not a view of layer "
                        f"{aliases[0]}'s, as vLLM's hybrid KV cache layout makes it; "
                        f"its blocks cannot be stored. Run without the connector.")
        return [kv_caches[n] for n in names]

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33+ takes the KV cache memory away: ``release_kv_cache_memory`` and
        sleep (``Worker.discard``/``sleep``), and on 0.34 a layer-wise weight update that
        borrows it (``extensible_kv_cache``). A pause, not a shutdown: returns once no
        copy can touch that memory (``OffloadWorker.pause``); the workers' next reports
        tell the scheduler side, which plans no load or store until
        ``restore_kv_caches``. The CPU, disk and remote tiers keep their chunks
        (forgetting them is ``reset_cache``'s job). Idempotent."""
        if self._worker is not None:
            self._worker.pause()

    def restore_kv_caches(self) -> None:
        """vLLM gave the KV cache memory back (0.33/0.34 call this without arguments,
        with the tensors registered before committed again at their addresses). The
        worker resumes on the same views when every tensor's address, shape and stride
        are unchanged; otherwise the tensors are checked as at start-up (an
        UnsupportedEngineError leaves the worker paused) and get a new copy engine.
        Idempotent."""
        from kv_offload.plugin.worker_setup import build_copy_engine, kv_placement, kv_planes

        if self._worker is None or not self._kv_caches:
            return
        tensors = self._checked_kv_tensors(self._kv_caches)
        if kv_placement(tensors) == self._kv_placement:
            self._worker.resume()
            return
        logger.warning("kv-offload: vLLM restored its KV cache at other addresses or in "
                       "another shape; registering it again")
        self._worker.pause()  # idempotent: restored without being unregistered first
        planes = kv_planes(tensors, self.layout, int(self._kv_cache_config.num_blocks))
        engine, audit = build_copy_engine(planes, self._worker.host, layout=self.layout,
                                          config=self.config, placement=self._worker.placement)
        self._kv_placement = kv_placement(tensors)
        self._worker.resume(engine=engine, audit=audit)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Before the forward with same-step loads (has_sync_kv_loads), else after it, on both
        # runners; those are then in the engine or ordered before their readers on the device.
        plan = self._plan()
        if plan is not None and plan.loads and self._worker is not None:
            self._worker.layer_waits.expect(forward_context)  # will each layer wait?
            if not self._worker.start_loads(plan.loads):  # a same-step load failed
                self._read_failed_load = plan  # its stores would copy KV computed on it

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:  # docs/architecture.md, "One same-step load"
            self._worker.layer_waits.wait(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kw: Any) -> None:
        return  # stores are issued once per step, after the whole forward (_issue_stores)

    def finish_forward(self) -> None:
        # Model Runner V2 only, right after the forward, before sampling and drafting:
        # docs/architecture.md, "Hook order on both model runners".
        self._issue_stores()

    def wait_for_save(self) -> None:
        self._issue_stores()  # V1, which never calls finish_forward; on V2 a no-op by now

    def _issue_stores(self) -> None:
        """Start the store copies of the bound plan, once per plan whichever hook comes
        first (the worker never waits for them: invariant 3)."""
        plan = self._plan()
        if plan is None or plan is self._stores_issued_for:
            return
        self._stores_issued_for = plan
        if plan.stores and self._worker is not None:
            if plan is self._read_failed_load:
                self._worker.run_stores(plan.stores, discard=True)
            else:
                self._worker.run_stores(plan.stores)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before this step's forward and before it starts loads, on both model runners
        # (V1: first in execute_model; V2: first in pre_forward, after update_requests,
        # which writes blocks only for engines kv-offload refuses). docs/architecture.md,
        # "Hook order on both model runners".
        plan = getattr(kv_connector_metadata, "plan", None)
        if self._worker is not None and isinstance(plan, StepPlan):
            self._worker.fence(plan.preempted)  # their freed blocks may be rewritten now
            self._worker.hold(plan.held)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        # A step without a forward has nothing to do but wait for loads: report them
        # the moment they end, instead of spinning through empty steps until then.
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        result = self._worker.poll(idle=isinstance(meta, OffloadConnectorMetadata) and meta.idle)
        if self.layout.groups:  # block ids are per group: vLLM recomputes the request
            self._pending_failed_reqs |= result.failed_req_ids
        else:
            self._pending_failed_blocks |= result.failed_block_ids
        return (result.finished_sending or None), (result.finished_req_ids or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._pending_failed_reqs = self._pending_failed_reqs, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        # With several KV cache groups vLLM takes failures only as failed_recving.
        failed, self._pending_failed_blocks = self._pending_failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        report = self._worker.take_report()
        return OffloadWorkerMetadata(report) if report else None

    def _plan(self) -> StepPlan | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, OffloadConnectorMetadata) else None

    def shutdown(self) -> None:
        self._kv_caches = {}
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None

