"""TierEvents: what routers learn of the tiers, as vLLM's KV events in its block hash space.

Routers (llm-d, Dynamo, vLLM's router work) index vLLM's ``BlockStored``/``BlockRemoved``
events to send a prompt where its KV is. kv-offload announces a chunk when it becomes
loadable from a tier and withdraws it when it stops being loadable, at vLLM's block
granularity, with the block hashes, parent hash, token ids, LoRA and extra keys vLLM's own
GPU events carry for the same blocks, so a router's index of both lines up.

Pure: no vLLM, no I/O. The planner captures each chunk's ``ChunkBlocks`` from its request
(``capture``) when it plans a store or a load; the tiers report what became loadable and
what stopped (``stored``/``removed``); ``take`` hands out ``TierEvent`` values, which
``kv_offload/plugin/kv_events.py`` turns into vLLM's event classes. The queue is bounded: past
``max_queued`` an event is dropped, counted (``kv_offload_kv_events_dropped_total``) and logged, and serving never
waits. Scheduler thread only.

Tiers, as vLLM's events name them (``medium``, ``locality``, ``ownership``):

    CPU     CPU      LOCAL   (none)   the host-RAM tier
    DISK    STORAGE  LOCAL   disk     the disk store, also what it held before a restart
    REMOTE  CPU      REMOTE  remote   the shared Redis/Valkey: any instance sharing it can
                                      load these blocks

A chunk's payload is kept while the CPU tier holds it (for its removal), for the last
``max_payloads`` captures (a store's disk and remote writes end after its CPU copy), and,
for the remote tier, for the last ``max_remote`` chunks it announced (their removal when
the tier is turned off). The disk tier keeps each committed chunk's payload in its index
(``encode``/``decode``): its evictions and a restart's announcement read it from there.
"""

from __future__ import annotations

import enum
import json
import logging
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_offload.counters import SchedulerCounters
from kv_offload.keys import ChunkKey

logger = logging.getLogger(__name__)

MAX_QUEUED = 16384
"""Chunk events queued at most between two ``take`` calls (one per engine step)."""
MAX_PAYLOADS = 65536
MAX_REMOTE = 65536
ANNOUNCE_BATCH = 64
"""Disk chunks a restart announces per engine step (one short LMDB read each batch)."""


class Tier(enum.Enum):
    """Where a chunk is loadable from: (medium, locality, ownership) of vLLM's events."""

    CPU = ("CPU", "LOCAL", None)
    DISK = ("STORAGE", "LOCAL", "disk")
    REMOTE = ("CPU", "REMOTE", "remote")

    @property
    def medium(self) -> str:
        return self.value[0]

    @property
    def locality(self) -> str:
        return self.value[1]

    @property
    def ownership(self) -> str | None:
        return self.value[2]


@dataclass(frozen=True, slots=True)
class ChunkBlocks:
    """What a ``BlockStored`` of one chunk carries: its vLLM blocks' hashes (the last one
    is the chunk key), the hash of the block before it (None for the first chunk), its
    token ids, tokens per block, the LoRA adapter and vLLM's per-block extra keys (None,
    or one entry per block, as ``to_event_extra_keys`` publishes them)."""

    block_hashes: tuple[bytes, ...]
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None


@dataclass(frozen=True, slots=True)
class TierEvent:
    """One chunk became loadable from ``tier`` (``blocks`` set) or stopped being
    loadable (``blocks`` None: ``block_hashes`` only)."""

    tier: Tier
    block_hashes: tuple[bytes, ...]
    blocks: ChunkBlocks | None

    @property
    def stored(self) -> bool:
        return self.blocks is not None


ExtraKeysOf = Callable[[Any, int, int], "tuple[Any, ...] | None"]
"""vLLM's extra keys of one block of a request (request, first token, end token)."""


def chunk_blocks(request: Any, chunk: int, *, chunk_tokens: int, block_size: int,
                 extra_keys_of: ExtraKeysOf | None = None) -> ChunkBlocks | None:
    """The ``ChunkBlocks`` of chunk ``chunk`` of ``request`` (``block_hashes`` at
    ``block_size`` tokens per hash, ``all_token_ids``, ``lora_request``); None when the
    request does not hold that chunk's hashes and tokens. Reads only its arguments."""
    per = chunk_tokens // block_size
    first = chunk * per
    hashes = request.block_hashes
    tokens = getattr(request, "all_token_ids", None)
    start, end = chunk * chunk_tokens, (chunk + 1) * chunk_tokens
    if len(hashes) < first + per or tokens is None or len(tokens) < end:
        return None
    lora = getattr(request, "lora_request", None)
    extra = None
    if extra_keys_of is not None:
        keys = tuple(extra_keys_of(request, start + i * block_size, start + (i + 1) * block_size)
                     for i in range(per))
        extra = keys if any(k is not None for k in keys) else None
    return ChunkBlocks(
        tuple(bytes(h) for h in hashes[first:first + per]),
        bytes(hashes[first - 1]) if first else None,
        tuple(int(t) for t in tokens[start:end]), block_size,
        getattr(lora, "adapter_id", None) if lora is not None else None,
        getattr(lora, "name", None) if lora is not None else None, extra)


# -- the disk tier's record of a chunk's payload ---------------------------------------------

_HEAD = struct.Struct("<BHHI")  # version, hash bytes, blocks, tokens
_RECORD_VERSION = 1


def encode(blocks: ChunkBlocks) -> bytes:
    """The disk index's record of ``blocks`` (``decode`` reads it back): a head, the
    parent and block hashes, the token ids (u32) and a JSON tail (block size, LoRA,
    extra keys). b"" for what it cannot hold (an extra key of an unknown type): that
    chunk is then not announced after a restart."""
    width = len(blocks.block_hashes[0])
    try:
        tail = json.dumps([blocks.block_size, blocks.lora_id, blocks.lora_name,
                           _tagged(blocks.extra_keys)], separators=(",", ":")).encode()
        tokens = struct.pack(f"<{len(blocks.token_ids)}I", *blocks.token_ids)
    except (TypeError, ValueError, struct.error):
        return b""
    return b"".join([
        _HEAD.pack(_RECORD_VERSION, width, len(blocks.block_hashes), len(blocks.token_ids)),
        blocks.parent_hash or b"\0" * width, b"\1" if blocks.parent_hash else b"\0",
        *blocks.block_hashes, tokens, tail])


def decode(raw: bytes | None) -> ChunkBlocks | None:
    """``ChunkBlocks`` from a record ``encode`` wrote; None for a missing or malformed
    one (a record read from disk is checked before it is trusted: invariant 9)."""
    if raw is None or len(raw) < _HEAD.size:
        return None
    try:
        version, width, num_blocks, num_tokens = _HEAD.unpack_from(raw)
        at = _HEAD.size
        if version != _RECORD_VERSION or not width or not num_blocks:
            return None
        parent, has_parent = raw[at:at + width], raw[at + width]
        at += width + 1
        hashes = tuple(raw[at + i * width:at + (i + 1) * width] for i in range(num_blocks))
        at += width * num_blocks
        tokens = struct.unpack_from(f"<{num_tokens}I", raw, at)
        at += 4 * num_tokens
        size, lora_id, lora_name, extra = json.loads(raw[at:])
        extra = _untagged(extra)
        if (len(hashes[-1]) != width or not isinstance(size, int) or size <= 0
                or num_tokens != size * num_blocks or has_parent not in (0, 1)
                or not isinstance(lora_id, int | None) or not isinstance(lora_name, str | None)
                or not isinstance(extra, tuple | None)
                or (extra is not None and len(extra) != num_blocks)):
            return None
        return ChunkBlocks(hashes, parent if has_parent else None, tokens, size, lora_id,
                           lora_name, extra)
    except (struct.error, ValueError, TypeError, IndexError, AttributeError):
        return None


def _tagged(value: Any) -> Any:
    """``value`` (extra keys: tuples of str, int, bytes and tuples, or None) as JSON:
    a tuple as {"t": [...]}, bytes (prompt-embedding digests) as {"b": hex}."""
    if isinstance(value, tuple):
        return {"t": [_tagged(v) for v in value]}
    if isinstance(value, bytes):
        return {"b": value.hex()}
    if value is None or isinstance(value, str | int | float):
        return value
    raise TypeError(f"extra key of type {type(value).__name__}")


def _untagged(value: Any) -> Any:
    """``_tagged`` undone (ValueError, TypeError or AttributeError for a damaged one)."""
    if isinstance(value, dict):
        ((tag, inner),) = value.items()
        if tag == "t":
            return tuple(_untagged(v) for v in inner)
        if tag == "b":
            return bytes.fromhex(inner)
        raise ValueError(f"unknown tag {tag!r}")
    if isinstance(value, list):
        raise ValueError("an untagged list")
    return value


class TierEvents:
    """The bounded queue of tier events and the chunk payloads they need (see the module
    docstring). Scheduler thread only."""

    def __init__(self, *, chunk_tokens: int, block_size: int,
                 extra_keys_of: ExtraKeysOf | None = None, max_queued: int = MAX_QUEUED,
                 max_payloads: int = MAX_PAYLOADS, max_remote: int = MAX_REMOTE,
                 counters: SchedulerCounters | None = None) -> None:
        if chunk_tokens % block_size:
            raise ValueError(f"chunk_tokens={chunk_tokens} is not a multiple of the block "
                             f"size {block_size}")
        self.chunk_tokens, self.block_size = chunk_tokens, block_size
        self._extra_keys_of = extra_keys_of
        self._max_queued, self._max_payloads, self._max_remote = (
            max_queued, max_payloads, max_remote)
        self._queue: deque[TierEvent] = deque()
        self._captured: OrderedDict[ChunkKey, ChunkBlocks] = OrderedDict()
        self._cpu: dict[ChunkKey, tuple[bytes, ...]] = {}
        self._remote: OrderedDict[ChunkKey, tuple[bytes, ...]] = OrderedDict()
        self.num_dropped = 0  # also in counters.kv_events_dropped
        self._counters = counters
        self.num_unknown = 0  # chunks announced without a payload (none captured): skipped
        self.num_uncaptured = 0  # payloads that could not be built (see capture)
        self._announce: Callable[[int], list[tuple[ChunkKey, ChunkBlocks | None]]] | None = None
        self._withdraw = False
        self.num_announced = 0
        self.num_not_announced = 0  # disk chunks of an older store, without a payload

    # -- payloads ---------------------------------------------------------------------------

    def capture(self, request: Any, chunks: Iterable[int], keys: Sequence[ChunkKey]) -> None:
        """Remember the payload of each chunk index of ``chunks`` of ``request``, whose key
        is ``keys[chunk]``: a store or a load of it is being planned."""
        for c in chunks:
            if c >= len(keys) or keys[c] in self._captured:
                if c < len(keys):
                    self._captured.move_to_end(keys[c])
                continue
            try:
                blocks = chunk_blocks(request, c, chunk_tokens=self.chunk_tokens,
                                      block_size=self.block_size,
                                      extra_keys_of=self._extra_keys_of)
            except Exception:  # a request vLLM's helpers cannot describe: not announced
                if not self.num_uncaptured:
                    logger.exception("kv-offload: a chunk's KV event payload could not be "
                                     "built; such chunks are not announced")
                self.num_uncaptured += 1
                continue
            if blocks is not None and blocks.block_hashes[-1] == keys[c]:
                self._captured[keys[c]] = blocks
                if len(self._captured) > self._max_payloads:
                    self._captured.popitem(last=False)

    def payload(self, key: ChunkKey) -> ChunkBlocks | None:
        """The captured payload of ``key`` (None if none was, or it aged out)."""
        return self._captured.get(key)

    # -- what the tiers report --------------------------------------------------------------

    def stored(self, tier: Tier, keys: Iterable[ChunkKey]) -> None:
        """``keys`` became loadable from ``tier``."""
        for key in keys:
            blocks = self._captured.get(key)
            if blocks is None:
                self.num_unknown += 1
                continue
            if tier is Tier.CPU:
                self._cpu[key] = blocks.block_hashes
            elif tier is Tier.REMOTE:
                self._remote[key] = blocks.block_hashes
                self._remote.move_to_end(key)
                if len(self._remote) > self._max_remote:
                    self._remote.popitem(last=False)
            self._put(TierEvent(tier, blocks.block_hashes, blocks))

    def removed(self, tier: Tier, keys: Iterable[ChunkKey]) -> None:
        """``keys`` stopped being loadable from ``tier`` (CPU and remote tier: those it
        announced; the disk tier reports payloads: ``disk_removed``)."""
        held = self._cpu if tier is Tier.CPU else self._remote if tier is Tier.REMOTE else {}
        for key in keys:
            hashes = held.pop(key, None)
            if hashes is not None:
                self._put(TierEvent(tier, hashes, None))

    def disk_stored(self, items: Iterable[tuple[ChunkKey, ChunkBlocks | None]]) -> None:
        """Disk chunks loadable now, with the payloads the index holds (None: an older
        store's chunk, not announced)."""
        for _key, blocks in items:
            if blocks is None:
                self.num_not_announced += 1
            else:
                self._put(TierEvent(Tier.DISK, blocks.block_hashes, blocks))

    def disk_removed(self, items: Iterable[tuple[ChunkKey, ChunkBlocks | None]]) -> None:
        """Disk chunks no longer loadable (evicted, dropped), with their stored payloads."""
        for _key, blocks in items:
            if blocks is not None:
                self._put(TierEvent(Tier.DISK, blocks.block_hashes, None))

    def tier_off(self, tier: Tier) -> None:
        """``tier`` is off for the rest of the run (reset, failure): every chunk it
        announced is withdrawn. For the disk tier, see ``announce_disk(removal=True)``."""
        held = self._cpu if tier is Tier.CPU else self._remote
        self.removed(tier, list(held))

    def announce_disk(self, read_batch: Callable[[int], list[tuple[ChunkKey, ChunkBlocks | None]]],
                      *, withdraw: bool = False) -> None:
        """Announce what the disk tier holds (after a restart), or with ``withdraw`` take
        it all back (the tier is off), ``ANNOUNCE_BATCH`` chunks per ``take``:
        ``read_batch(n)`` returns the next ``n`` committed chunks with their payloads ([]
        at the end). Replaces an announcement under way."""
        self._announce, self._withdraw = read_batch, withdraw

    @property
    def announcing(self) -> bool:
        return self._announce is not None

    # -- the queue ----------------------------------------------------------------------------

    def has_queued(self) -> bool:
        """Whether ``take`` has events to hand out (or a restart's announcement to make):
        vLLM keeps stepping for them."""
        return bool(self._queue) or self._announce is not None

    def take(self) -> list[TierEvent]:
        """The queued events, oldest first; then the next batch of a restart's
        announcement, if the queue has room."""
        if self._announce is not None and len(self._queue) + ANNOUNCE_BATCH <= self._max_queued:
            self._next_announcement(self._announce)
        out = list(self._queue)
        self._queue.clear()
        return out

    def _next_announcement(self, read_batch: Callable[[int], list]) -> None:
        try:
            batch = read_batch(ANNOUNCE_BATCH)
        except Exception:  # the disk tier failed: its DiskTier turns itself off and says so
            logger.exception("kv-offload: announcing the disk tier's chunks failed; stopped")
            batch = []
        if self._withdraw:
            self.disk_removed(batch)
        else:
            before = self.num_not_announced
            self.disk_stored(batch)
            self.num_announced += len(batch) - (self.num_not_announced - before)
        if not batch:
            self._announce = None
            if self._withdraw:
                return
            logger.info("kv-offload: announced the %d chunks the disk tier held at start-up "
                        "as KV events%s", self.num_announced,
                        f"; {self.num_not_announced} stored by an older kv-offload without "
                        "their block hashes were not" if self.num_not_announced else "")

    def _put(self, event: TierEvent) -> None:
        if len(self._queue) >= self._max_queued:
            self.num_dropped += 1
            if self._counters is not None:
                self._counters.kv_events_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 10000 == 0:
                logger.warning("kv-offload: %d KV events dropped so far (more than %d queued "
                               "between two engine steps); routers may see a stale view of "
                               "the tiers", self.num_dropped, self._max_queued)
            return
        self._queue.append(event)
