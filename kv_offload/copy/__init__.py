"""Copy engines: move chunks between the engine's KV blocks and the host slot buffer.

Public face. The contract (``CopyEngine``, ``CopyHandle``) and planning are pure and
imported eagerly; the torch-backed names load on first use, so importing this package
costs no torch import (scheduler-side code may use ``SlotLayout``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_offload.copy.base import (
    CopyEngine,
    CopyEngineClosedError,
    CopyHandle,
    CudaUnavailableError,
)
from kv_offload.copy.plan import SKIP_BLOCK, Direction, SlotLayout

if TYPE_CHECKING:
    import torch

    from kv_offload.copy.cupy_engine import CupyCopyEngine
    from kv_offload.copy.host_buffer import HostSlots
    from kv_offload.copy.planes import planes_from_kv_tensor
    from kv_offload.copy.torch_engine import TorchCopyEngine

__all__ = [
    "SKIP_BLOCK",
    "CopyEngine",
    "CopyEngineClosedError",
    "CopyHandle",
    "CudaUnavailableError",
    "CupyCopyEngine",
    "Direction",
    "SlotLayout",
    "TorchCopyEngine",
    "make_copy_engine",
    "planes_from_kv_tensor",
]

_LAZY = {
    "TorchCopyEngine": "kv_offload.copy.torch_engine",
    "CupyCopyEngine": "kv_offload.copy.cupy_engine",
    "planes_from_kv_tensor": "kv_offload.copy.planes",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_copy_engine(planes: list[torch.Tensor], host: HostSlots, blocks_per_chunk: int, *,
                     thread_initializer: Callable[[], None] | None = None,
                     layer_thread_initializer: Callable[[], None] | None = None,
                     copy_mode: str = "auto") -> CopyEngine:
    """Build the engine for the planes' device: ``TorchCopyEngine`` for host memory,
    ``CupyCopyEngine`` for CUDA, with ``copy_mode`` (``cupy_engine.COPY_MODES``; the CPU
    engine has one). Raises ValueError for no planes, another device or an unknown mode,
    and ``CudaUnavailableError`` for CUDA planes without CuPy. The caller owns the engine
    (``close()`` it) and keeps ``planes`` and ``host`` alive as long as it.
    ``thread_initializer`` runs first on each of the CPU engine's helper threads,
    ``layer_thread_initializer`` on the one that copies same-step loads per layer."""
    if not planes:
        raise ValueError("make_copy_engine needs at least one plane")
    device = planes[0].device
    if device.type == "cpu":
        from kv_offload.copy.torch_engine import TorchCopyEngine

        return TorchCopyEngine(planes, host, blocks_per_chunk,
                               thread_initializer=thread_initializer,
                               layer_thread_initializer=layer_thread_initializer)
    if device.type == "cuda":
        from kv_offload.copy.cupy_engine import CupyCopyEngine

        index = device.index
        if index is None:
            import torch

            index = torch.cuda.current_device()
        return CupyCopyEngine(planes, host, blocks_per_chunk, device=index,
                              mode=copy_mode)  # type: ignore[arg-type]  # checked there
    raise ValueError(f"no copy engine for planes on {device}")
