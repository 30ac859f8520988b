"""The host slot buffer: one block of host memory per worker, cut into equal slots.

The CPU tier's bytes live here. Copy engines write and read whole slots; disk I/O reads
and writes them through zero-copy ``memoryview``s. Pinned (page-locked, CUDA-mapped)
memory is allocated through CuPy at exactly the requested size, which maps every page.
Plain memory is an anonymous mapping of our own: the kernel maps its pages on first
write, at ~1 us a page (a 256 KiB slot's first store ran at a quarter of the speed of
later ones), so ``HostSlots.populate`` maps them ahead, in the background, without
touching the bytes. (No huge-page hint: on these VMs a 2 MiB fault, zeroing and
compaction included, mapped 3x slower per byte than 4 KiB pages.)
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Callable

import numpy as np
import torch

from kv_offload.config import format_size
from kv_offload.copy.base import InsufficientHostMemoryError

__all__ = [
    "HostSlots",
    "InsufficientHostMemoryError",
    "allocate_host_slots",
    "available_host_memory",
    "check_local_ranks_fit",
    "total_host_memory",
]

logger = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23  # Linux 5.14+ (Python 3.11's mmap module lacks the name)
POPULATE_PIECE_BYTES = 64 * 2**20


class HostSlots:
    """``num_slots`` slots of ``slot_bytes`` bytes each, in one host allocation.

    ``tensor``: the uint8 (num_slots, slot_bytes) CPU tensor (contiguous). The object
    owns the memory; views handed out (``tensor``, ``slot_view``) keep it alive after
    ``close``. Nothing here synchronises: callers make sure a slot is not read and
    written at the same time (the scheduler's pins do).
    """

    def __init__(self, tensor: torch.Tensor, *, pinned: bool, owner: object = None) -> None:
        """Wrap an existing buffer. ``owner``: an object that must outlive the tensor's
        memory (e.g. the pinned allocation). Raises ValueError for a tensor that is not
        a contiguous 2-D uint8 CPU tensor."""
        if (not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8
                or tensor.dim() != 2 or tensor.device.type != "cpu"
                or not tensor.is_contiguous()):
            raise ValueError("host slots must be a contiguous 2-D uint8 CPU tensor, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)} "
                             f"{tuple(getattr(tensor, 'shape', ()))}")
        if tensor.shape[0] == 0 or tensor.shape[1] == 0:
            raise ValueError(f"host slots must not be empty, got {tuple(tensor.shape)}")
        self.tensor: torch.Tensor | None = tensor
        self.pinned = bool(pinned)
        self.num_slots = int(tensor.shape[0])
        self.slot_bytes = int(tensor.shape[1])
        self._array: np.ndarray | None = tensor.numpy()
        self._owner = owner

    def as_tensor(self) -> torch.Tensor:
        """``tensor``, or ValueError after ``close`` (for callers that need the memory)."""
        if self.tensor is None:
            raise ValueError("host slots are closed")
        return self.tensor

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot_view(self, slot: int) -> memoryview:
        """A writable, zero-copy, 1-D byte view of one slot (for preadv/pwritev); it
        keeps the memory alive. Raises IndexError for a slot outside [0, num_slots)
        and ValueError after ``close``."""
        if self._array is None:
            raise ValueError("host slots are closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        return self._array[int(slot)].data

    def populate(self) -> bool:
        """Map every page of plain (anonymous) slots now, so that first stores do not
        fault; the bytes are not touched, so slots may be in use meanwhile. Runs on the
        calling thread (meant for a background one), ~0.4 s per GiB on a 2-vCPU VM.
        False where there is nothing to do or the kernel cannot (pinned memory is mapped
        already; kernels before 5.14); stops early after ``close``."""
        owner = self._owner
        if not isinstance(owner, mmap.mmap):
            return False
        for start in range(0, len(owner), POPULATE_PIECE_BYTES):
            if self._owner is None:  # closed: the memory may be going away
                return False
            try:
                owner.madvise(MADV_POPULATE_WRITE, start,
                              min(POPULATE_PIECE_BYTES, len(owner) - start))
            except (OSError, ValueError) as exc:
                logger.debug("kv-offload: cannot pre-map the CPU tier's pages: %s", exc)
                return False
        return True

    def close(self) -> None:
        """Drop this object's references (``tensor`` becomes None); the memory is freed
        once no view handed out earlier remains. Idempotent."""
        self.tensor = None
        self._array = None
        self._owner = None

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return f"HostSlots({self.num_slots} x {self.slot_bytes} bytes, {kind})"


def available_host_memory() -> int | None:
    """Bytes of host memory available to new allocations (psutil), or None where the
    system does not say."""
    try:
        import psutil  # a dependency; imported here so CUDA checks run without it

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing, or it cannot read this platform's figures
        return None


def total_host_memory() -> int | None:
    """Bytes of physical memory of this host (psutil), or None where it does not say."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def check_local_ranks_fit(
    nbytes_per_rank: int, num_local_ranks: int, *,
    total: Callable[[], int | None] | None = None,
    available: Callable[[], int | None] | None = None,
) -> None:
    """Check that the CPU tiers of all ``num_local_ranks`` ranks on this host fit in it,
    before this rank allocates its own ``nbytes_per_rank`` (each rank checks only its own
    buffer against the memory available, so with tensor parallelism cpu_size x ranks could
    pass every check and exceed the host). Raises InsufficientHostMemoryError, naming
    cpu_size and the most it may be, when they exceed ``total()`` (the host's RAM); logs
    a warning when they exceed ``available()`` now (ranks that allocated theirs already
    took it from there, so this may be a false alarm). ``total``/``available`` default to
    ``total_host_memory``/``available_host_memory``. Mutates nothing."""
    if num_local_ranks <= 1:
        return
    needed = int(nbytes_per_rank) * int(num_local_ranks)
    ram = (total or total_host_memory)()
    if ram is not None and needed > ram:
        raise InsufficientHostMemoryError(
            f"the CPU tiers of the {num_local_ranks} tensor-parallel ranks on this host need "
            f"{num_local_ranks} x {format_size(nbytes_per_rank)} = {format_size(needed)}, "
            f"more than its {format_size(ram)} of RAM: cpu_size is per rank; lower it to at "
            f"most {format_size(ram // num_local_ranks)} (less what the engine itself uses)")
    free = (available or available_host_memory)()
    if free is not None and needed > free:
        logger.warning(
            "kv-offload: the CPU tiers of the %d ranks on this host need %s, but only %s of "
            "host memory is available now; unless the other ranks have allocated theirs "
            "already, lower cpu_size (it is per rank)", num_local_ranks, format_size(needed),
            format_size(free))


def allocate_host_slots(
    num_slots: int, slot_bytes: int, *, pinned: bool,
    available: Callable[[], int | None] = available_host_memory,
) -> HostSlots:
    """Allocate ``num_slots * slot_bytes`` bytes of host memory as slots (uninitialised).

    ``pinned=True``: page-locked, CUDA-mapped memory of exactly that size (needs CuPy and
    a CUDA device, else ``CudaUnavailableError``); ``pinned=False``: an anonymous private
    mapping (zeroed by the kernel; see ``HostSlots.populate``).
    Raises ValueError for non-positive sizes and ``InsufficientHostMemoryError`` when the
    buffer exceeds ``available()`` (default: the available host memory, checked before
    allocating). The caller owns the result.
    """
    for name, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}; "
                             "check cpu_size and the chunk size in the offload config")
    nbytes = int(num_slots) * int(slot_bytes)
    free = available()
    if free is not None and nbytes > free:
        raise InsufficientHostMemoryError(
            f"the CPU tier needs {format_size(nbytes)} ({num_slots} slots x {slot_bytes} "
            f"bytes) but only {format_size(free)} of host memory is available; lower "
            "cpu_size in the offload config")
    if pinned:
        from kv_offload.copy.cuda_runtime import alloc_pinned_host

        array, owner = alloc_pinned_host(nbytes)
        tensor = torch.from_numpy(array).view(int(num_slots), int(slot_bytes))
        return HostSlots(tensor, pinned=True, owner=owner)
    try:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as exc:  # the kernel refused (overcommit limits)
        raise InsufficientHostMemoryError(
            f"could not allocate {format_size(nbytes)} for the CPU tier ({exc}); lower cpu_size "
            "in the offload config") from None
    array = np.frombuffer(memory, dtype=np.uint8).reshape(int(num_slots), int(slot_bytes))
    return HostSlots(torch.from_numpy(array), pinned=False, owner=memory)

