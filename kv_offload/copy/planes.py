"""Planes: the engine's KV tensors seen as (num_blocks, plane_bytes) byte rows.

A plane is a 2-D uint8 tensor whose row ``b`` holds the bytes of engine block ``b``
(contiguous), with any row stride >= plane_bytes. Copy engines only ever see planes,
so they are independent of the attention backend's tensor layout.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from kv_offload.layout import page_order

__all__ = ["MAX_PLANES_PER_TENSOR", "PlaneGeometry", "describe_planes", "page_order_of",
           "planes_from_kv_tensor"]

MAX_PLANES_PER_TENSOR = 1024
"""More planes than this from one tensor means the block dim was guessed wrong."""


@dataclass(frozen=True, slots=True)
class PlaneGeometry:
    """What engines need to know about a list of planes (checked by describe_planes)."""

    num_blocks: int
    plane_bytes: tuple[int, ...]
    row_strides: tuple[int, ...]  # bytes between consecutive blocks of each plane
    device: torch.device


def planes_from_kv_tensor(
    t: torch.Tensor, num_blocks: int, *, block_dim: int | None = None
) -> list[torch.Tensor]:
    """Return the planes of one layer's KV tensor: one per index of the dims before
    the block dim (K and V of a ``(2, num_blocks, ...)`` tensor, in that order).

    The block dim is the one of size ``num_blocks`` (or, when none is, a multiple of it:
    kernel blocks grouped into manager blocks); pass ``block_dim`` when several dims
    qualify. The dims after it must tile a contiguous byte range in any order.
    The planes are views sharing ``t``'s storage (nothing is copied; writes to a plane
    change ``t``). Raises ValueError for layouts that are not expressible as planes.
    Examples: CPU ``[nb, heads, bs, 2*hd]`` -> 1 plane; FlashAttention
    ``[2, nb, bs, heads, hd]`` -> 2; FlashInfer ``[nb, 2, ...]`` -> 1; MLA ``[nb, bs, d]`` -> 1.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"expected a torch.Tensor, got {type(t).__name__}")
    if num_blocks <= 0:
        raise ValueError(f"num_blocks must be positive, got {num_blocks}")
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"KV tensor of shape {tuple(t.shape)} has no blocks")
    shape, stride = list(t.shape), list(t.stride())
    if block_dim is not None:
        if not -t.dim() <= block_dim < t.dim():
            raise ValueError(f"block_dim {block_dim} out of range for {t.dim()}-D tensor")
        candidates = [block_dim % t.dim()]
    else:
        candidates = [d for d, n in enumerate(shape) if n == num_blocks]
        if not candidates:
            candidates = [d for d, n in enumerate(shape) if n > num_blocks and n % num_blocks == 0]
    errors: list[str] = []
    found: list[tuple[int, int, int, list[int]]] = []
    for d in candidates:
        try:
            found.append((d, *_plane_geometry(shape, stride, d, num_blocks, t.element_size())))
        except ValueError as exc:
            errors.append(f"dim {d}: {exc}")
    if not found:
        why = "; ".join(errors) if errors else f"no dim of size {num_blocks} (or a multiple)"
        raise ValueError(f"cannot find the block dim of KV tensor shape {tuple(shape)} "
                         f"stride {tuple(stride)} for {num_blocks} blocks: {why}")
    if len(found) > 1:
        raise ValueError(f"ambiguous block dim in KV tensor shape {tuple(shape)}: dims "
                         f"{[f[0] for f in found]} all fit {num_blocks} blocks; pass block_dim")
    d, plane_bytes, row_stride, bases = found[0]
    storage = t.untyped_storage()
    start = t.storage_offset() * t.element_size()
    return [
        torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            storage, start + base, (num_blocks, plane_bytes), (row_stride, 1))
        for base in bases
    ]


def _plane_geometry(
    shape: list[int], stride: list[int], d: int, num_blocks: int, itemsize: int
) -> tuple[int, int, list[int]]:
    """(plane_bytes, row_stride_bytes, byte offset of each plane) for block dim d."""
    group = shape[d] // num_blocks  # kernel blocks per block (1 in the usual case)
    # trailing dims, plus the kernel-block sub-dim, must tile one dense byte range
    inner = [(n, s) for n, s in zip(shape[d + 1:], stride[d + 1:]) if n > 1]
    if group > 1:
        inner.append((group, stride[d]))
    expected = 1
    for n, s in sorted(inner, key=lambda ns: ns[1]):
        if s != expected:
            raise ValueError("the bytes of one block are not contiguous")
        expected *= n
    plane_bytes = expected * itemsize
    row_stride = stride[d] * group * itemsize
    if num_blocks > 1 and row_stride < plane_bytes:
        raise ValueError("blocks overlap (row stride smaller than a block)")
    lead = [range(n) for n in shape[:d]]
    if math.prod(shape[:d]) > MAX_PLANES_PER_TENSOR:
        raise ValueError(f"{math.prod(shape[:d])} planes per tensor; the block dim is too far in")
    bases = [sum(i * s for i, s in zip(idx, stride[:d])) * itemsize
             for idx in itertools.product(*lead)]
    return plane_bytes, row_stride, bases


def describe_planes(planes: list[torch.Tensor]) -> PlaneGeometry:
    """Check planes for an engine and return their geometry. Raises ValueError when
    they are empty, not 2-D uint8 with contiguous rows, differ in num_blocks or device,
    or have overlapping rows. Reads only metadata."""
    if not planes:
        raise ValueError("need at least one plane")
    first = planes[0]
    for i, p in enumerate(planes):
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 2:
            what = f"{p.dtype} {tuple(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
            raise ValueError(f"plane {i} must be a 2-D uint8 tensor, got {what}")
        if p.shape[0] != first.shape[0]:
            raise ValueError(f"plane {i} has {p.shape[0]} blocks, plane 0 has {first.shape[0]}")
        if p.device != first.device:
            raise ValueError(f"plane {i} is on {p.device}, plane 0 on {first.device}")
        if p.shape[1] == 0:
            raise ValueError(f"plane {i} has empty rows")
        if p.shape[1] > 1 and p.stride(1) != 1:
            raise ValueError(f"plane {i}: rows are not contiguous (stride {p.stride()})")
        if p.shape[0] > 1 and p.stride(0) < p.shape[1]:
            raise ValueError(f"plane {i}: rows overlap (stride {p.stride()})")
    return PlaneGeometry(
        num_blocks=int(first.shape[0]),
        plane_bytes=tuple(int(p.shape[1]) for p in planes),
        row_strides=tuple(int(p.stride(0)) if p.shape[0] > 1 else int(p.shape[1])
                          for p in planes),
        device=first.device,
    )


def page_order_of(t: torch.Tensor, num_blocks: int) -> str:
    """The page order (``kv_offload.layout.page_order``) of one layer's KV tensor as vLLM
    hands it to connectors: a logical ``[blocks * S, heads, tokens / S, content]`` view
    (vLLM 0.32+), where S > 1 when vLLM splits each block into S kernel blocks. Reads only
    shape and strides. Raises ValueError for any other shape."""
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
        what = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"expected vLLM's 4-D [blocks, heads, tokens, content] KV view, "
                         f"got {what}")
    rows, heads, tokens, content = (int(n) for n in t.shape)
    if num_blocks <= 0 or rows % num_blocks:
        raise ValueError(f"dim 0 has {rows} rows, not a multiple of {num_blocks} blocks")
    split = rows // num_blocks
    itemsize = t.element_size()
    dims = [("S", split, t.stride(0)), ("H", heads, t.stride(1)), ("N", tokens, t.stride(2)),
            ("C", content * itemsize, t.stride(3))]
    dims = [d for d in dims if d[1] > 1]
    dims.sort(key=lambda d: -d[2])
    return page_order([(name, size) for name, size, _ in dims])
