"""Helpers of the reliability tests: prompt sets, the reference tokens, mounts, idle checks,
and a scheduler + worker rig without an engine.

Engine tests drive ``kv_offload.testing.engine.EngineProcess`` (phases: engine_phases.py).
One no-connector reference engine (``Reference``, a session fixture in conftest.py)
computes the tokens of every prompt in ``PROMPTS``.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from kv_offload.testing.engine import EngineProcess
from kv_offload.testing.tiers import secondary_tiers, tier_ios
from kv_offload.testing.tiny_model import make_prompt

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAX_TOKENS = 8
CHUNK = 64


def _prompt_sets() -> dict[str, list[str]]:
    convoy_prefix = make_prompt(320, seed=7001)  # 5 chunks of 64 tokens
    return {
        # Stored before the kill; N copies then share one disk load after the restart.
        "seed": [convoy_prefix + make_prompt(20, seed=7099)],
        "convoy": [convoy_prefix + make_prompt(20, seed=7100 + i) for i in range(5)],
        # 1020 tokens: the 5th generated token needs a 33rd block of 32 (preemption).
        "heavy": [make_prompt(1020, seed=7200 + i) for i in range(12)],
        "fresh": [make_prompt(700, seed=7300 + i) for i in range(3)],
        "salted": [make_prompt(700, seed=7400)],
        "fill": [make_prompt(1020, seed=7500 + i) for i in range(4)],
    }


PROMPTS = _prompt_sets()


class Reference:
    """Tokens of ``texts`` recomputed by vLLM without any connector, from an engine that
    runs them as soon as it has started and then quits (so it overlaps other start-ups)."""

    def __init__(self, engine: EngineProcess, texts: list[str]) -> None:
        self._engine, self._texts = engine, texts
        engine.submit({"op": "generate", "prompts": texts, "max_tokens": MAX_TOKENS})
        engine.submit({"op": "quit"})
        self._by_text: dict[str, list[int]] | None = None

    def tokens(self, prompts: list) -> list[list[int]]:
        if self._by_text is None:
            self._by_text = dict(zip(self._texts, self._engine.answer()["tokens"]))
            self._engine.close()
        return [self._by_text[p["prompt"] if isinstance(p, dict) else p] for p in prompts]


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a tmpfs of ``size`` at ``path`` (mode 0700). None on success, else why not."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                           str(path)], capture_output=True, text=True)
    return None if proc.returncode == 0 else f"mount -t tmpfs failed: {proc.stderr.strip()}"


def is_mount_point(path: Path) -> bool:
    """Whether something is mounted at ``path`` (bind mounts included, which
    os.path.ismount misses when they stay on the same device)."""
    target = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1].encode().decode("unicode_escape") == target for line in f)


def unmount(path: Path) -> None:
    """Lazy-unmount everything mounted at ``path`` (idempotent)."""
    for _ in range(8):  # mounts may be stacked
        if not is_mount_point(path):
            return
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def idle_problems(state: dict | None) -> list[str]:
    """Why a connector state (``EngineProcess.snapshot()["connector"]``) is not idle;
    [] when idle."""
    if state is None:
        return ["no connector state (not an in-process engine?)"]
    problems = []
    cpu = state["cpu"]
    for name in ("storing", "staging", "pinned"):
        if cpu[name]:
            problems.append(f"{cpu[name]} CPU entries {name}")
    if state["pending_jobs"] or state["pending_work"]:
        problems.append(f"{state['pending_jobs']} jobs pending on the scheduler side")
    if state["worker_pending_jobs"]:
        problems.append("jobs pending on the worker side")
    disk = state["disk"]
    if disk is not None and (disk["pinned"] or disk["reserved"]):
        problems.append(f"disk index: {disk['pinned']} pinned, {disk['reserved']} reserved")
    return problems


# ---- a scheduler and a worker wired like the connector wires them (no engine) ----------

BLOCK = 4  # tokens per block (and per hash) of the rig
RIG_CHUNK = 8  # tokens per chunk: 2 blocks
NUM_BLOCKS, PLANE_BYTES = 1024, 128
SLOT_BYTES = 2 * PLANE_BYTES * (RIG_CHUNK // BLOCK)  # two planes (layers)
NS = "0e11ab1e"


class FakeRequest:
    """What OffloadScheduler reads of a vLLM request: chained block hashes and lengths."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        import hashlib

        self.request_id = request_id
        self.block_hashes, parent = [], b"root"
        for i in range(len(tokens) // BLOCK):
            parent = hashlib.sha256(parent + bytes(tokens[i * BLOCK:(i + 1) * BLOCK])).digest()
            self.block_hashes.append(parent)
        self.num_tokens = self.num_prompt_tokens = len(tokens)


class Rig:
    """OffloadScheduler + OffloadWorker (torch copy engine over random uint8 planes), driven
    step by step as vLLM drives the connector: lookup, alloc, plan, execute, poll, report.

    ``slab``: a SlabFile, a fake with ``read``/``write``/``close``, or None (no disk tier).
    Block ids are handed out from a simple counter (never reused within a test).
    """

    def __init__(self, *, disk_index=None, slab=None, num_cpu_slots: int = 16,
                 load_timeout_s: float = 30.0) -> None:
        import torch

        from kv_offload.copy import make_copy_engine
        from kv_offload.copy.host_buffer import allocate_host_slots
        from kv_offload.scheduler import OffloadScheduler, PlannerConfig
        from kv_offload.worker import OffloadWorker

        gen = torch.Generator().manual_seed(0)
        self.planes = [torch.randint(0, 256, (NUM_BLOCKS, PLANE_BYTES), dtype=torch.uint8,
                                     generator=gen) for _ in range(2)]
        self.blocks: dict[str, list[int]] = {}
        self._next_block = 0
        config = PlannerConfig(chunk_tokens=RIG_CHUNK, block_size=BLOCK, tokens_per_hash=BLOCK,
                               num_ranks=1, num_cpu_slots=num_cpu_slots)
        self.sched = OffloadScheduler(config, tiers=secondary_tiers(disk_index),
                                      block_ids_of=lambda rid: self.blocks[rid])
        host = allocate_host_slots(num_cpu_slots, SLOT_BYTES, pinned=False)
        self.worker = OffloadWorker(rank=0, engine=make_copy_engine(self.planes, host, 2),
                                    host=host, tiers=tier_ios(slab, slot_bytes=SLOT_BYTES),
                                    io_threads=2,
                                    load_timeout_s=load_timeout_s)
        self.finished: set[str] = set()
        self.failed_blocks: set[int] = set()

    def admit(self, req: FakeRequest) -> int:
        """vLLM schedules ``req`` (no local hit): lookup, allocate blocks, plan the load.
        Returns the external hit tokens."""
        hit = self.sched.num_matched_tokens(req, 0)
        n = -(-req.num_tokens // BLOCK)
        self.blocks[req.request_id] = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        assert self._next_block <= NUM_BLOCKS, "the rig ran out of blocks"
        self.sched.plan_load(req, self.blocks[req.request_id], hit)
        return hit

    def step(self, scheduled: list[tuple[str, int]] = ()) -> None:
        """One engine step: plan, run jobs on the worker, poll, report back."""
        plan = self.sched.plan_step(list(scheduled))
        self.worker.fence(plan.preempted)  # what the connector's handle_preemptions does
        self.worker.hold(plan.held)
        if plan.loads:
            self.worker.start_loads(plan.loads)
        if plan.stores:
            self.worker.run_stores(plan.stores)
        self.poll()

    def poll(self) -> None:
        result = self.worker.poll()
        self.finished |= result.finished_req_ids
        self.failed_blocks |= result.failed_block_ids
        report = self.worker.take_report()
        if report:
            self.sched.on_report(report)
        if result.finished_sending:  # vLLM frees the held blocks
            self.sched.blocks_released(result.finished_sending)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Step until neither side has a job in flight; AssertionError on timeout (which
        bounds a hang only)."""
        deadline = time.monotonic() + timeout_s
        while self.sched.has_pending_work() or self.worker.has_pending_jobs():
            if time.monotonic() > deadline:
                raise AssertionError("jobs still pending: the rig hangs")
            self.step()
            time.sleep(0.005)

    def idle_problems(self) -> list[str]:
        """Like idle_problems() for an engine's connector state."""
        disk = getattr(self.sched.tier("disk"), "index", None)
        return idle_problems({
            "cpu": self.sched.cpu.counts(), "pending_jobs": self.sched.num_pending_jobs(),
            "pending_work": self.sched.has_pending_work(),
            "worker_pending_jobs": self.worker.has_pending_jobs(),
            "disk": disk.stats() if disk is not None else None})

    def close(self) -> None:
        self.worker.close(timeout_s=5)


def rig_tokens(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 251 for i in range(n)]


def open_rig_index(root: Path, *, num_slots: int = 32):
    from kv_offload.disk import DiskIndex

    return DiskIndex.open(root, namespace_id=NS, descriptor={"test": "reliability"},
                          slot_bytes=SLOT_BYTES, num_ranks=1,
                          capacity_bytes=num_slots * SLOT_BYTES)


def open_rig_slab(root: Path):
    from kv_offload.disk import SlabFile

    return SlabFile(root, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES)
