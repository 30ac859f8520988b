"""Drives vLLM's real Scheduler (or AsyncScheduler) with kv-offload, without a model.

Built the way vLLM tests its connectors (tests/v1/kv_connector/unit/utils.py): a real
``Scheduler`` whose connector is kv-offload from ``OffloadConfig.to_kv_transfer_config()``,
hand-built ``ModelRunnerOutput``s (``FakeModelRunner``), and a second
``KVOffloadConnector`` in role WORKER over fake CPU-backend KV tensors. The worker's
thread pools are ``StepExecutor``s and its clock is the harness's, so a seeded run is
deterministic (no runtime audit: its thread ran held copies early); ``Faults`` injects slow
reads (held past ``load_timeout_s``), corrupt and failing disk reads, engine copy failures
and a full disk (ENOSPC) from a seeded RNG.

``mamba=True`` adds a mamba group in vLLM's "align" mode (states at block boundaries, as
``boundary_state_offloads``); the harness replaces the one engine check that refuses mamba
hybrids (``engine_info.refuse_mamba_hybrids``): state entries proven scheduler-side only.

``check_idle()`` lists what is left over once every request finished: stuck requests,
blocks of vLLM's pool, pins, reservations and jobs on either side, CPU or disk slots
whose bytes are not the KV of their key, engine copies made while vLLM had taken the KV
cache away (``release_kv_cache``/``restore_kv_cache``). Tokens computed on wrong KV raise
``KVMismatchError`` during the run.
"""

from __future__ import annotations

import contextlib
import errno
import random
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

from kv_offload.config import OffloadConfig
from kv_offload.groups import KVGroup
from kv_offload.keys import chunk_keys
from kv_offload.testing import vllm_compat
from kv_offload.testing.fake_model import (
    ROW,
    FakeGroup,
    FakeModelRunner,
    kv_rows,
    make_kv_tensors,
    prefix_hashes,
)
from kv_offload.testing.step_executor import StepExecutor

NUM_LAYERS = 2
STEP_S = 0.01  # harness seconds per engine step (the worker's clock)


@dataclass(frozen=True)
class Faults:
    """Per-event probabilities of injected faults (0 = never), drawn from ``seed``."""

    seed: int = 0
    delay: float = 0.0  # a background task waits 1-2 steps
    slow: float = 0.0  # ... or outlives the load timeout
    corrupt_read: float = 0.0  # the slot's bytes on disk were damaged
    failed_read: float = 0.0  # the read raises EIO
    copy_failure: float = 0.0  # the engine copy of a load raises
    enospc: float = 0.0  # a slab write finds the disk full


class _FaultySlab:
    """A SlabFile that fails on purpose (see Faults); everything else passes through."""

    def __init__(self, slab: Any, harness: SchedulerHarness) -> None:
        self.unfaulty, self._h = slab, harness

    def read(self, slot: int, buf: Any, expected: int | None) -> Any:
        if self._h.draw("corrupt_read"):
            junk = np.frombuffer(self._h.rng.randbytes(len(buf)), dtype=np.uint8)
            self.unfaulty.write(slot, junk)  # the chunk's bytes are gone for good
        if self._h.draw("failed_read"):
            raise OSError(errno.EIO, "injected read error")
        return self.unfaulty.read(slot, buf, expected)

    def write(self, slot: int, buf: Any) -> int:
        if self._h.draw("enospc"):
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return self.unfaulty.write(slot, buf)

    def write_many(self, slots: list[int], bufs: list[Any]) -> list[int]:
        if self._h.draw("enospc"):  # the worker then writes each chunk alone
            raise OSError(errno.ENOSPC, "injected: no space left on device")
        return self.unfaulty.write_many(slots, bufs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unfaulty, name)


class _FaultyEngine:
    """A copy engine whose loads fail on purpose (see Faults), and that notes every copy
    made while vLLM has taken the KV cache away."""

    def __init__(self, engine: Any, harness: SchedulerHarness, *, synchronous: bool) -> None:
        self.unfaulty, self._h = engine, harness
        self.synchronous = synchronous  # False: the worker queues loads for its copy thread

    def load(self, *args: Any, **kwargs: Any) -> Any:
        self._h.note_copy("load")
        if self._h.draw("copy_failure"):
            raise RuntimeError("injected engine copy failure")
        return self.unfaulty.load(*args, **kwargs)

    def store(self, *args: Any, **kwargs: Any) -> Any:
        self._h.note_copy("store")
        return self.unfaulty.store(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unfaulty, name)


class SchedulerHarness:
    """One engine: vLLM's scheduler, kv-offload on both sides, a fake model runner.

    ``add``/``abort``/``reset_prefix_cache`` act between steps; ``step`` is one engine-core
    step (a batch queue of two with ``async_scheduling``); ``run`` steps until done.
    """

    def __init__(self, tmp_path: Path, *, async_scheduling: bool = False, num_blocks: int = 64,
                 block_size: int = 8, cpu_slots: int = 12, disk: bool = True,
                 load_timeout_steps: int = 5, faults: Faults = Faults(),
                 max_num_batched_tokens: int = 64, max_num_seqs: int = 8,
                 delay_rule: Callable[[Callable, tuple], int | None] | None = None,
                 background_stores: bool = False, copy_thread: bool = True,
                 connector_reset: str = "cpu", windows: tuple[int, ...] = (),
                 mamba: bool = False, model_runner: str | None = None,
                 max_num_inflight_kv_loads: int | None = None, sync_load_budget_ms: float = 20.0,
                 partial_hits: bool = True, extra_tiers: tuple[str, ...] = (),
                 remote_url: str | None = None) -> None:
        """``copy_thread``: the worker copies loads on its copy thread, as with a CUDA
        engine (the default: a copy's delay is what races); False: on vLLM's thread, as
        with the CPU backend's synchronous engine. ``connector_reset``: the option of that
        name; "cpu" (not the default "all") lets a reset leave the disk tier answering.
        ``windows``: a hybrid engine, with a sliding-window KV cache group of each of
        these windows (tokens) after the full-attention group, all over the same tensors
        (vLLM's hybrid KV cache manager). ``mamba``: a mamba group in "align" mode after
        those (see the module docstring). ``model_runner``: the hook order of the fake
        model runner, "v1" or "v2" (None: the installed vLLM's, V2 from 0.34 on).
        ``max_num_inflight_kv_loads``: vLLM's option of that name (0.34 on), which lets
        loads the connector says may be asynchronous start while the batch is full.
        ``partial_hits``, ``extra_tiers``, ``remote_url``: the options of those names."""
        self.copy_thread = copy_thread
        self.block_size, self.chunk_tokens = block_size, 2 * block_size
        self.faults, self.rng = faults, random.Random(faults.seed)
        self.delay_rule = delay_rule  # scripted delays of background tasks (regressions)
        self.async_scheduling = async_scheduling
        self.num_blocks = num_blocks
        self.now = 0.0
        self.step_index = 0
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.groups = (FakeGroup(tuple(range(NUM_LAYERS))),) + tuple(
            FakeGroup(tuple(range(NUM_LAYERS * (i + 1), NUM_LAYERS * (i + 2))), w)
            for i, w in enumerate(windows))
        if mamba:
            first = NUM_LAYERS * len(self.groups)
            self.groups += (FakeGroup(tuple(range(first, first + NUM_LAYERS)), mamba=True),)
        self.windows, self.mamba = tuple(windows), mamba
        positions = 2 + sum(KVGroup("sliding_window", 1, block_size, w).stored_blocks(
            self.chunk_tokens) for w in windows) + int(mamba)
        slot_bytes = NUM_LAYERS * positions * block_size * 2 * 4 * 4  # layers x blocks x page
        self.offload = OffloadConfig(
            cpu_size=cpu_slots * slot_bytes, chunk_tokens=self.chunk_tokens,
            disk_path=str(tmp_path / "store") if disk else None, disk_size=256 * slot_bytes,
            load_timeout_s=load_timeout_steps * STEP_S - STEP_S / 2, io_threads=1,
            cpu_background_stores=background_stores, connector_reset=connector_reset,
            sync_load_budget_ms=sync_load_budget_ms, partial_hits=partial_hits,
            extra_tiers=list(extra_tiers) or None, remote_url=remote_url, audit_rate=0.0,
            remote_lookup_budget_ms=30000.0)  # real time: a loaded CI once held a trip 5 s
        self.vllm_config = build_vllm_config(self.offload, block_size=block_size,
                                             max_num_batched_tokens=max_num_batched_tokens,
                                             max_num_seqs=max_num_seqs)
        self.vllm_config.scheduler_config.async_scheduling = async_scheduling  # as on GPUs
        if max_num_inflight_kv_loads is not None:
            vllm_compat.set_max_num_inflight_kv_loads(self.vllm_config.scheduler_config,
                                                      max_num_inflight_kv_loads)
        if mamba:  # what vLLM sets for a mamba hybrid with prefix caching
            self.vllm_config.cache_config.mamba_cache_mode = "align"
            self.vllm_config.cache_config.mamba_block_size = block_size
        self.kv_cache_config = build_kv_cache_config(num_blocks, block_size, self.windows,
                                                     mamba=mamba)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = self._build_scheduler()
        self.executor = StepExecutor(self._delay)
        self.store_executor = StepExecutor(self._delay, run_when_waited_for=True)
        self.kv = make_kv_tensors(NUM_LAYERS, num_blocks, block_size)
        self.worker_connector, self.worker = self._build_worker()
        self.runner = FakeModelRunner(self.worker_connector, self.kv, block_size,
                                      async_scheduling=async_scheduling,
                                      on_background=self._background, groups=self.groups,
                                      model_runner=model_runner)
        self.requests: dict[str, Any] = {}  # every request ever added, by id
        self._queue: deque = deque()  # async: (scheduler output, runner output)
        self.kv_released = False  # between release_kv_cache and restore_kv_cache
        self.copies_while_released: list[str] = []

    # -- building --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _mamba_accepted(self) -> Iterator[None]:
        """While kv-offload's connectors are built: with a mamba group, the engine check
        that refuses mamba hybrids is replaced (see the module docstring)."""
        import kv_offload.plugin.engine_info as engine_info

        if not self.mamba:
            yield
            return
        with mock.patch.object(engine_info, "refuse_mamba_hybrids", lambda config: None):
            yield

    def _build_scheduler(self) -> Any:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        cls = AsyncScheduler if self.async_scheduling else Scheduler
        with self._mamba_accepted():
            return cls(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                       structured_output_manager=StructuredOutputManager(self.vllm_config),
                       block_size=self.block_size, log_stats=True)

    def _build_worker(self) -> tuple[Any, Any]:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        import kv_offload.plugin.worker_setup as setup
        from kv_offload.plugin.connector import KVOffloadConnector

        built: list[Any] = []
        real_worker = setup.OffloadWorker

        def make_worker(**kwargs: Any) -> Any:
            kwargs["engine"] = _FaultyEngine(kwargs["engine"], self,
                                             synchronous=not self.copy_thread)
            for tier in [t for t in kwargs.get("tiers", ()) if hasattr(t, "slab")]:  # DiskIO
                tier.slab = _FaultySlab(tier.slab, self)
            worker = real_worker(**kwargs, clock=lambda: self.now)
            for pool in ("_io", "_io_writes", "_copier"):  # its pools: deterministic instead
                if not hasattr(worker, pool):
                    raise AttributeError(f"OffloadWorker has no {pool}; update the harness")
                getattr(worker, pool).shutdown(wait=False)
                setattr(worker, pool, self.executor)
            copies = worker._copies
            if copies._thread is not None:  # background store copies: deterministic too
                copies._thread.shutdown(wait=False)
                copies._thread = self.store_executor  # a fence's wait runs the copy
            copies._waiter.shutdown(wait=False)  # waits for copies that run on after store
            copies._waiter = self.store_executor
            built.append(worker)
            return worker

        with self._mamba_accepted():
            conn = KVOffloadConnector(self.vllm_config, KVConnectorRole.WORKER,
                                      self.kv_cache_config)
        tensors: dict[str, Any] = {}  # every group's layers are views of the same tensors
        for group in self.kv_cache_config.kv_cache_groups:
            tensors.update(zip(group.layer_names, self.kv))
        with mock.patch.object(setup, "OffloadWorker", make_worker):
            conn.register_kv_caches(tensors)
        return conn, built[0]

    # -- faults and time -------------------------------------------------------------------

    def draw(self, fault: str) -> bool:
        p = getattr(self.faults, fault)
        return p > 0 and self.rng.random() < p

    def _delay(self, fn: Callable, args: tuple) -> int:
        scripted = self.delay_rule(fn, args) if self.delay_rule is not None else None
        if scripted is not None:
            return scripted
        if self.draw("slow"):
            timeout_steps = int(self.offload.load_timeout_s / STEP_S) + 1
            return timeout_steps + 1 + self.rng.randrange(3)
        return 1 + self.rng.randrange(2) if self.draw("delay") else 0

    def _background(self) -> None:
        self.store_executor.run_due(self.step_index)
        self.executor.run_due(self.step_index)

    def note_copy(self, what: str) -> None:
        """The worker's copy engine starts a copy (any thread)."""
        if self.kv_released:
            self.copies_while_released.append(f"{what} at step {self.step_index}")

    # -- the engine core's view ------------------------------------------------------------

    @property
    def scheduler_side(self) -> Any:
        """kv-offload's OffloadScheduler inside vLLM's scheduler (read-only use: the
        connector has no public accessor)."""
        return self.scheduler.connector._scheduler

    def add(self, req_id: str, prompt: list[int], max_tokens: int, **sampling: Any) -> Any:
        """Add a request (``sampling``: more SamplingParams, e.g. ``prompt_logprobs``)."""
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        request = Request(req_id, list(prompt), params, None,
                          block_hasher=get_request_block_hasher(self.block_size, sha256))
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def abort(self, req_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def release_kv_cache(self) -> None:
        """vLLM takes the KV cache memory away (``unregister_kv_caches``, between steps as
        vLLM 0.33 and 0.34 call it): from its return until ``restore_kv_cache`` every
        engine copy is a problem ``check_idle`` lists."""
        self.worker_connector.unregister_kv_caches()
        self.kv_released = True

    def restore_kv_cache(self) -> None:
        """vLLM gave the KV cache memory back (``restore_kv_caches``)."""
        self.kv_released = False
        self.worker_connector.restore_kv_caches()

    def reset_prefix_cache(self, *, reset_connector: bool = True) -> bool:
        """vLLM's reset (running requests preempted); ``reset_connector`` also drops
        kv-offload's unpinned CPU entries. False, doing nothing, while a request waits
        for its load, holds blocks outside the running queue or has a batch in flight
        (async scheduling): vLLM 0.32 raises then."""
        if len(self.scheduler.kv_holding_waiting) or self._queue or any(
                r.is_finished() for r in self.scheduler.requests.values()):
            return False  # the last: aborted while loading, blocks freed once it ends
        return self.scheduler.reset_prefix_cache(reset_running_requests=True,
                                                 reset_connector=reset_connector)

    def step(self) -> None:
        """One engine-core step: ``EngineCore.step`` or, with async scheduling,
        ``step_with_batch_queue`` (the worker runs each batch as it is scheduled)."""
        self.step_index += 1
        self.now += STEP_S
        sched = self.scheduler
        if not self.async_scheduling:
            if sched.has_requests():
                output = sched.schedule()
                sched.update_from_output(output, self.runner.execute(output))
            return
        if sched.has_requests():
            output = sched.schedule()
            self._queue.appendleft((output, self.runner.execute(output)))
            if len(self._queue) < 2 and (output.total_num_scheduled_tokens > 0
                                         or sched.has_requests()):
                return
        elif not self._queue:
            return
        output, runner_output = self._queue.pop()
        sched.update_from_output(output, runner_output)

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self._queue
                    or self.executor.num_pending() or self.worker.has_pending_jobs())

    def run(self, max_steps: int = 2000) -> int:
        """Step until idle; returns the steps taken (the caller checks ``busy()``)."""
        for taken in range(max_steps):
            if not self.busy():
                return taken
            self.step()
        return max_steps

    # -- invariants ------------------------------------------------------------------------

    def check_idle(self) -> list[str]:
        """What an idle engine must not hold (empty when all is well)."""
        problems = self._vllm_problems() + self._offload_problems()
        if not problems:
            problems += self._content_problems()
        return problems

    def _vllm_problems(self) -> list[str]:
        sched, out = self.scheduler, []
        left = {rid: r.status.name for rid, r in sched.requests.items()}
        if left:
            out.append(f"requests left in vLLM's scheduler: {left}")
        for name, collection in vllm_compat.scheduler_request_collections(sched).items():
            if len(collection):
                out.append(f"vLLM's scheduler.{name} is not empty")
        pool = sched.kv_cache_manager.block_pool
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            out.append(f"vLLM's block pool: {pool.get_num_free_blocks()} free blocks of "
                       f"{pool.num_gpu_blocks - 1}")
        return out

    def _offload_problems(self) -> list[str]:
        planner, out = self.scheduler_side, []
        counts = planner.cpu.counts()
        for what in ("pinned", "storing", "staging", "discarded"):
            if counts.get(what):
                out.append(f"CPU tier: {counts[what]} {what} entries ({counts})")
        if planner.has_pending_work():
            out.append(f"scheduler side: {planner.num_pending_jobs()} jobs pending")
        if (index := getattr(planner.tier("disk"), "index", None)) is not None:
            stats = index.stats()
            if stats["pinned"] or stats["reserved"]:
                out.append(f"disk index: {stats['pinned']} pins, {stats['reserved']} reserved")
        if (self.worker.has_pending_jobs() or self.executor.num_pending()
                or self.store_executor.num_pending()):
            out.append("worker side: jobs or background tasks pending")
        if self.copies_while_released:
            out.append(f"engine copies while vLLM had released the KV cache: "
                       f"{self.copies_while_released}")
        if getattr(planner.counters, "hook_errors", 0):
            out.append(f"{planner.counters.hook_errors} exceptions caught in connector hooks")
        return out

    def _content_problems(self) -> list[str]:
        """Load every CPU and disk slot into scratch engine blocks (all free now) and
        compare with the KV of its key's tokens."""
        chunks = self._chunks_by_key()
        planner, out = self.scheduler_side, []
        for key, (end, hashes) in chunks.items():
            hit = planner.cpu.hit(key)
            if hit is not None and not self._slot_holds(hit.slot, hashes, end):
                out.append(f"CPU slot {hit.slot} does not hold the KV of its key")
        out += self._tail_problems(chunks)
        disk = planner.tier("disk")
        if disk is None or not disk.enabled or self.offload.disk_path is None:
            return out
        from kv_offload.disk import iter_entries

        scratch = 0  # a CPU slot to read disk slots into, restored afterwards
        view = self.worker.host.slot_view(scratch)
        saved = bytes(view)
        for entry, _ in iter_entries(self.offload.disk_path, self.scheduler.connector.namespace):
            tail = disk.index.tail_of(entry.key) if entry.key not in chunks else None
            expected: tuple | None = (chunks.get(entry.key) if tail is None else
                                      self._tail_hashes(tail[0], tail[1], chunks))
            if expected is None:
                out.append(f"disk slot {entry.slot} holds an unknown key")
                continue
            ok = self.worker.tiers["disk"].slab.unfaulty.read(entry.slot, view, entry.checksums[0])
            if not ok or not self._slot_holds(scratch, *(expected if tail else expected[::-1])):
                out.append(f"disk slot {entry.slot} does not hold the KV of its key")
        view[:] = saved
        return out

    def _tail_problems(self, chunks: dict[bytes, tuple[int, list[int]]]) -> list[str]:
        """Every loadable request tail (scheduler/tails.py) holds the KV of its tokens."""
        planner, out = self.scheduler_side, list[str]()
        for parent, key, tokens in planner.tails.entries() if planner.tails else ():
            if (hit := planner.cpu.hit(key)) is None:
                continue
            if (expected := self._tail_hashes(parent, tokens, chunks)) is None:
                out.append(f"CPU slot {hit.slot} holds a tail no request has")
            elif not self._slot_holds(hit.slot, *expected):
                out.append(f"CPU slot {hit.slot} does not hold the KV of its tail")
        return out

    def _tail_hashes(self, parent: bytes, tokens: tuple[int, ...],
                     chunks: dict[bytes, tuple[int, list[int]]]
                     ) -> tuple[list[int], int, int] | None:
        """(prefix hashes, tail start, end) of a request with ``parent``, then ``tokens``."""
        from kv_offload.scheduler.tails import tail_seed

        for request in self.requests.values():
            keys = chunk_keys(request.block_hashes, tokens_per_hash=self.block_size,
                              chunk_tokens=self.chunk_tokens)
            if parent in keys:
                start = (keys.index(parent) + 1) * self.chunk_tokens
            elif tail_seed(request) == parent:
                start = 0
            else:
                continue
            all_tokens = list(request.all_token_ids)
            if tuple(all_tokens[start:start + len(tokens)]) == tokens:
                return prefix_hashes(all_tokens, []), start, start + len(tokens)
        return None

    def _chunks_by_key(self) -> dict[bytes, tuple[int, list[int]]]:
        """Chunk key -> (chunk end, prefix hashes of the tokens), over every request."""
        chunks: dict[bytes, tuple[int, list[int]]] = {}
        for request in self.requests.values():
            tokens = list(request.all_token_ids)
            keys = chunk_keys(request.block_hashes, tokens_per_hash=self.block_size,
                              chunk_tokens=self.chunk_tokens)
            hashes = prefix_hashes(tokens, [])
            for i, key in enumerate(keys):
                chunks[key] = ((i + 1) * self.chunk_tokens, hashes)
        return chunks

    def _slot_holds(self, slot: int, hashes: list[int], end: int,
                    tail_end: int | None = None) -> bool:
        """Whether host slot ``slot`` holds, for every group, the KV of the blocks of the
        chunk ending at ``end`` that it stores (a sliding-window group: the tail). With
        ``tail_end``, ``end`` is a request tail's start and the slot holds the KV of the
        tokens up to ``tail_end`` (one group; what follows in its last block is not
        compared: a load never reports it)."""
        if tail_end is not None:
            return self._tail_holds(slot, hashes, end, tail_end)
        chunk_map = self.worker_connector.layout.chunk_map
        scratch = np.arange(1, 1 + chunk_map.positions, dtype=np.int64)
        saved = [layer[scratch].clone() for layer in self.kv]  # free blocks stay cached
        engine = self.worker.engine.unfaulty
        engine.wait(engine.load(np.array([slot], dtype=np.int64), scratch[None, :]))
        try:
            first = 0
            for group, kv_group in zip(self.groups, chunk_map.groups):
                stored = kv_group.stored_blocks(self.chunk_tokens)
                blocks = scratch[first:first + stored]
                first += stored
                start = end - stored * self.block_size
                for tensor, layer_index in zip(self.kv, group.layers):
                    if group.mamba:  # the state after ``end``, in the page's first row
                        rows = tensor.numpy()[blocks, 0, 0, :]
                        expected = kv_rows(hashes[end - 1:end], layer_index)
                    else:
                        rows = tensor.numpy()[blocks].reshape(stored * self.block_size, -1)
                        expected = kv_rows(hashes[start:end], layer_index)
                    if not np.array_equal(rows, expected):
                        return False
            return True
        finally:
            for layer, old in zip(self.kv, saved):
                layer[scratch] = old

    def _tail_holds(self, slot: int, hashes: list[int], start: int, end: int) -> bool:
        num = -(-(end - start) // self.block_size)
        scratch = np.full(self.worker_connector.layout.chunk_map.positions, -1, dtype=np.int64)
        scratch[:num] = np.arange(1, 1 + num)
        saved = [layer[1:1 + num].clone() for layer in self.kv]
        engine = self.worker.engine.unfaulty
        engine.wait(engine.load(np.array([slot], dtype=np.int64), scratch[None, :]))
        try:
            for tensor, layer_index in zip(self.kv, self.groups[0].layers):
                rows = tensor.numpy()[1:1 + num].reshape(num * self.block_size, -1)
                if not np.array_equal(rows[:end - start], kv_rows(hashes[start:end],
                                                                  layer_index)):
                    return False
            return True
        finally:
            for layer, old in zip(self.kv, saved):
                layer[1:1 + num] = old

    def close(self) -> None:
        self.worker_connector.shutdown()
        self.scheduler.shutdown()


def build_vllm_config(offload: OffloadConfig, *, block_size: int, max_num_batched_tokens: int,
                      max_num_seqs: int) -> Any:
    """A VllmConfig for kv-offload over the tiny test model (no engine is started)."""
    from vllm.engine.arg_utils import EngineArgs

    from kv_offload.testing.tiny_model import make_tiny_model

    args = EngineArgs(model=str(make_tiny_model()), block_size=block_size, max_model_len=512,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                      enable_prefix_caching=True, dtype="float32", enforce_eager=True,
                      kv_transfer_config=offload.to_kv_transfer_config())
    config = vllm_compat.create_engine_config(args)
    config.cache_config.kv_cache_layout = "LBHNC"  # resolved by the engine before connectors
    return config


def build_kv_cache_config(num_blocks: int, block_size: int, windows: tuple[int, ...] = (),
                          *, mamba: bool = False) -> Any:
    """One full-attention group of NUM_LAYERS layers, one KV head of size 4; then a
    sliding-window group of NUM_LAYERS layers for each of ``windows``; then, with
    ``mamba``, a mamba group of NUM_LAYERS layers in "align" mode, its state (ROW floats)
    padded to the attention page as vLLM pads it (``mamba_page_size_padded``)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=4,
                             dtype=torch.float32)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)],
                               full)]
    for g, window in enumerate(windows, start=1):
        names = [f"model.layers.{i}.self_attn.attn"
                 for i in range(g * NUM_LAYERS, (g + 1) * NUM_LAYERS)]
        groups.append(KVCacheGroupSpec(names, SlidingWindowSpec(
            block_size=block_size, num_kv_heads=1, head_size=4, dtype=torch.float32,
            sliding_window=window)))
    if mamba:
        first = len(groups) * NUM_LAYERS
        names = [f"model.layers.{i}.mixer" for i in range(first, first + NUM_LAYERS)]
        groups.append(KVCacheGroupSpec(names, MambaSpec(
            block_size=block_size, shapes=((ROW,),), dtypes=(torch.float32,),
            page_size_padded=full.page_size_bytes, mamba_cache_mode="align")))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
