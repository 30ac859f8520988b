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

Scripted tests drive the same loop step by step instead (the reliability tests' ``Rig``
is a configuration of it): ``admit`` a ``FakeRequest`` (lookup, blocks, ``plan_load``),
``run_step`` with the tokens they schedule (vLLM's synchronous order, no forward: the
bytes in the blocks are the KV, random with ``random_kv``), then ``drain``. A disk tier
(``disk_index`` and ``slab``) is wired as the connector wires it, through the tier
contract (``kv_offload.testing.tiers``), in either mode.

Needs torch and numpy only (no vLLM, no lmdb): ``kv_offload.testing.gpu_check``
(``benchmarks/gpu_check.sh``) runs it on a GPU machine as it is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
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
from kv_offload.testing.requests import FakeRequest
from kv_offload.testing.tiers import secondary_tiers, tier_ios
from kv_offload.worker.audit import build_audit
from kv_offload.worker.runner import OffloadWorker, PollResult

RUNNERS = ("v1", "v2")
EAGER_FORWARD = SimpleNamespace(attn_metadata={}, cudagraph_runtime_mode=None,
                                ubatch_slices=None)  # a forward whose layers each wait


@dataclass(frozen=True, slots=True)
class KVShape:
    """The fake model's KV cache: per layer a float32 tensor of ``(num_blocks, heads,
    block_size, content)`` (one plane); a chunk is ``blocks_per_chunk`` blocks."""

    block_size: int = 16  # tokens per block (and per hash)
    blocks_per_chunk: int = 2
    layers: int = 4
    heads: int = 2
    content: int = 128  # float32 values per head and token

    @property
    def chunk_tokens(self) -> int:
        return self.block_size * self.blocks_per_chunk

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk in a host slot (every layer's blocks)."""
        return self.layers * self.blocks_per_chunk * self.heads * self.block_size * self.content * 4


@dataclass(eq=False)
class _Sequence:
    """A request as the loop's engine keeps it: its blocks and how far it got."""

    request: FakeRequest
    max_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    loaded: int = 0  # tokens loaded by kv-offload, checked by the next forward
    waiting_load: bool = False


def kv_values(tokens: list[int]) -> np.ndarray:
    """The KV value of each position: a function of the token prefix up to it."""
    out, h = np.empty(len(tokens), dtype=np.float32), 17
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + t + 1) % 65_521
        out[i] = float(h)
    return out


class StepLoop:
    """One engine's worth of state; see the module docstring.

    ``shape``: the KV cache's geometry. ``disk_index`` and ``slab`` (a ``SlabFile`` or a
    fake with ``read``/``write``/``close``): a disk tier, both or neither; the caller
    closes the index. ``random_kv``: the KV starts random (scripted tests compare the
    bytes moved; the random workload's checks hold either way). Block 0 stays unused, as
    vLLM's null block; freed blocks go back LIFO."""

    def __init__(self, device: str, *, shape: KVShape = KVShape(), num_blocks: int = 48,
                 cpu_slots: int = 24, seed: int = 0, background_stores: bool = False,
                 slow_forward_cycles: int = 0, runner: str = "v1", zero_new_blocks: bool = False,
                 audit_rate: float = 0.0, copy_mode: str = "auto", same_step: bool = False,
                 disk_index: Any = None, slab: Any = None, io_threads: int = 4,
                 load_timeout_s: float = 60.0, random_kv: bool = False) -> None:
        if runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
        if (disk_index is None) != (slab is None):
            raise ValueError("a disk tier needs both disk_index and slab")
        self.device, self.rng, self.shape = torch.device(device), random.Random(seed), shape
        self.num_blocks, self.slow = num_blocks, slow_forward_cycles
        self.runner, self.zero_new_blocks, self.same_step = runner, zero_new_blocks, same_step
        gen = torch.Generator().manual_seed(seed)
        size = (num_blocks, shape.heads, shape.block_size, shape.content)
        self.kv = [(torch.rand(size, generator=gen) if random_kv else torch.zeros(size))
                   .to(self.device) for _ in range(shape.layers)]
        planes = [p for t in self.kv for p in planes_from_kv_tensor(t, num_blocks, block_dim=0)]
        slot_bytes = shape.slot_bytes
        self.host = allocate_host_slots(cpu_slots, slot_bytes, pinned=self.device.type == "cuda")
        self.engine = make_copy_engine(planes, self.host, shape.blocks_per_chunk,
                                       copy_mode=copy_mode)
        audit = build_audit(planes, self.host, shape.blocks_per_chunk, engine=self.engine,
                            rate=audit_rate)
        self.worker = OffloadWorker(rank=0, engine=self.engine, host=self.host,
                                    tiers=tier_ios(slab, slot_bytes=slot_bytes),
                                    io_threads=io_threads, background_stores=background_stores,
                                    load_timeout_s=load_timeout_s, audit=audit)
        self.worker.layer_waits.layers = PlaneLayers.from_counts(
            [f"layer{i}" for i in range(shape.layers)], [len(planes) // shape.layers] * shape.layers)
        config = PlannerConfig(chunk_tokens=shape.chunk_tokens, block_size=shape.block_size,
                               tokens_per_hash=shape.block_size, num_ranks=1,
                               num_cpu_slots=cpu_slots,
                               same_step_budget_s=1.0 if same_step else 0.0,
                               chunk_bytes=slot_bytes, partial_hits=same_step)
        self.sched = OffloadScheduler(config, tiers=secondary_tiers(disk_index),
                                      block_ids_of=lambda rid: self.requests[rid].blocks)
        self.free = list(range(1, num_blocks))  # block 0 stays unused, as vLLM's null block
        self.requests: dict[str, _Sequence] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.held: set[str] = set()
        self.loads_finished: set[str] = set()  # every request whose load the worker ended
        self.failed_blocks: set[int] = set()  # every block a load failed to fill
        self.mismatches = torch.zeros((), dtype=torch.int64, device=self.device)
        self.counts = {"steps": 0, "requests": 0, "tokens_loaded": 0, "chunks_stored": 0,
                       "held": 0, "preempted": 0, "fenced": 0, "blocks_zeroed": 0,
                       "same_step_loads": 0, "hits_inside_a_block": 0}
        self.stats: dict[str, float] = {}  # the worker's counters (the audit's among them)
        self._outputs: tuple[PollResult, WorkerReport | None, list[str]] | None = None
        self._new_blocks: list[int] = []  # allocated this step (V2 zeroes them first)
        self.draining = False  # no new requests, no preemptions: step until idle
        self._prefixes = [[self.rng.randrange(1, 30_000) for _ in range(shape.block_size * 6)]
                          for _ in range(5)]

    # -- scripted tests ----------------------------------------------------------------------

    def admit(self, request: FakeRequest) -> int:
        """vLLM schedules ``request`` with no local hit: lookup, allocate its blocks, plan
        its load. Returns the external hit tokens. RuntimeError when out of blocks."""
        seq = _Sequence(request)
        if self._blocks_needed(seq) > len(self.free):
            raise RuntimeError("the step loop ran out of blocks")
        self.requests[request.request_id] = seq
        return self._allocate_and_plan(seq)

    def block_ids(self, request_id: str) -> list[int]:
        """The engine blocks of ``request_id`` (empty once freed)."""
        return self.requests[request_id].blocks

    def run_step(self, scheduled: Sequence[tuple[str, int]] = (),
                 preempted: Sequence[str] = ()) -> None:
        """One engine step of a scripted test, in vLLM's synchronous order without a
        forward: plan (``scheduled``: request id, tokens), fence, hold, loads, stores,
        poll; the outputs are applied at once (``loads_finished``, ``failed_blocks``)."""
        plan = self.sched.plan_step(list(scheduled), list(preempted))
        self.worker.fence(plan.preempted)  # what the connector's handle_preemptions does
        self.worker.hold(plan.held)
        self.worker.start_loads(plan.loads)
        self.worker.run_stores(plan.stores)
        self.counts["chunks_stored"] += sum(len(j.chunks) for j in plan.stores)
        self._keep_outputs(*self._poll(), [])
        self._apply_outputs()
        self.counts["steps"] += 1

    # -- the scheduler's side --------------------------------------------------------------

    def add_request(self) -> None:
        n, block = len(self.requests), self.shape.block_size
        prefix = self._prefixes[n % len(self._prefixes)]
        cut = self.rng.choice((block * 2, block * 4, block * 6))
        tail = [self.rng.randrange(1, 30_000) for _ in range(self.rng.randrange(3, 70))]
        prompt = prefix[:cut] + tail
        if self.same_step and n % 3 == 2:  # a prompt again, its last 0-4 tokens changed:
            again = self.requests[f"r{self.rng.randrange(n)}"].request  # a hit inside a block
            prompt = again.tokens[:again.num_prompt_tokens]
            changed = self.rng.randrange(5)
            prompt = prompt[:len(prompt) - changed] + [30_001 + i for i in range(changed)]
        req = FakeRequest(f"r{n}", prompt, block_size=block)
        self.requests[req.request_id] = _Sequence(req, max_tokens=self.rng.randrange(1, 12))
        self.waiting.append(req.request_id)
        self.counts["requests"] += 1

    def _blocks_needed(self, seq: _Sequence) -> int:
        return -(-(seq.request.num_tokens + seq.max_tokens) // self.shape.block_size)

    def _allocate_and_plan(self, seq: _Sequence) -> int:
        """Look ``seq`` up, give it blocks, plan its load; returns the hit tokens."""
        rid = seq.request.request_id
        hit = self.sched.num_matched_tokens(seq.request, 0) or 0
        seq.blocks = [self.free.pop() for _ in range(self._blocks_needed(seq))]
        self.sched.plan_load(seq.request, seq.blocks, hit)
        self._new_blocks.extend(seq.blocks)
        seq.computed = seq.loaded = hit
        self.counts["hits_inside_a_block"] += hit % self.shape.block_size != 0
        seq.waiting_load = hit > 0 and self.sched.load_is_async(rid)
        return hit

    def _admit(self, scheduled: list[tuple[str, int]]) -> None:
        for rid in list(self.waiting):
            seq = self.requests[rid]
            if self._blocks_needed(seq) > len(self.free):
                break
            self._allocate_and_plan(seq)
            self.waiting.remove(rid)
            self.running.append(rid)
            if not seq.waiting_load:  # a miss, or a same-step hit
                scheduled.append((rid, seq.request.num_tokens))

    def _preempt_one(self) -> list[str]:
        ready = [r for r in self.running if not self.requests[r].waiting_load]
        if not ready or self.draining or self.rng.random() > 0.08:
            return []
        rid = self.rng.choice(ready)
        seq = self.requests[rid]
        self.running.remove(rid)
        self.free.extend(reversed(seq.blocks))  # freed now: this step may reuse them
        seq.blocks, seq.computed, seq.loaded = [], 0, 0
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
        self.loads_finished |= result.finished_req_ids
        self.failed_blocks |= result.failed_block_ids
        for rid in result.finished_req_ids:  # loads done
            seq = self.requests[rid]
            seq.waiting_load = False
            if any(b in result.failed_block_ids for b in seq.blocks):
                seq.computed = seq.loaded = 0
        for rid in result.finished_sending:
            self._free_blocks(rid)
        self.sched.blocks_released(result.finished_sending)

    def _free_blocks(self, rid: str) -> None:
        self.held.discard(rid)
        self.free.extend(reversed(self.requests[rid].blocks))
        self.requests[rid].blocks = []

    # -- one step --------------------------------------------------------------------------

    def step(self) -> None:
        """One step of the random workload (see the module docstring)."""
        if not self.draining and self.rng.random() < 0.5:
            self.add_request()
        preempted = self._preempt_one()
        if self.same_step:  # synchronous scheduling: last step's outputs first
            self._apply_outputs()
        scheduled: list[tuple[str, int]] = []
        for rid in self.running:  # a decode step (one more token) or the rest of its prompt
            seq = self.requests[rid]
            if not seq.waiting_load:
                scheduled.append((rid, seq.request.num_tokens))
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
        result, report = self._poll()
        if self.runner == "v1":  # sampling comes last on V1
            finished = self._sample(scheduled)
        self._keep_outputs(result, report, finished)
        self.counts["steps"] += 1

    def _poll(self) -> tuple[PollResult, WorkerReport | None]:
        """Poll the worker; take its report and add up its counters."""
        result, report = self.worker.poll(), self.worker.take_report()
        for name, value in self.worker.take_stats().items():
            self.stats[name] = self.stats.get(name, 0) + value
        return result, report

    def _keep_outputs(self, result: PollResult, report: WorkerReport | None,
                      finished: list[str]) -> None:
        """This step's outputs, applied by ``_apply_outputs`` (next step, or at once)."""
        news = (result.finished_req_ids or result.finished_sending or result.failed_block_ids
                or report or finished)
        self._outputs = (result, report, finished) if news else None

    def _forward(self, scheduled: list[tuple[str, int]]) -> None:
        """Check loaded KV, write the KV of the scheduled tokens (on the current stream)."""
        if self.slow and self.device.type == "cuda" and not self.same_step:
            torch.cuda._sleep(self.slow)  # the GPU lags behind the host, as in real runs
        for rid, _ in scheduled:
            seq = self.requests[rid]
            if seq.loaded:
                self._check(seq, 0, seq.loaded)
                self.counts["tokens_loaded"] += seq.loaded
                seq.loaded = 0
            self._write(seq, seq.computed, seq.request.num_tokens)
            seq.computed = seq.request.num_tokens

    def _forward_by_layer(self, scheduled: list[tuple[str, int]]) -> None:
        """vLLM's order in each attention layer: the new tokens' KV is written, the layer
        waits for its load (``wait_for_layer_load``), attention reads every token's KV
        (checked). A hit that ends inside a block shares it with the new tokens."""
        seqs = [self.requests[rid] for rid, _ in scheduled]
        spans = [(seq, self._positions(seq, 0, seq.request.num_tokens)) for seq in seqs]
        for layer, t in enumerate(self.kv):
            for seq, (blocks, offsets, values) in spans:
                new = slice(seq.computed, seq.request.num_tokens)
                t[blocks[new], :, offsets[new], :] = (values[new] + layer)[:, None, None]
            self.worker.layer_waits.wait(f"layer{layer}")
            for _, (blocks, offsets, values) in spans:
                want = (values + layer)[:, None, None]
                self.mismatches += (t[blocks, :, offsets, :] != want).sum()
        for seq in seqs:
            self.counts["tokens_loaded"] += seq.loaded
            seq.loaded, seq.computed = 0, seq.request.num_tokens

    def _sample(self, scheduled: list[tuple[str, int]]) -> list[str]:
        """One token per scheduled request (host only: no KV is written). Returns the
        requests that finished."""
        finished = []
        for rid, _ in scheduled:
            seq = self.requests[rid]
            req = seq.request
            h = int(kv_values(req.tokens)[-1])
            req.append(1 + (h * 7919) % 29_999)
            if req.num_tokens - req.num_prompt_tokens >= seq.max_tokens:
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

    def _positions(self, seq: _Sequence, start: int, end: int) -> tuple[torch.Tensor, ...]:
        pos, block = np.arange(start, end), self.shape.block_size
        blocks = np.array([seq.blocks[p // block] for p in pos], dtype=np.int64)
        return (self._to_device(blocks), self._to_device(pos % block),
                self._to_device(kv_values(seq.request.tokens)[start:end]))

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """``array`` on the device without a host wait: a copy from pageable memory
        synchronises the stream, which kept the GPU from running behind the host."""
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _write(self, seq: _Sequence, start: int, end: int) -> None:
        blocks, offsets, values = self._positions(seq, start, end)
        for layer, t in enumerate(self.kv):
            t[blocks, :, offsets, :] = (values + layer)[:, None, None]

    def _check(self, seq: _Sequence, start: int, end: int) -> None:
        blocks, offsets, values = self._positions(seq, start, end)
        for layer, t in enumerate(self.kv):
            self.worker.layer_waits.wait(f"layer{layer}")  # wait_for_layer_load
            want = (values + layer)[:, None, None]
            self.mismatches += (t[blocks, :, offsets, :] != want).sum()

    # -- the end ---------------------------------------------------------------------------

    def drain(self, timeout_s: float = 60.0) -> None:
        """Finish everything: no new requests, step until neither side has work left.
        RuntimeError after ``timeout_s`` (which bounds a hang only)."""
        deadline = time.monotonic() + timeout_s
        while (self.waiting or self.running or self.held or self._outputs
               or self.sched.has_pending_work() or self.worker.has_pending_jobs()):
            if time.monotonic() > deadline:
                raise RuntimeError("the step loop did not drain")
            self.draining = True
            self.step()
            time.sleep(0.001)

    def stored_mismatches(self) -> int:
        """Chunks in the CPU tier whose host slot does not hold the KV of their key (the
        fake model's KV: not meaningful for chunks a scripted test stored raw)."""
        s = self.shape
        bad, chunk = 0, s.chunk_tokens
        for seq in self.requests.values():
            keys = chunk_keys(seq.request.block_hashes, tokens_per_hash=s.block_size,
                              chunk_tokens=chunk)
            values = kv_values(seq.request.tokens)
            for c, hit in enumerate(self.sched.cpu.hits(keys)):
                if hit is None:
                    continue
                slot = self.host.as_tensor()[hit.slot].view(torch.float32).reshape(
                    s.layers, s.blocks_per_chunk, s.heads, s.block_size, s.content)
                want = torch.from_numpy(values[c * chunk:(c + 1) * chunk]).reshape(
                    s.blocks_per_chunk, 1, s.block_size, 1)
                bad += sum(not torch.equal(slot[layer], (want + layer).expand_as(slot[layer]))
                           for layer in range(s.layers))
        return bad

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the worker (its queued tier writes bounded by ``timeout_s``)."""
        self.worker.close(timeout_s=timeout_s)


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
