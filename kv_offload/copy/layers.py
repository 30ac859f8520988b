"""Which planes belong to which attention layer, and a copy's byte ranges cut per layer.

Pure (numpy; no torch, no CUDA). A same-step load on an engine with streams is issued
one layer at a time, in the order vLLM's forward runs the layers, so that each attention
layer waits only for its own copies (``CopyEngine.load_by_layer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kv_offload.copy.plan import ByteRanges

__all__ = ["PlaneLayers", "split_by_layer"]


@dataclass(frozen=True, slots=True)
class PlaneLayers:
    """The engine's planes grouped by attention layer, in the order the forward runs them.

    ``names[i]`` is the layer vLLM names in ``wait_for_layer_load``; its planes are
    ``starts[i]`` up to ``starts[i + 1]`` (``num_planes`` for the last). Immutable;
    ``from_counts`` validates (ValueError)."""

    names: tuple[str, ...]
    starts: tuple[int, ...]
    num_planes: int
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {n: i for i, n in enumerate(self.names)})

    @classmethod
    def from_counts(cls, names: Sequence[str], counts: Sequence[int]) -> PlaneLayers:
        """Layers of ``counts[i]`` consecutive planes each, named ``names[i]``, in the
        order of the engine's planes. ValueError for mismatched lengths, a layer without
        planes or a name given twice."""
        names, counts = tuple(str(n) for n in names), tuple(int(c) for c in counts)
        if len(names) != len(counts) or not names:
            raise ValueError(f"{len(names)} layer names for {len(counts)} plane counts")
        if min(counts) <= 0:
            raise ValueError(f"every layer needs a plane, got counts {counts}")
        if len(set(names)) != len(names):
            raise ValueError("a layer name appears twice")
        starts = tuple(int(s) for s in np.cumsum((0,) + counts[:-1]))
        return cls(names, starts, sum(counts))

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int | None:
        """The position of layer ``name``; None for a layer these planes do not hold."""
        return self._index.get(name)

    def layer_of_plane(self) -> np.ndarray:
        """int64 (num_planes,): the layer each plane belongs to."""
        bounds = np.asarray(self.starts[1:] + (self.num_planes,), dtype=np.int64)
        return np.searchsorted(bounds, np.arange(self.num_planes), side="right")


def split_by_layer(ranges: ByteRanges, layers: PlaneLayers) -> list[ByteRanges]:
    """``ranges`` cut into one ``ByteRanges`` per layer of ``layers`` (empty for a layer
    none of them touches), each keeping the ranges' order. ValueError for a plane index
    that ``layers`` does not cover. Pure; the caller owns the results."""
    plane = np.asarray(ranges.plane, dtype=np.int64)
    if plane.size and (plane.min() < 0 or plane.max() >= layers.num_planes):
        raise ValueError(f"plane index out of range for {layers.num_planes} planes")
    layer = layers.layer_of_plane()[plane]
    order = np.argsort(layer, kind="stable")
    cuts = np.searchsorted(layer[order], np.arange(layers.num_layers + 1))
    return [ByteRanges(*(np.asarray(a)[order[lo:hi]] for a in ranges))
            for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist())]
