"""A step loop in vLLM's order of calls, without vLLM: kv-offload's worker and copy engine
under async scheduling, on CUDA (the CuPy engine) or on the CPU (the torch engine).

Each step: admit requests (their prompts share prefixes, so loads hit chunks stored by
earlier requests), plan (``OffloadScheduler.plan_step``), apply the *previous* step's
outputs (async scheduling: vLLM schedules step N+1 before it sees step N's), then the
worker in one model runner's order (``runner``):

- ``"v1"`` (``gpu_model_runner.py``): ``fence`` preempted requests (handle_preemptions),
  ``hold`` finished ones, the forward, ``start_loads`` (before the forward every other
  step, as vLLM before 0.32 did), ``run_stores`` (wait_for_save), ``poll``, sampling;
- ``"v2"`` (``gpu/model_runner.py``, vLLM 0.32's default on CUDA): ``update_requests``
  first (with ``zero_new_blocks``, it zeroes the blocks allocated this step, as vLLM
  does for caches that need it: mamba layers, mixed precisions), then ``pre_forward``'s
  ``fence`` and ``hold``, the forward, ``run_stores`` (finish_forward, where the
  connector issues V2's stores), sampling, then ``post_forward``: ``start_loads``,
  ``poll``.

``same_step=True`` runs vLLM's synchronous scheduling with same-step loads (issue 29) and
hits to the last cached token (request tails): CPU-tier hits run in the step that
schedules them, their loads start before the forward on both runners, and the forward
goes layer by layer as vLLM's does: the new tokens' KV written, the layer's wait
(``LayerWaits.wait``, as ``wait_for_layer_load``), every token's KV read and checked. The
GPU's lag is queued before the loads start, so a layer read before its copy, or new KV
overwritten by a copy of the block it shares with a hit, reads wrong bytes.

The forward (kernels on the compute stream) writes every scheduled token's KV and checks
the KV of every loaded token. Freed blocks go back LIFO, so the next request reuses them
at once; requests are preempted now and then. KV is a function of the token prefix, so
every byte is checked: loaded blocks on the device as the forward reads them, stored
chunks in the host slots at the end. ``audit_rate`` turns the runtime audit on
(``worker/audit.py``). ``run_step_loop`` returns counts; ``mismatches`` must be 0.

Needs torch and numpy only (no vLLM, no lmdb): ``kv_offload.testing.gpu_check``
(``benchmarks/gpu_check.sh``) runs it on a GPU machine as it is.
"""

from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kv_offload.copy import make_copy_engine, planes_from_kv_tensor
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.copy.layers import PlaneLayers
from kv_offload.jobs import WorkerReport
from kv_offload.keys import chunk_keys
from kv_offload.scheduler import OffloadScheduler, PlannerConfig
from kv_offload.worker.audit import build_audit
from kv_offload.worker.runner import OffloadWorker, PollResult

BLOCK, BLOCKS_PER_CHUNK, LAYERS, HEADS, CONTENT = 16, 2, 4, 2, 128
RUNNERS = ("v1", "v2")
EAGER_FORWARD = SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=None,
                                ubatch_slices=None)  # a forward whose layers each wait


@dataclass
class _Request:
    request_id: str
    tokens: list[int]
    num_prompt_tokens: int
    max_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    loaded: int = 0  # tokens loaded by kv-offload, checked by the next forward
    waiting_load: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def all_token_ids(self) -> list[int]:  # as vLLM's Request: its tail can be stored
        return self.tokens

    def rehash(self) -> None:
        while len(self.block_hashes) < len(self.tokens) // BLOCK:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else b"root"
            data = parent + np.array(self.tokens[i * BLOCK:(i + 1) * BLOCK]).tobytes()
            self.block_hashes.append(hashlib.sha256(data).digest())


def kv_values(tokens: list[int]) -> np.ndarray:
    """The KV value of each position: a function of the token prefix up to it."""
    out, h = np.empty(len(tokens), dtype=np.float32), 17
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + t + 1) % 65_521
        out[i] = float(h)
    return out


class StepLoop:
    """One engine's worth of state; see the module docstring."""

    def __init__(self, device: str, *, num_blocks: int = 48, cpu_slots: int = 24, seed: int = 0,
                 background_stores: bool = False, slow_forward_cycles: int = 0,
                 runner: str = "v1", zero_new_blocks: bool = False, audit_rate: float = 0.0,
                 copy_mode: str = "auto", same_step: bool = False) -> None:
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        self.device, self.rng = torch.device(device), random.Random(seed)
        self.num_blocks, self.slow = num_blocks, slow_forward_cycles
        self.runner, self.zero_new_blocks, self.same_step = runner, zero_new_blocks, same_step
        self.kv = [torch.zeros((num_blocks, HEADS, BLOCK, CONTENT), dtype=torch.float32,
                               device=self.device) for _ in range(LAYERS)]
        planes = [p for t in self.kv for p in planes_from_kv_tensor(t, num_blocks, block_dim=0)]
        slot_bytes = LAYERS * BLOCKS_PER_CHUNK * HEADS * BLOCK * CONTENT * 4
        self.host = allocate_host_slots(cpu_slots, slot_bytes, pinned=self.device.type == "cuda")
        self.engine = make_copy_engine(planes, self.host, BLOCKS_PER_CHUNK, copy_mode=copy_mode)
        audit = build_audit(planes, self.host, BLOCKS_PER_CHUNK, engine=self.engine,
                            rate=audit_rate)
        self.worker = OffloadWorker(rank=0, engine=self.engine, host=self.host,
                                    background_stores=background_stores, load_timeout_s=60,
                                    audit=audit)
        self.worker.layer_waits.layers = PlaneLayers.from_counts(
            [f"layer{i}" for i in range(LAYERS)], [len(planes) // LAYERS] * LAYERS)
        config = PlannerConfig(chunk_tokens=BLOCK * BLOCKS_PER_CHUNK, block_size=BLOCK,
                               tokens_per_hash=BLOCK, num_ranks=1, num_cpu_slots=cpu_slots,
                               same_step_budget_s=1.0 if same_step else 0.0,
                               chunk_bytes=slot_bytes, partial_hits=same_step)
        self.sched = OffloadScheduler(config, block_ids_of=lambda rid: self.requests[rid].blocks)
        self.free = list(range(1, num_blocks))  # block 0 stays unused, as vLLM's null block
        self.requests: dict[str, _Request] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.held: set[str] = set()
        self.mismatches = torch.zeros((), dtype=torch.int64, device=self.device)
        self.counts = {"steps": 0, "requests": 0, "tokens_loaded": 0, "chunks_stored": 0,
                       "held": 0, "preempted": 0, "fenced": 0, "blocks_zeroed": 0,
                       "same_step_loads": 0, "hits_inside_a_block": 0}
        self.stats: dict[str, float] = {}  # the worker's counters (the audit's among them)
        self._outputs: tuple[PollResult, WorkerReport | None, list[str]] | None = None
        self._new_blocks: list[int] = []  # allocated this step (V2 zeroes them first)
        self.draining = False  # no new requests, no preemptions: step until idle
        self._prefixes = [[self.rng.randrange(1, 30_000) for _ in range(BLOCK * 6)]
                          for _ in range(5)]

    # -- the scheduler's side --------------------------------------------------------------

    def add_request(self) -> None:
        n = len(self.requests)
        prefix = self._prefixes[n % len(self._prefixes)]
        cut = self.rng.choice((BLOCK * 2, BLOCK * 4, BLOCK * 6))
        tail = [self.rng.randrange(1, 30_000) for _ in range(self.rng.randrange(3, 70))]
        prompt = prefix[:cut] + tail
        if self.same_step and n % 3 == 2:  # a prompt again, its last 0-4 tokens changed:
            again = self.requests[f"r{self.rng.randrange(n)}"]  # a hit inside a block
            prompt = again.tokens[:again.num_prompt_tokens]
            changed = self.rng.randrange(5)
            prompt = prompt[:len(prompt) - changed] + [30_001 + i for i in range(changed)]
        req = _Request(f"r{n}", prompt, len(prompt), max_tokens=self.rng.randrange(1, 12))
        req.rehash()
        self.requests[req.request_id] = req
        self.waiting.append(req.request_id)
        self.counts["requests"] += 1

    def _admit(self, scheduled: list[tuple[str, int]]) -> None:
        for rid in list(self.waiting):
            req = self.requests[rid]
            need = -(-(req.num_tokens + req.max_tokens) // BLOCK)
            if need > len(self.free):
                break
            hit = self.sched.num_matched_tokens(req, 0) or 0
            req.blocks = [self.free.pop() for _ in range(need)]
            self.sched.plan_load(req, req.blocks, hit)
            self._new_blocks.extend(req.blocks)
            self.waiting.remove(rid)
            self.running.append(rid)
            req.computed = req.loaded = hit
            self.counts["hits_inside_a_block"] += hit % BLOCK != 0
            req.waiting_load = hit > 0 and self.sched.load_is_async(rid)
            if not req.waiting_load:  # a miss, or a same-step hit
                scheduled.append((rid, req.num_tokens))

    def _preempt_one(self) -> list[str]:
        ready = [r for r in self.running if not self.requests[r].waiting_load]
        if not ready or self.draining or self.rng.random() > 0.08:
            return []
        rid = self.rng.choice(ready)
        req = self.requests[rid]
        self.running.remove(rid)
        self.free.extend(reversed(req.blocks))  # freed now: this step may reuse them
        req.blocks, req.computed, req.loaded = [], 0, 0
        self.waiting.insert(0, rid)
        self.counts["preempted"] += 1
        return [rid]

    def _apply_outputs(self) -> None:
        if self._outputs is None:
            return
        result, report, finished = self._outputs
        self._outputs = None
        for rid in finished:  # vLLM frees finished requests before it reads the reports
            if self.sched.request_finished(rid):
                self.held.add(rid)
                self.counts["held"] += 1
            else:
                self._free_blocks(rid)
        if report is not None:
            self.sched.on_report(report)
        for rid in result.finished_req_ids:  # loads done
            req = self.requests[rid]
            req.waiting_load = False
            failed = {b for b in req.blocks if b in result.failed_block_ids}
            if failed:
                req.computed = req.loaded = 0
        for rid in result.finished_sending:
            self._free_blocks(rid)
        self.sched.blocks_released(result.finished_sending)

    def _free_blocks(self, rid: str) -> None:
        self.held.discard(rid)
        self.free.extend(reversed(self.requests[rid].blocks))
        self.requests[rid].blocks = []

    # -- one step --------------------------------------------------------------------------

    def step(self) -> None:
        if not self.draining and self.rng.random() < 0.5:
            self.add_request()
        preempted = self._preempt_one()
        if self.same_step:  # synchronous scheduling: last step's outputs first
            self._apply_outputs()
        scheduled: list[tuple[str, int]] = []
        for rid in self.running:
            req = self.requests[rid]
            if not req.waiting_load and req.computed >= req.num_prompt_tokens:
                scheduled.append((rid, req.num_tokens))  # a decode step: one more token
            elif not req.waiting_load:
                scheduled.append((rid, req.num_tokens))  # the rest of its prompt
        self._admit(scheduled)
        plan = self.sched.plan_step(scheduled, preempted)
        self._apply_outputs()  # async scheduling: last step's outputs arrive now
        if self.runner == "v2" and self.zero_new_blocks:  # update_requests, before the fence
            self._zero(self._new_blocks)
        self._new_blocks = []
        self.counts["fenced"] += len(plan.preempted)
        self.worker.fence(plan.preempted)
        self.worker.hold(plan.held)
        # V1 in vLLM 0.32 starts asynchronous loads after the forward, older versions
        # before it: every other step each way. V2 starts them in post_forward.
        loads_first = self.runner == "v1" and self.counts["steps"] % 2 == 1
        if self.same_step and any(job.same_step for job in plan.loads):
            loads_first = True  # has_sync_kv_loads: before the forward on both runners
            self.counts["same_step_loads"] += sum(job.same_step for job in plan.loads)
            if self.slow and self.device.type == "cuda":
                torch.cuda._sleep(self.slow)  # the lag is before the copies, not between
            self.worker.layer_waits.expect(EAGER_FORWARD)
        if loads_first:
            self.worker.start_loads(plan.loads)
        (self._forward_by_layer if self.same_step else self._forward)(scheduled)
        finished: list[str] = []
        if self.runner == "v2":  # finish_forward: before sampling and post_forward
            self.worker.run_stores(plan.stores)
            finished = self._sample(scheduled)
        if not loads_first:
            self.worker.start_loads(plan.loads)
        if self.runner == "v1":  # wait_for_save, after the async loads start
            self.worker.run_stores(plan.stores)
        self.counts["chunks_stored"] += sum(len(j.chunks) for j in plan.stores)
        result, report = self.worker.poll(), self.worker.take_report()
        if self.runner == "v1":  # sampling comes last on V1
            finished = self._sample(scheduled)
        for name, value in self.worker.take_stats().items():
            self.stats[name] = self.stats.get(name, 0) + value
        news = (result.finished_req_ids or result.finished_sending or result.failed_block_ids
                or report or finished)
        self._outputs = (result, report, finished) if news else None
        self.counts["steps"] += 1

    def _forward(self, scheduled: list[tuple[str, int]]) -> None:
        """Check loaded KV, write the KV of the scheduled tokens (on the current stream)."""
        if self.slow and self.device.type == "cuda" and not self.same_step:
            torch.cuda._sleep(self.slow)  # the GPU lags behind the host, as in real runs
        for rid, _ in scheduled:
            req = self.requests[rid]
            if req.loaded:
                self._check(req, 0, req.loaded)
                self.counts["tokens_loaded"] += req.loaded
                req.loaded = 0
            self._write(req, req.computed, req.num_tokens)
            req.computed = req.num_tokens

    def _forward_by_layer(self, scheduled: list[tuple[str, int]]) -> None:
        """vLLM's order in each attention layer: the new tokens' KV is written, the layer
        waits for its load (``wait_for_layer_load``), attention reads every token's KV
        (checked). A hit that ends inside a block shares it with the new tokens."""
        spans = [(self.requests[rid], self._positions(self.requests[rid], 0,
                                                      self.requests[rid].num_tokens))
                 for rid, _ in scheduled]
        for layer, t in enumerate(self.kv):
            for req, (blocks, offsets, values) in spans:
                new = slice(req.computed, req.num_tokens)
                t[blocks[new], :, offsets[new], :] = (values[new] + layer)[:, None, None]
            self.worker.layer_waits.wait(f"layer{layer}")
            for _, (blocks, offsets, values) in spans:
                want = (values + layer)[:, None, None]
                self.mismatches += (t[blocks, :, offsets, :] != want).sum()
        for req, _ in spans:
            self.counts["tokens_loaded"] += req.loaded
            req.loaded, req.computed = 0, req.num_tokens

    def _sample(self, scheduled: list[tuple[str, int]]) -> list[str]:
        """One token per scheduled request (host only: no KV is written). Returns the
        requests that finished."""
        finished = []
        for rid, _ in scheduled:
            req = self.requests[rid]
            h = int(kv_values(req.tokens)[-1])
            req.tokens.append(1 + (h * 7919) % 29_999)
            req.rehash()
            if req.num_tokens - req.num_prompt_tokens >= req.max_tokens:
                self.running.remove(rid)
                finished.append(rid)
        return finished

    def _zero(self, blocks: list[int]) -> None:
        """Zero whole blocks on the compute stream (V2's ``update_requests``)."""
        if not blocks:
            return
        index = self._to_device(np.array(blocks, dtype=np.int64))
        for t in self.kv:
            t[index] = 0
        self.counts["blocks_zeroed"] += len(blocks)

    def _positions(self, req: _Request, start: int, end: int) -> tuple[torch.Tensor, ...]:
        pos = np.arange(start, end)
        blocks = np.array([req.blocks[p // BLOCK] for p in pos], dtype=np.int64)
        return (self._to_device(blocks), self._to_device(pos % BLOCK),
                self._to_device(kv_values(req.tokens)[start:end]))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device without a host wait: a copy from pageable memory
        synchronises the stream, which kept the GPU from running behind the host."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _write(self, req: _Request, start: int, end: int) -> None:
        blocks, offsets, values = self._positions(req, start, end)
        for layer, t in enumerate(self.kv):
            t[blocks, :, offsets, :] = (values + layer)[:, None, None]

    def _check(self, req: _Request, start: int, end: int) -> None:
        blocks, offsets, values = self._positions(req, start, end)
        for layer, t in enumerate(self.kv):
            self.worker.layer_waits.wait(f"layer{layer}")  # wait_for_layer_load
            want = (values + layer)[:, None, None]
            self.mismatches += (t[blocks, :, offsets, :] != want).sum()

    # -- the end ---------------------------------------------------------------------------

    def drain(self, max_steps: int = 500) -> None:
        """Finish everything: no new requests, step until idle."""
        for _ in range(max_steps):
            if not (self.waiting or self.running or self.held or self._outputs
                    or self.sched.has_pending_work() or self.worker.has_pending_jobs()):
                return
            self.draining = True
            self.step()
            time.sleep(0.001)
        raise RuntimeError("the step loop did not drain")

    def stored_mismatches(self) -> int:
        """Chunks in the CPU tier whose host slot does not hold the KV of their key."""
        bad, chunk = 0, BLOCK * BLOCKS_PER_CHUNK
        for req in self.requests.values():
            keys = chunk_keys(req.block_hashes, tokens_per_hash=BLOCK, chunk_tokens=chunk)
            values = kv_values(req.tokens)
            for c, hit in enumerate(self.sched.cpu.hits(keys)):
                if hit is None:
                    continue
                slot = self.host.as_tensor()[hit.slot].view(torch.float32).reshape(
                    LAYERS, BLOCKS_PER_CHUNK, HEADS, BLOCK, CONTENT)
                want = torch.from_numpy(values[c * chunk:(c + 1) * chunk]).reshape(
                    BLOCKS_PER_CHUNK, 1, BLOCK, 1)
                bad += sum(not torch.equal(slot[layer], (want + layer).expand_as(slot[layer]))
                           for layer in range(LAYERS))
        return bad

    def close(self) -> None:
        self.worker.close()


def run_step_loop(device: str, *, steps: int = 300, seed: int = 0, **kwargs: Any) -> dict:
    """Run ``steps`` steps, drain, check every byte; returns the counts with
    ``mismatches`` (loaded KV read wrong by a forward) and ``stored_mismatches``."""
    loop = StepLoop(device, seed=seed, **kwargs)
    start = time.perf_counter()
    try:
        for _ in range(steps):
            loop.step()
        loop.drain()
        if loop.device.type == "cuda":
            torch.cuda.synchronize()
        return {**loop.counts, "seconds": round(time.perf_counter() - start, 3),
                "runner": loop.runner, "copy_path": loop.engine.copy_path,
                "audit_chunks": int(loop.stats.get("audit_chunks", 0)),
                "audit_mismatches": int(loop.stats.get("audit_mismatches", 0)),
                "mismatches": int(loop.mismatches), "stored_mismatches": loop.stored_mismatches()}
    finally:
        loop.close()
