"""KV cache groups: which engine blocks of a request make up one stored chunk.

vLLM's hybrid KV cache manager gives a request one block table per KV cache group
(full attention, MLA, sliding window), all from one block pool: a block id belongs to
one group at a time, and the layers of different groups are views of the same tensors.
A stored chunk holds, for every group, the blocks a later request can need
(docs/architecture.md, "KV cache groups"):

- a full-attention (or MLA) group: every block of the chunk;
- a sliding-window group of window W: only the chunk's last ``ceil((W - 1) / block)``
  blocks (its *tail*). A request that loads up to a chunk boundary T attends, from its
  next token on, to tokens from T - W + 1: vLLM keeps exactly the blocks that hold them
  and pads the older ones with its null block (id 0). When the window is longer than a
  chunk, those blocks reach into earlier chunks, whose tails (measured from their own,
  earlier, boundary) hold them.
- a mamba (or linear-attention) group in vLLM's "align" mode: one block, the state at
  the chunk's end boundary, taken from the block vLLM handed over for exactly that
  boundary (``store_blocks``' ``states``); a chunk without it is not stored. A load
  writes it only for the chunk that ends the load, into the last entry of the mamba
  table, which vLLM allocates for the hit (docs/architecture.md, "Mamba state entries").

Slot positions run group after group: a chunk's ``block_ids`` in a ``ChunkMove`` are
the concatenation of each group's positions, so one copy engine over the engine's
tensors moves every group (each position names a block of its own group). A
single-group engine has one group of ``chunk_tokens / block_size`` positions: the
layout of every store made before groups existed.

Pure: no vLLM, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kv_offload.jobs import SKIP_BLOCK

NULL_BLOCK = 0
"""vLLM's null block: a sliding-window table entry that holds no KV (a block vLLM freed
or never allocated). Never copied from or into. (Full-attention tables never hold it.)"""

KINDS = ("full_attention", "mla_attention", "sliding_window", "mamba")
RELEASED_KINDS = ("sliding_window", "mamba")
"""Kinds whose blocks vLLM frees while their request still runs (and whose tables hold
its null block): a window's blocks as it moves, a state block once the next state was
copied from it."""

__all__ = ["KINDS", "NULL_BLOCK", "RELEASED_KINDS", "ChunkMap", "KVGroup",
           "UnservableChunkError"]


class UnservableChunkError(ValueError):
    """A load would leave an engine block the request needs unwritten (vLLM allocated a
    block outside what a stored chunk holds): the chunk must be recomputed instead."""


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group as far as stored bytes go (part of the namespace)."""

    kind: str  # one of KINDS
    num_layers: int
    block_size: int  # tokens per block of this group
    window: int = 0  # sliding window in tokens (sliding_window groups only)
    state: str = ""  # the state tensors' shapes and dtypes (mamba groups only)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache group kind {self.kind!r} (known: {KINDS})")
        if self.block_size <= 0 or self.num_layers <= 0:
            raise ValueError(f"bad KV cache group {self}")
        if (self.kind == "sliding_window") != (self.window > 0):
            raise ValueError(f"a sliding_window group needs a window > 0, others none: {self}")
        if (self.kind == "mamba") != bool(self.state):
            raise ValueError(f"a mamba group needs its state layout (shapes and dtypes), "
                             f"others none: {self}")

    def blocks_per_chunk(self, chunk_tokens: int) -> int:
        if chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens={chunk_tokens} is not a multiple of the "
                             f"{self.kind} group's block size {self.block_size}")
        return chunk_tokens // self.block_size

    def stored_blocks(self, chunk_tokens: int) -> int:
        """Blocks of a chunk this group stores: all, a sliding window's tail, or a mamba
        group's one state block (the state at the chunk's end)."""
        per_chunk = self.blocks_per_chunk(chunk_tokens)
        if self.kind == "mamba":
            return 1
        if self.kind != "sliding_window":
            return per_chunk
        return min(per_chunk, -(-(self.window - 1) // self.block_size))


class ChunkMap:
    """Maps a request's per-group block tables to the engine blocks of one chunk, in
    slot position order (see the module docstring). Immutable; pure."""

    def __init__(self, groups: Sequence[KVGroup], chunk_tokens: int) -> None:
        if not groups:
            raise ValueError("ChunkMap needs at least one KV cache group")
        self.groups = tuple(groups)
        self.chunk_tokens = int(chunk_tokens)
        self._per_chunk = tuple(g.blocks_per_chunk(self.chunk_tokens) for g in self.groups)
        self._stored = tuple(g.stored_blocks(self.chunk_tokens) for g in self.groups)
        self.positions = sum(self._stored)
        """Positions (engine blocks) of one chunk in a slot, every group together."""

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1 or self.groups[0].kind in RELEASED_KINDS

    @property
    def state_groups(self) -> tuple[int, ...]:
        """Indexes of the mamba groups: a chunk is stored only with their states."""
        return tuple(g for g, group in enumerate(self.groups) if group.kind == "mamba")

    def _table_indexes(self, g: int, chunk: int) -> range:
        end = (chunk + 1) * self._per_chunk[g]
        return range(end - self._stored[g], end)

    def store_blocks(self, tables: Sequence[Sequence[int]], chunk: int,
                     states: Mapping[int, int] | None = None, *,
                     end: int | None = None) -> tuple[int, ...] | None:
        """The engine blocks to copy chunk ``chunk`` from, or None when a block it must
        hold is not there (the null block, or past the table): such a chunk is never
        stored, not even in part. ``states``: per mamba group, the block vLLM handed
        over with the state at this chunk's end; a mamba group's block must be one of
        these, and still at its place in the table (where the fence looks for it).
        ``end``: a request tail's end token (one full-attention group only): positions
        that start at or after it are ``SKIP_BLOCK`` (their slot positions stay as they
        were; a load never reads them, ``load_blocks``' ``load_end``)."""
        if end is not None and self.hybrid:
            raise ValueError("a partial chunk is stored for one full-attention group only")
        out: list[int] = []
        for g, table in enumerate(self._check(tables)):
            for i in self._table_indexes(g, chunk):
                if end is not None and i * self.groups[g].block_size >= end:
                    out.append(SKIP_BLOCK)
                    continue
                if i >= len(table) or self._is_null(g, table[i]):
                    return None
                if self.groups[g].kind == "mamba" and (states or {}).get(g) != int(table[i]):
                    return None  # no hand-off of this exact boundary, or not that block
                out.append(int(table[i]))
        return tuple(out)

    def load_blocks(self, tables: Sequence[Sequence[int]], chunk: int, *,
                    skip_before: int, ends_load: bool = False,
                    load_end: int | None = None) -> tuple[int, ...]:
        """The engine blocks to copy chunk ``chunk`` into: ``SKIP_BLOCK`` for positions
        whose tokens end at or before ``skip_before`` (computed already), for those that
        start at or after ``load_end`` (a load that ends inside the chunk: the request
        computes them) and for null blocks. UnservableChunkError when vLLM allocated a block of the chunk that the
        stored chunk does not hold (it would stay unwritten). ``ends_load``: this chunk
        is the load's last; only then is a mamba group's state loaded (into the block
        vLLM allocated for it, which must be there), else its position is skipped."""
        out: list[int] = []
        for g, table in enumerate(self._check(tables)):
            size = self.groups[g].block_size
            stored = self._table_indexes(g, chunk)
            if self.groups[g].kind == "mamba":
                out.append(self._state_destination(g, table, chunk, stored, skip_before,
                                                   ends_load))
                continue
            for i in range(chunk * self._per_chunk[g], stored.start):  # not stored
                if (i + 1) * size > skip_before and i < len(table) \
                        and not self._is_null(g, table[i]):
                    raise UnservableChunkError(
                        f"chunk {chunk}: {self.groups[g].kind} group {g} has block "
                        f"{int(table[i])} at position {i}, which no stored chunk holds")
            for i in stored:
                if (i + 1) * size <= skip_before or i >= len(table) \
                        or self._is_null(g, table[i]) \
                        or (load_end is not None and i * size >= load_end):
                    out.append(SKIP_BLOCK)
                else:
                    out.append(int(table[i]))
        return tuple(out)

    def _state_destination(self, g: int, table: Sequence[int], chunk: int, stored: range,
                           skip_before: int, ends_load: bool) -> int:
        """A mamba group's position of a loaded chunk: the block vLLM allocated for the
        state at the load's end, or SKIP_BLOCK (see ``load_blocks``)."""
        size = self.groups[g].block_size
        for i in range(chunk * self._per_chunk[g], stored.stop):
            real = i < len(table) and not self._is_null(g, table[i])
            if (i + 1) * size <= skip_before or not real:
                continue  # computed already, or vLLM's null block
            if ends_load and i == stored.start:
                return int(table[i])
            raise UnservableChunkError(
                f"chunk {chunk}: mamba group {g} has block {int(table[i])} at position "
                f"{i}, which no stored state fills")
        if ends_load and (stored.start + 1) * size > skip_before:
            raise UnservableChunkError(
                f"chunk {chunk}: mamba group {g} has no block for the state the load "
                f"ends with")
        return SKIP_BLOCK

    @property
    def released_positions(self) -> tuple[tuple[int, int], ...]:
        """(position in a chunk's ``block_ids``, group) of the positions that belong to
        sliding-window and mamba groups: blocks vLLM frees while their request still
        runs (``RELEASED_KINDS``)."""
        out: list[tuple[int, int]] = []
        start = 0
        for g, (group, stored) in enumerate(zip(self.groups, self._stored)):
            if group.kind in RELEASED_KINDS:
                out.extend((p, g) for p in range(start, start + stored))
            start += stored
        return tuple(out)

    def _is_null(self, g: int, block: int) -> bool:
        return self.groups[g].kind in RELEASED_KINDS and int(block) == NULL_BLOCK

    def _check(self, tables: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        if len(tables) != len(self.groups):
            raise ValueError(f"{len(tables)} block tables for {len(self.groups)} KV cache "
                             f"groups")
        return tables
