"""The copy-engine contract: move chunks between engine KV blocks and host slots.

Pure (no torch, no CuPy) so the fake engine and scheduler-side tests can import it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from kv_offload.copy.layers import PlaneLayers
from kv_offload.copy.plan import Direction

__all__ = ["CopyEngine", "CopyEngineClosedError", "CopyHandle", "CudaUnavailableError",
           "InsufficientHostMemoryError", "LayeredCopy"]


class CudaUnavailableError(RuntimeError):
    """CuPy or a CUDA device is needed (pinned memory, the CuPy engine) but missing."""


class InsufficientHostMemoryError(ValueError):
    """The requested host buffer does not fit in the memory the system has available."""


class CopyEngineClosedError(RuntimeError):
    """A copy was submitted to an engine after ``close()``."""


@dataclass(frozen=True, slots=True)
class CopyHandle:
    """Names one submitted copy of one engine. Immutable and cheap; an engine answers
    ``is_done``/``wait`` for its own handles (a forgotten handle leaks nothing)."""

    seq: int
    direction: Direction


@dataclass(frozen=True, slots=True)
class LayeredCopy:
    """A load issued layer by layer (``CopyEngine.load_by_layer``): ``handle`` names the
    whole copy; ``layer_marks[i]`` is a token for ``fence_mark`` that orders compute after
    layer i's copies, None where layer i has nothing to wait for (no copies, or an
    engine that fenced the whole load already)."""

    handle: CopyHandle
    layer_marks: tuple[object | None, ...]


class CopyEngine(abc.ABC):
    """Moves whole chunks between the engine's KV planes and host slots.

    ``block_ids`` is int (n_chunks, blocks_per_chunk), ``slots`` int (n_chunks,); row c
    pairs position i of slot ``slots[c]`` with engine block ``block_ids[c, i]``;
    ``SKIP_BLOCK`` (-1) leaves a position untouched. Bad shapes, out-of-range ids and a
    destination written twice in one call raise ValueError before anything is copied.
    Callers own the arrays (they are not kept). Every method is safe to call from any
    thread; copies of one call are unordered with respect to each other.
    """

    @abc.abstractmethod
    def store(self, block_ids: np.ndarray, slots: np.ndarray, *,
              after: object | None = None) -> CopyHandle:
        """Copy engine blocks into host slots (mutates the host buffer only). The copy
        reads the blocks as the compute issued before ``after`` (a ``compute_mark``
        token; None: everything issued so far on the calling thread's stream) leaves them."""

    @abc.abstractmethod
    def load(self, slots: np.ndarray, block_ids: np.ndarray, *,
             after: object | None = None) -> CopyHandle:
        """Copy host slots into engine blocks (mutates the engine's KV planes only),
        ordered after the compute issued so far on ``after`` (as for ``store``)."""

    @abc.abstractmethod
    def is_done(self, handle: CopyHandle) -> bool:
        """Whether the copy has completed (never blocks)."""

    @abc.abstractmethod
    def wait(self, handle: CopyHandle) -> None:
        """Block the calling thread until the copy has completed."""

    def fence(self, handle: CopyHandle) -> None:
        """Make compute issued later on the calling thread's stream start after this
        copy. Engines with streams do it device-side (no host wait); the default blocks
        the calling thread until the copy is done."""
        self.wait(handle)

    def load_by_layer(self, slots: np.ndarray, block_ids: np.ndarray, layers: PlaneLayers,
                      ) -> LayeredCopy:
        """Issue a ``load`` (ordered after the compute issued so far on the calling
        thread's stream) one layer of ``layers`` at a time, in their order, each layer's
        copies followed by its mark, so that compute reading layer i waits for layer i
        only (``fence_mark``). The caller gives each mark to ``release_mark``. Default
        (engines without per-layer events): one ``load``, fenced whole before it returns
        (``fence``), and no marks."""
        handle = self.load(slots, block_ids)
        self.fence(handle)
        return LayeredCopy(handle, (None,) * layers.num_layers)

    def took_s(self, handle: CopyHandle) -> float | None:
        """Seconds from issue to end of a copy that ``wait`` saw end, where the engine
        timed it itself (a copy on a thread of its own, which the caller waits for only
        later); None elsewhere (the caller's own timing is the copy's)."""
        del handle
        return None

    def fence_mark(self, mark: object | None) -> None:
        """Make compute issued later on the calling thread's stream start after the
        copies issued before ``mark`` (a layer mark of ``load_by_layer``), device-side:
        the host does not wait. None, and engines without streams: nothing to do."""
        del mark

    @property
    def synchronous(self) -> bool:
        """Whether ``store`` and ``load`` copy before they return (no streams): a copy
        made on the calling thread then costs it the copy and nothing else."""
        return False

    def compute_mark(self) -> object | None:
        """A token for the compute issued so far on the calling thread's stream, to
        order a copy issued later from another thread after that work, and only that
        (``after=`` of ``store``/``load``). None for engines without streams, which
        ignore ``after``. The caller gives it back with ``release_mark``."""
        return None

    def release_mark(self, mark: object | None) -> None:
        """Free a ``compute_mark`` token that no copy will be ordered after any more (or a
        layer mark of ``load_by_layer`` that no compute will be fenced on any more), now
        and on the calling thread (an engine with streams destroys its event there, on its
        own device; left to the garbage collector, it would go on whichever thread runs
        it). The token must not be used afterwards. Engines without streams: nothing to do."""
        del mark

    def unordered_mark(self) -> object | None:
        """A token for ``after=`` that orders a copy after no compute at all: for bytes
        that no compute writes any more (the runtime audit re-reads blocks whose copy has
        ended). None for engines without streams."""
        return None

    @property
    def copy_path(self) -> str:
        """How copies are issued now (engine-specific name, for logs and the audit)."""
        return type(self).__name__

    def describe(self) -> str:
        """One line for the start-up log: how this engine copies, and why."""
        return f"copy path {self.copy_path}"

    def fall_back_to_plainest(self) -> str | None:
        """Issue later copies the plainest way this engine has (after the runtime audit
        found a copy wrong); returns the new ``copy_path``, or None when already there.
        Copies in flight are unaffected. Thread-safe."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for submitted copies and release the engine's resources (not the
        planes or host slots, which the caller owns). Idempotent."""
