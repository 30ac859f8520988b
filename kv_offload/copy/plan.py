"""Copy planning: which engine blocks go to which bytes of the host slot buffer.

Pure numpy: no torch, no CUDA, no I/O. Both copy engines plan here and only execute.

Host slot layout (``SlotLayout``): a slot holds one chunk, i.e. ``blocks_per_chunk``
consecutive logical blocks of every plane, laid out ``[plane][block_in_chunk][bytes]``::

    slot s, plane p, position i  ->  s * slot_bytes + plane_offset[p] + i * plane_bytes[p]

with ``plane_offset[p] = blocks_per_chunk * sum(plane_bytes[:p])``. Within a slot the
positions of one plane are contiguous; across slots they are contiguous only when the
slot holds nothing else (one plane and ``slot_bytes == blocks_per_chunk * plane_bytes``),
so runs are merged across slot boundaries only then.

Requests arrive as ``block_ids`` (n_chunks, blocks_per_chunk) and ``slots`` (n_chunks,):
row c copies engine block ``block_ids[c, i]`` to/from position i of slot ``slots[c]``.
``SKIP_BLOCK`` (-1) in ``block_ids`` leaves that position and its block untouched.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kv_offload.jobs import SKIP_BLOCK

__all__ = [
    "SKIP_BLOCK",
    "BlockMap",
    "ByteRanges",
    "CopyRuns",
    "Direction",
    "Segments",
    "SlotLayout",
    "check_block_map",
    "expand_chunks",
    "plan_runs",
    "plan_segments",
    "runs_to_byte_ranges",
    "split_byte_ranges",
    "StridedGroups",
    "strided_groups",
    "validated_chunks",
]

_INT = np.int64


class Direction(enum.Enum):
    """Which way a copy goes: STORE is engine -> host, LOAD is host -> engine."""

    STORE = "store"
    LOAD = "load"


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """Byte layout of one host slot. Immutable; validated on construction (ValueError)."""

    plane_bytes: tuple[int, ...]
    blocks_per_chunk: int
    slot_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "plane_bytes", tuple(int(b) for b in self.plane_bytes))
        object.__setattr__(self, "blocks_per_chunk", int(self.blocks_per_chunk))
        object.__setattr__(self, "slot_bytes", int(self.slot_bytes))
        if not self.plane_bytes:
            raise ValueError("SlotLayout needs at least one plane")
        if any(b <= 0 for b in self.plane_bytes):
            raise ValueError(f"plane_bytes must be positive, got {self.plane_bytes}")
        if self.blocks_per_chunk <= 0:
            raise ValueError(f"blocks_per_chunk must be positive, got {self.blocks_per_chunk}")
        if self.slot_bytes < self.chunk_bytes:
            raise ValueError(
                f"slot_bytes {self.slot_bytes} cannot hold a chunk of {self.chunk_bytes} bytes "
                f"({len(self.plane_bytes)} planes x {self.blocks_per_chunk} blocks)")

    @classmethod
    def packed(cls, plane_bytes: tuple[int, ...] | list[int], blocks_per_chunk: int) -> SlotLayout:
        """The layout without padding: ``slot_bytes == chunk_bytes``."""
        planes = tuple(int(b) for b in plane_bytes)
        return cls(planes, blocks_per_chunk, int(blocks_per_chunk) * sum(planes))

    @property
    def num_planes(self) -> int:
        return len(self.plane_bytes)

    @property
    def chunk_bytes(self) -> int:
        """Bytes one chunk occupies in a slot (``slot_bytes`` may add padding after it)."""
        return self.blocks_per_chunk * sum(self.plane_bytes)

    @property
    def plane_offsets(self) -> tuple[int, ...]:
        """Byte offset of each plane's first position inside a slot."""
        offsets, total = [], 0
        for b in self.plane_bytes:
            offsets.append(total)
            total += b * self.blocks_per_chunk
        return tuple(offsets)

    @property
    def contiguous_across_slots(self) -> bool:
        """Whether position bpc-1 of slot s is immediately followed by position 0 of
        slot s+1 in every plane (true only for a single unpadded plane)."""
        return self.num_planes == 1 and self.slot_bytes == self.chunk_bytes


class BlockMap(NamedTuple):
    """Flat per-block copy list (rows skipped with SKIP_BLOCK are already removed).

    ``engine_blocks[k]`` <-> position ``host_positions[k]`` of slot ``host_slots[k]``;
    ``rows[k]`` is the chunk row of ``block_ids`` it came from. All int64, same length.
    """

    engine_blocks: np.ndarray
    host_slots: np.ndarray
    host_positions: np.ndarray
    rows: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.engine_blocks.shape[0])


class CopyRuns(NamedTuple):
    """Coalesced runs, identical for every plane: ``num_blocks[r]`` consecutive engine
    blocks from ``engine_start[r]`` <-> consecutive host positions from position
    ``host_offset[r]`` of slot ``host_slot[r]`` (may run past the slot's end only when
    the layout is ``contiguous_across_slots``). All int64, same length."""

    engine_start: np.ndarray
    host_slot: np.ndarray
    host_offset: np.ndarray
    num_blocks: np.ndarray

    @property
    def num_runs(self) -> int:
        return int(self.engine_start.shape[0])


class ByteRanges(NamedTuple):
    """Byte ranges to copy. ``plane[k]`` names the plane; ``engine_offset`` is relative to
    that plane's first byte (block 0), ``host_offset`` to the host buffer's first byte.
    Direction-neutral: a store copies engine -> host, a load host -> engine. int64."""

    plane: np.ndarray
    engine_offset: np.ndarray
    host_offset: np.ndarray
    nbytes: np.ndarray

    @property
    def num_ranges(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())


class Segments(NamedTuple):
    """Maximal pieces of a block map whose host positions are consecutive within one
    chunk row (one slot): entries ``start[g] .. start[g] + length[g] - 1`` of the
    ``BlockMap`` go to positions ``first_position[g] ..`` of ``host_slot[g]``.
    ``is_run[g]``: their engine blocks are consecutive too, from ``engine_start[g]``
    (one slice copy suffices; otherwise gather/scatter by block id). int64/bool."""

    start: np.ndarray
    length: np.ndarray
    host_slot: np.ndarray
    first_position: np.ndarray
    engine_start: np.ndarray
    is_run: np.ndarray

    @property
    def num_segments(self) -> int:
        return int(self.start.shape[0])


def _as_int_array(name: str, value: object, ndim: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.size == 0:
        return np.empty((0,) * ndim, _INT)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr.astype(_INT, copy=False)


def validated_chunks(
    block_ids: object, slots: object, blocks_per_chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """``block_ids`` as int64 (n, blocks_per_chunk) and ``slots`` as int64 (n,), both
    C-contiguous (copies only where needed). Raises ValueError for non-integers, wrong
    shapes or ids below SKIP_BLOCK; ranges are checked later (``check_block_map``)."""
    ids = _as_int_array("block_ids", block_ids, 2)
    sl = _as_int_array("slots", slots, 1)
    if ids.shape[0] == 0 and sl.shape[0] == 0:
        return np.empty((0, blocks_per_chunk), _INT), sl
    if ids.shape != (sl.shape[0], blocks_per_chunk):
        raise ValueError(
            f"block_ids must have shape (n_chunks, blocks_per_chunk) = ({sl.shape[0]}, "
            f"{blocks_per_chunk}) to match slots, got {ids.shape}")
    if np.any(ids < SKIP_BLOCK):
        raise ValueError(f"block_ids must be >= 0 or SKIP_BLOCK ({SKIP_BLOCK})")
    return np.ascontiguousarray(ids), np.ascontiguousarray(sl)


def expand_chunks(block_ids: object, slots: object, *, blocks_per_chunk: int) -> BlockMap:
    """Flatten chunk rows into a per-block map, dropping SKIP_BLOCK positions.

    Raises ValueError on shape or dtype mismatches. Pure; returns new arrays.
    """
    ids, sl = validated_chunks(block_ids, slots, blocks_per_chunk)
    n = ids.shape[0]
    keep = (ids != SKIP_BLOCK).reshape(-1)
    positions = np.tile(np.arange(blocks_per_chunk, dtype=_INT), n)
    rows = np.repeat(np.arange(n, dtype=_INT), blocks_per_chunk)
    return BlockMap(
        engine_blocks=ids.reshape(-1)[keep],
        host_slots=np.repeat(sl, blocks_per_chunk)[keep],
        host_positions=positions[keep],
        rows=rows[keep],
    )


def check_block_map(
    bm: BlockMap, direction: Direction, *, num_engine_blocks: int, num_slots: int
) -> None:
    """Raise ValueError unless every block and slot is in range and no destination is
    written twice (a store's host positions, a load's engine blocks). Pure."""
    if bm.num_blocks == 0:
        return
    if bm.engine_blocks.min() < 0 or bm.engine_blocks.max() >= num_engine_blocks:
        raise ValueError(f"block ids must lie in [0, {num_engine_blocks}), got "
                         f"[{bm.engine_blocks.min()}, {bm.engine_blocks.max()}]")
    if bm.host_slots.min() < 0 or bm.host_slots.max() >= num_slots:
        raise ValueError(f"slots must lie in [0, {num_slots}), got "
                         f"[{bm.host_slots.min()}, {bm.host_slots.max()}]")
    if direction is Direction.STORE:
        # every position is < stride, so slot * stride + position names one (slot, position)
        stride = int(bm.host_positions.max()) + 1
        dest = bm.host_slots * stride + bm.host_positions
        what = "host slot positions"
    else:
        dest = bm.engine_blocks
        what = "engine blocks"
    if np.unique(dest).shape[0] != dest.shape[0]:
        raise ValueError(f"a {direction.value} would write the same {what} twice")


def plan_runs(bm: BlockMap, *, blocks_per_chunk: int, merge_across_slots: bool) -> CopyRuns:
    """Coalesce a block map into maximal runs that are consecutive on both sides.

    Blocks are ordered by host position first, so chunks given in any order still
    merge. A run never crosses a slot boundary unless ``merge_across_slots`` (pass
    ``SlotLayout.contiguous_across_slots``). Vectorised; pure; returns new arrays.
    """
    if bm.num_blocks == 0:
        empty = np.empty(0, _INT)
        return CopyRuns(empty, empty, empty, empty)
    host = bm.host_slots * blocks_per_chunk + bm.host_positions
    order = np.argsort(host, kind="stable")
    host = host[order]
    eng = bm.engine_blocks[order]
    brk = (np.diff(eng) != 1) | (np.diff(host) != 1)
    if not merge_across_slots:
        brk |= np.diff(host // blocks_per_chunk) != 0
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    lengths = np.diff(np.concatenate((starts, [host.shape[0]])))
    first = host[starts]
    return CopyRuns(
        engine_start=eng[starts],
        host_slot=first // blocks_per_chunk,
        host_offset=first % blocks_per_chunk,
        num_blocks=lengths.astype(_INT),
    )


def runs_to_byte_ranges(
    runs: CopyRuns, layout: SlotLayout, row_strides: tuple[int, ...] | list[int]
) -> ByteRanges:
    """Turn runs into byte ranges for every plane (plane-major order).

    ``row_strides[p]``: bytes between consecutive engine blocks of plane p. A run is one
    range when the plane's engine rows are packed (``row_stride == plane_bytes``);
    otherwise it becomes one range per block. Pure; returns new arrays.

    One set of numpy operations for all planes (no Python loop over planes: it runs on
    vLLM's thread, and 80-layer models have 160 planes; ``tests/copy/test_copy_plan.py``
    checks it against the per-plane loop it replaced, byte for byte).
    """
    if len(row_strides) != layout.num_planes:
        raise ValueError(f"need {layout.num_planes} row strides, got {len(row_strides)}")
    pb = np.asarray(layout.plane_bytes, _INT)
    stride = np.asarray([int(s) for s in row_strides], _INT)
    if np.any(stride < pb):
        p = int(np.flatnonzero(stride < pb)[0])
        raise ValueError(f"plane {p}: row stride {stride[p]} < plane bytes {pb[p]} (rows overlap)")
    empty = np.empty(0, _INT)
    if runs.num_runs == 0:
        return ByteRanges(empty, empty, empty, empty)
    packed = stride == pb
    num_runs, num_blocks = runs.num_runs, int(runs.num_blocks.sum())
    # where each plane's ranges start in the output: packed planes give one range per
    # run, strided ones one per block
    counts = np.where(packed, num_runs, num_blocks)
    first = np.cumsum(counts) - counts
    total = int(counts.sum())
    plane, eng, host, nbytes = (np.empty(total, _INT) for _ in range(4))
    host_run = runs.host_slot * layout.slot_bytes  # (runs,)
    offsets = np.asarray(layout.plane_offsets, _INT)
    for one_per_run in (True, False):
        sel = np.flatnonzero(packed == one_per_run)
        if sel.size == 0:
            continue
        width = num_runs if one_per_run else num_blocks
        at: slice | np.ndarray = (  # every plane in one group: the whole output, in order
            slice(None) if sel.size == layout.num_planes
            else (first[sel][:, None] + np.arange(width, dtype=_INT)[None, :]).reshape(-1))
        p_pb, p_stride = pb[sel][:, None], stride[sel][:, None]
        if one_per_run:
            e_blocks, h_pos, h_base = runs.engine_start, runs.host_offset, host_run
            n = runs.num_blocks[None, :] * p_pb
        else:
            rep = np.repeat(np.arange(num_runs, dtype=_INT), runs.num_blocks)
            within = _ranges_within(runs.num_blocks)
            e_blocks = runs.engine_start[rep] + within
            h_pos, h_base = runs.host_offset[rep] + within, host_run[rep]
            n = np.broadcast_to(p_pb, (sel.size, width))
        plane[at] = np.repeat(sel, width)
        eng[at] = (e_blocks[None, :] * p_stride).reshape(-1)
        host[at] = (h_base[None, :] + offsets[sel][:, None] + h_pos[None, :] * p_pb).reshape(-1)
        nbytes[at] = n.reshape(-1)
    return ByteRanges(plane, eng, host, nbytes)


def split_byte_ranges(ranges: ByteRanges, max_bytes: int) -> ByteRanges:
    """Cut every range into pieces of at most ``max_bytes`` (pieces start at multiples
    of ``max_bytes`` from the range start, so alignment is kept). Pure."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if ranges.num_ranges == 0:
        return ranges
    pieces = (ranges.nbytes + max_bytes - 1) // max_bytes
    rep = np.repeat(np.arange(ranges.num_ranges), pieces)
    skip = _ranges_within(pieces) * max_bytes
    nbytes = np.minimum(ranges.nbytes[rep] - skip, max_bytes)
    return ByteRanges(
        plane=ranges.plane[rep],
        engine_offset=ranges.engine_offset[rep] + skip,
        host_offset=ranges.host_offset[rep] + skip,
        nbytes=nbytes.astype(_INT, copy=False),
    )


class StridedGroups(NamedTuple):
    """2-D copies: group g copies ``height[g]`` rows of ``width[g]`` bytes, row r from
    ``src[g] + r * src_pitch[g]`` to ``dst[g] + r * dst_pitch[g]`` (pitches >= width).
    int64, same length."""

    src: np.ndarray
    dst: np.ndarray
    width: np.ndarray
    height: np.ndarray
    src_pitch: np.ndarray
    dst_pitch: np.ndarray

    @property
    def num_groups(self) -> int:
        return int(self.width.shape[0])


def strided_groups(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, *,
                   max_pitch: int) -> StridedGroups:
    """Group consecutive ranges (``nbytes[k]`` bytes from ``src[k]`` to ``dst[k]``, in the
    order given) into 2-D copies of one row size at a constant pair of pitches, each at
    least the row size (rows never overlap) and at most ``max_pitch``. A pair of
    neighbours joins the group of the pair before it only at the same pitches (greedy
    from the left). Vectorised; pure; new arrays."""
    src, dst, nbytes = (np.asarray(a, _INT) for a in (src, dst, nbytes))
    n = int(nbytes.shape[0])
    if n == 0:
        empty = np.empty(0, _INT)
        return StridedGroups(empty, empty, empty, empty, empty, empty)
    ds, dd, w = np.diff(src), np.diff(dst), nbytes[:-1]
    link = ((nbytes[1:] == w) & (ds >= w) & (dd >= w) & (ds <= max_pitch)
            & (dd <= max_pitch))
    # Greedy from the left: a pair whose pitches differ from those of the pair before it
    # ends that group when the pair before is used, else it starts a new one; in a row of
    # such pairs, every other one is used.
    same_pitch = np.concatenate(([True], (ds[1:] == ds[:-1]) & (dd[1:] == dd[:-1])))
    change = link & ~same_pitch & np.concatenate(([False], link[:-1]))
    first = change & ~np.concatenate(([False], change[:-1]))
    index = np.arange(change.shape[0])
    in_row = index - np.maximum.accumulate(np.where(first, index, 0))
    link &= ~change | (in_row % 2 == 1)
    starts = np.flatnonzero(np.concatenate(([True], ~link)))
    height = np.diff(np.concatenate((starts, [n])))
    rows = height > 1
    pitch_at = np.minimum(starts, n - 2) if n > 1 else starts
    src_pitch = np.where(rows, ds[pitch_at] if n > 1 else 0, nbytes[starts])
    dst_pitch = np.where(rows, dd[pitch_at] if n > 1 else 0, nbytes[starts])
    return StridedGroups(src[starts], dst[starts], nbytes[starts].copy(), height.astype(_INT),
                         src_pitch.astype(_INT), dst_pitch.astype(_INT))


def plan_segments(bm: BlockMap) -> Segments:
    """Group a block map (in ``expand_chunks`` order) into per-slot segments for engines
    that copy one host slice per call. Vectorised; pure; returns new arrays."""
    n = bm.num_blocks
    if n == 0:
        empty = np.empty(0, _INT)
        return Segments(empty, empty, empty, empty, empty, np.empty(0, bool))
    brk = (np.diff(bm.rows) != 0) | (np.diff(bm.host_positions) != 1)
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    lengths = np.diff(np.concatenate((starts, [n])))
    # a pair of neighbours inside one segment that is not engine-consecutive breaks the run
    bad_pair = (np.diff(bm.engine_blocks) != 1) & ~brk
    segment_of_pair = np.cumsum(np.concatenate(([False], brk)))[:-1]
    bad = np.bincount(segment_of_pair[bad_pair], minlength=starts.shape[0])
    return Segments(
        start=starts.astype(_INT),
        length=lengths.astype(_INT),
        host_slot=bm.host_slots[starts],
        first_position=bm.host_positions[starts],
        engine_start=bm.engine_blocks[starts],
        is_run=bad == 0,
    )


def _ranges_within(lengths: np.ndarray) -> np.ndarray:
    """For lengths [2, 3] return [0, 1, 0, 1, 2] (index inside each group)."""
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, _INT)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=_INT) - starts
