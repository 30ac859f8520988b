"""How much a same-step load issued per layer overlaps the forward (issue 29).

A fake forward of ``layers`` layers, each "attention" a few matmuls on the compute stream
followed by a read of that layer's loaded blocks (an exact byte sum), runs three ways:
without a load (``none``); after a load fenced whole (``whole``: the old same-step path,
``CopyEngine.load`` + ``fence``); and with the load issued per layer
(``CopyEngine.load_by_layer``), each layer waiting for its own event (``fence_mark``)
before its work (``per_layer``: what ``wait_for_layer_load`` does). The loaded blocks are
zeroed before each run, so a layer that read them before its copy ended sums wrong; the
bytes are compared after each run too. ``gpu_check`` runs it on CUDA (the CuPy engine);
on the CPU it runs with the torch engine, whose per-layer load copies on a thread of its
own (compiled copy loop; numpy: whole), a check of the harness and its byte checks more
than a measure (the fake attention's gather dominates there; bench_concurrent measures
the CPU backend's overlap in vLLM).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["OverlapSetup", "layer_overlap", "overlap_summary"]

MODES = ("none", "whole", "per_layer")


@dataclass(frozen=True, slots=True)
class OverlapSetup:
    """The fake model: ``layers`` layers of K and V planes of ``num_blocks`` blocks of
    ``block_bytes`` each; ``chunks`` chunks of ``blocks_per_chunk`` blocks loaded; per
    layer ``matmuls`` products of ``dim`` x ``dim`` matrices."""

    layers: int = 16
    num_blocks: int = 512
    block_bytes: int = 32 << 10
    blocks_per_chunk: int = 16
    chunks: int = 16
    matmuls: int = 2
    dim: int = 4096

    @property
    def load_bytes(self) -> int:
        return self.layers * 2 * self.chunks * self.blocks_per_chunk * self.block_bytes


def overlap_summary(best_ms: dict[str, float], load_bytes: int) -> dict[str, Any]:
    """From each mode's best forward time (ms): what the load adds to the forward with a
    whole fence and per layer, and the share of the whole fence's cost that per-layer
    waits hide (1.0: the load costs nothing; 0: no overlap; None: the load cost nothing
    measurable either way). Pure."""
    none, whole, per_layer = (best_ms[m] for m in MODES)
    added_whole, added_per_layer = whole - none, per_layer - none
    hidden = None if added_whole <= 0 else round(1 - added_per_layer / added_whole, 3)
    return {"forward_ms": {m: round(best_ms[m], 3) for m in MODES},
            "load_mib": round(load_bytes / 2**20, 1),
            "whole_load_adds_ms": round(added_whole, 3),
            "per_layer_adds_ms": round(added_per_layer, 3),
            "hidden_by_per_layer": hidden,
            "per_layer_faster": per_layer < whole}


def layer_overlap(setup: OverlapSetup = OverlapSetup(), *, device: str = "cuda",
                  reps: int = 10) -> dict[str, Any]:
    """Time the fake forward in each mode (best of ``reps`` >= 1, interleaved) and check
    the bytes every layer read (each run) and every loaded block (the last run of each
    mode). ``ok``: no byte mismatch; the speed is reported (``hidden_by_per_layer``), not
    judged. The defaults load 256 MiB over 16 layers of two 4096-square bf16 matmuls."""
    import numpy as np
    import torch

    from kv_offload.copy import make_copy_engine
    from kv_offload.copy.host_buffer import allocate_host_slots
    from kv_offload.copy.layers import PlaneLayers

    s = setup
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.zeros((2, s.num_blocks, s.block_bytes), dtype=torch.uint8, device=device)
               for _ in range(s.layers)]
    planes = [t[k] for t in tensors for k in (0, 1)]
    layers = PlaneLayers.from_counts([f"model.layers.{i}.attn" for i in range(s.layers)],
                                     [2] * s.layers)
    slot_bytes = 2 * s.layers * s.blocks_per_chunk * s.block_bytes
    host = allocate_host_slots(s.chunks, slot_bytes, pinned=device == "cuda")
    host.as_tensor().copy_(torch.randint(0, 256, (s.chunks, slot_bytes), dtype=torch.uint8,
                                         generator=gen))
    engine = make_copy_engine(planes, host, s.blocks_per_chunk)
    ids = np.random.default_rng(1).permutation(s.num_blocks)[: s.chunks * s.blocks_per_chunk]
    ids = ids.reshape(s.chunks, s.blocks_per_chunk)
    slots = np.arange(s.chunks)
    flat = torch.from_numpy(ids.reshape(-1)).to(device)
    # What layer i's attention must read: the sum of its K and V bytes in the host slots.
    per_slot = host.as_tensor().view(s.chunks, s.layers, -1)
    expected = per_slot.sum(dim=(0, 2), dtype=torch.int64).to(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # tensor cores on a GPU
    x = torch.randn(s.dim, s.dim, device=device, dtype=dtype)
    weight = torch.randn(s.dim, s.dim, device=device, dtype=dtype) / s.dim
    sums = torch.zeros(s.layers, dtype=torch.int64, device=device)

    def forward(before_layer: Callable[[int], None]) -> None:
        y = x
        for i, t in enumerate(tensors):
            before_layer(i)  # wait_for_layer_load
            for _ in range(s.matmuls):
                y = y @ weight
            sums[i] = t[:, flat].sum(dtype=torch.int64)

    def run(mode: str) -> float:
        for t in tensors:
            t[:, flat] = 0  # a layer read before its copy sums wrong
        sums.zero_()
        timer = _Timer(device)
        if mode == "whole":
            engine.fence(engine.load(slots, ids))
            forward(lambda i: None)
        elif mode == "per_layer":
            copy = engine.load_by_layer(slots, ids, layers)
            forward(lambda i: engine.fence_mark(copy.layer_marks[i]))
            for mark in copy.layer_marks:
                engine.release_mark(mark)
            engine.wait(copy.handle)  # the CPU engine keeps a copy's future until waited for
        else:
            forward(lambda i: None)
        return timer.stop()

    best = {m: float("inf") for m in MODES}
    mismatches = {m: 0 for m in MODES if m != "none"}
    try:
        for m in MODES:  # warm up
            run(m)
        for rep in range(reps):
            for m in MODES:
                best[m] = min(best[m], run(m))
                if m != "none":  # every layer's read, every run; the blocks once
                    mismatches[m] += int((sums != expected).sum())
                    if rep == reps - 1:
                        mismatches[m] += _block_mismatches(planes, host, ids, slots,
                                                           s.blocks_per_chunk)
    finally:
        engine.close()
    out = overlap_summary(best, s.load_bytes)
    out.update(setup=dict(layers=s.layers, chunks=s.chunks, blocks_per_chunk=s.blocks_per_chunk,
                          block_kib=s.block_bytes >> 10, matmuls=s.matmuls, dim=s.dim),
               engine=engine.describe(), reps=reps, mismatches=mismatches,
               ok=not any(mismatches.values()))
    return out


def _block_mismatches(planes: list[Any], host: Any, ids: Any, slots: Any, bpc: int) -> int:
    """Loaded blocks whose bytes differ from their host slot position (0: all right)."""
    import torch

    buf = host.as_tensor()
    bad = 0
    for c, slot in enumerate(slots.tolist()):
        row = buf[slot].view(len(planes), bpc, -1)
        for p, plane in enumerate(planes):
            got = plane[torch.from_numpy(ids[c]).to(plane.device)].cpu()
            bad += int((got != row[p]).any(dim=1).sum())
    return bad


class _Timer:
    """Milliseconds from construction to ``stop``: CUDA events on the current stream (the
    GPU's time, copies waited for included), else the host's clock."""

    def __init__(self, device: str) -> None:
        import torch

        self._cuda = device == "cuda"
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if not self._cuda:
            return (time.perf_counter() - self._t0) * 1e3
        self._end.record()
        self._end.synchronize()
        return float(self._start.elapsed_time(self._end))
