"""Helpers of the reliability tests: prompt sets, the reference tokens, mounts, idle checks,
and a scheduler + worker rig without an engine.

Engine tests drive ``kv_offload.testing.engine.EngineProcess`` (phases: engine_phases.py).
One no-connector reference engine (``Reference``, a session fixture in conftest.py)
computes the tokens of every prompt in ``PROMPTS``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kv_offload.testing.engine import EngineProcess
from kv_offload.testing.requests import FakeRequest
from kv_offload.testing.step_loop import KVShape, StepLoop
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
NUM_BLOCKS = 1024
# Two layers (planes) of 128 bytes per block: 4 tokens x 8 float32 values.
RIG_SHAPE = KVShape(block_size=BLOCK, blocks_per_chunk=RIG_CHUNK // BLOCK, layers=2, heads=1,
                    content=8)
SLOT_BYTES = RIG_SHAPE.slot_bytes  # 512
NS = "0e11ab1e"


def rig_request(request_id: str, tokens: list[int]) -> FakeRequest:
    """A request of ``tokens`` hashed at the rig's block size."""
    return FakeRequest(request_id, tokens, block_size=BLOCK)


class Rig(StepLoop):
    """The step loop (``kv_offload.testing.step_loop``) as these tests drive it: scripted
    (``admit``, ``run_step``, ``drain``), on the CPU with the torch copy engine over random
    KV, and a disk tier where ``disk_index`` and ``slab`` are given (``slab``: a SlabFile or
    a fake with ``read``/``write``/``close``). Adds the idle check."""

    def __init__(self, *, disk_index=None, slab=None, num_cpu_slots: int = 16,
                 load_timeout_s: float = 30.0) -> None:
        super().__init__("cpu", shape=RIG_SHAPE, num_blocks=NUM_BLOCKS, cpu_slots=num_cpu_slots,
                         disk_index=disk_index, slab=slab, io_threads=2,
                         load_timeout_s=load_timeout_s, random_kv=True)

    def idle_problems(self) -> list[str]:
        """Like idle_problems() for an engine's connector state."""
        disk = getattr(self.sched.tier("disk"), "index", None)
        return idle_problems({
            "cpu": self.sched.cpu.counts(), "pending_jobs": self.sched.num_pending_jobs(),
            "pending_work": self.sched.has_pending_work(),
            "worker_pending_jobs": self.worker.has_pending_jobs(),
            "disk": disk.stats() if disk is not None else None})


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
