"""The on-disk records of the disk-tier index: one codec per LMDB record.

Pure byte packing: no lmdb, no I/O. A record read from disk is checked before anything
trusts it (invariant 9): the decoders that callers use on stored records (``parse``,
``owner``, ``unpack``) answer None, 0 or ValueError for a malformed one, never a
struct.error, and namespace.py also checks each slot against the namespace's size. ``P`` below is ``<namespace_id>/`` in ASCII; ``be64``
is 8-byte big-endian, so that cursors walk slots and ticks in order.

  meta          format_version -> b"1", created -> ISO time, checksum -> b"xxh3_64"
  namespaces    namespace_id -> pretty JSON (NamespaceRecord)
  entries       P + key -> EntryRecord <state u8, slot u64, tick u64, checksum u64 * ranks>
  slots         P + be64(slot) -> key                (every reserved or committed slot)
  lru           P + LruKey <be64(tick), be64(slot)> -> key  (committed, oldest first)
  free          P + be64(slot) -> b""                (released slots below the hwm)
  reservations  P + be64(slot) -> OwnerRecord <pid, process start, instance token, time>
  counters      P + name -> CounterRecord u64 (hwm, entries, reserved, free, hits, ...)
                P + BLOCKS_TAG + key -> a committed chunk's vLLM blocks (hashes, parent, token
                ids, LoRA, extra keys: ``scheduler/events.py`` ``encode``), what its KV events
                announce after a restart; absent for chunks an older kv-offload stored. In
                ``counters``, not a table of its own, so that older kv-offload versions keep
                opening (and clearing) the store: they read counters by name only.
                P + TAIL_TAG + u8 len + parent + key -> a committed request tail's token
                ids (u32 each; ``scheduler/tails.py``): the tails of a parent are one range
                scan (``DiskIndex.tails_of``), found again after a restart.
                P + TAIL_KEY_TAG + key -> that tail's parent, to delete both with the entry.
"""

from __future__ import annotations

import enum
import functools
import json
import struct
from typing import Any, NamedTuple, overload

FORMAT_VERSION = 1
MAX_KEY_BYTES = 64
DB_NAMES = ("meta", "namespaces", "entries", "slots", "lru", "free", "reservations", "counters")
BLOCKS_TAG = b"\0blocks\0"  # no counter name starts with NUL
TAIL_TAG = b"\0tail\0"
TAIL_KEY_TAG = b"\0tailkey\0"
PERSISTENT_COUNTERS = ("hits", "misses", "checksum_failures", "commits", "evictions", "reclaimed",
                       "bad_records")

Owner = tuple[int, int, int]  # pid, process start time (0: unknown), instance token


class EntryState(enum.IntEnum):
    """First byte of an entries record."""

    RESERVED = 0  # a slot being written: no checksums, invisible to lookups
    COMMITTED = 1  # visible to lookups


class DiskEntry(NamedTuple):
    """A committed chunk: its key, its slot (same in every rank's slab), per-rank checksums.

    Immutable and slotted. A NamedTuple rather than a frozen dataclass because lookups
    build one per hit and the tuple is twice as cheap to construct (the 5 us/key budget).
    """

    key: bytes
    slot: int
    checksums: tuple[int, ...]


class EntryRecord:
    """Codec of an ``entries`` value: <state u8, slot u64, tick u64, checksum u64 * ranks>.

    A reserved record is the 17-byte head alone; a committed one carries one checksum per
    rank, so its length alone tells a committed record of ``num_ranks`` ranks apart.
    """

    HEAD = struct.Struct("<BQQ")  # state, slot, tick

    @classmethod
    def pack(cls, state: EntryState, slot: int, tick: int,
             checksums: tuple[int, ...] | list[int] = ()) -> bytes:
        return cls.HEAD.pack(state, slot, tick) + _u64s(len(checksums)).pack(*checksums)

    @classmethod
    def head(cls, value: bytes) -> tuple[int, int, int]:
        """(state, slot, tick) of a record this process wrote; stored ones: ``parse``."""
        return cls.HEAD.unpack_from(value)

    @classmethod
    def parse(cls, value: bytes, num_ranks: int) -> tuple[EntryState, int, int] | None:
        """(state, slot, tick) of a well-formed record of ``num_ranks`` ranks: the head
        alone in state RESERVED, or the head and one checksum per rank in state
        COMMITTED. None for anything else (cut short, too long, an unknown state)."""
        if len(value) == cls.HEAD.size:
            expected = EntryState.RESERVED
        elif len(value) == cls.HEAD.size + 8 * num_ranks:
            expected = EntryState.COMMITTED
        else:
            return None
        state, slot, tick = cls.HEAD.unpack_from(value)
        return (expected, slot, tick) if state == expected else None

    @classmethod
    def checksums(cls, value: bytes) -> tuple[int, ...]:
        return _u64s((len(value) - cls.HEAD.size) // 8).unpack_from(value, cls.HEAD.size)

    @classmethod
    def with_tick(cls, value: bytes, tick: int) -> bytes:
        """The same record with a new access tick."""
        state, slot, _ = cls.HEAD.unpack_from(value)
        return cls.HEAD.pack(state, slot, tick) + value[cls.HEAD.size:]

    @staticmethod
    @functools.cache
    def committed(num_ranks: int) -> struct.Struct:
        """Lookup fast path: a Struct whose ``size`` is that of a committed record of
        ``num_ranks`` ranks and whose ``unpack_from`` gives (slot, *checksums)."""
        return struct.Struct(f"<xQ8x{num_ranks}Q")


class LruKey:
    """Codec of an ``lru`` key (without the namespace prefix): be64 tick, be64 slot."""

    STRUCT = struct.Struct(">QQ")

    @classmethod
    def pack(cls, tick: int, slot: int) -> bytes:
        return cls.STRUCT.pack(tick, slot)

    @classmethod
    def tick(cls, key: bytes, offset: int = 0) -> int:
        return cls.STRUCT.unpack_from(key, offset)[0]


class SlotKey:
    """Codec of a slot number in ``slots``, ``free`` and ``reservations`` keys: be64."""

    STRUCT = struct.Struct(">Q")

    @classmethod
    def pack(cls, slot: int) -> bytes:
        return cls.STRUCT.pack(slot)

    @classmethod
    def unpack(cls, key: bytes) -> int:
        """The slot of a key that ends with it (a ``free`` key, or an ``lru`` key); -1
        when the key is too short to hold one (a damaged record)."""
        if len(key) < 8:
            return -1
        return cls.STRUCT.unpack_from(key, len(key) - 8)[0]


class OwnerRecord:
    """Codec of a ``reservations`` value: pid, process start time, instance token, time."""

    STRUCT = struct.Struct("<QQQd")

    @classmethod
    def pack(cls, owner: Owner, reserved_at: float) -> bytes:
        return cls.STRUCT.pack(*owner, reserved_at)

    @classmethod
    def owner(cls, value: bytes) -> Owner | None:
        """The owner; None for a malformed record (its reservation is then reclaimed)."""
        if len(value) != cls.STRUCT.size:
            return None
        pid, start, token, _ = cls.STRUCT.unpack(value)
        return pid, start, token


class CounterRecord:
    """Codec of a ``counters`` value: u64 little-endian."""

    STRUCT = struct.Struct("<Q")

    @classmethod
    def pack(cls, value: int) -> bytes:
        return cls.STRUCT.pack(value)

    @classmethod
    def unpack(cls, value: bytes | None) -> int:
        """The value; 0 when absent or malformed (``check`` then reports the drift)."""
        if value is None or len(value) != cls.STRUCT.size:
            return 0
        return cls.STRUCT.unpack(value)[0]


class NamespaceRecord:
    """Codec of a ``namespaces`` value: pretty JSON with namespace_id, descriptor,
    slot_bytes, num_ranks, num_slots and created. ``unpack`` raises ValueError, naming
    the field, for a record that is not such an object, or whose slots would not fit in
    a file."""

    SIZES = ("slot_bytes", "num_ranks", "num_slots")

    @staticmethod
    def pack(record: dict) -> bytes:
        return json.dumps(record, indent=2, sort_keys=True).encode()

    @overload
    @staticmethod
    def unpack(value: bytes) -> dict[str, Any]: ...
    @overload
    @staticmethod
    def unpack(value: None) -> None: ...
    @overload
    @staticmethod
    def unpack(value: bytes | None) -> dict[str, Any] | None: ...
    @staticmethod
    def unpack(value: bytes | None) -> dict[str, Any] | None:
        if value is None:
            return None
        try:
            record = json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        for name in NamespaceRecord.SIZES:
            n = record.get(name)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name} is {n!r}, not a positive integer")
        if record["num_slots"] * record["slot_bytes"] >= 1 << 63:
            raise ValueError(f"num_slots {record['num_slots']} x slot_bytes "
                             f"{record['slot_bytes']} exceeds the largest file")
        if not isinstance(record.get("descriptor"), dict):
            raise ValueError("descriptor is not an object")
        return record


def namespace_prefix(namespace_id: str) -> bytes:
    """``P``: the prefix of every key of the namespace in the shared sub-databases."""
    return namespace_id.encode("ascii") + b"/"


def check_key(key: bytes) -> None:
    """TypeError/ValueError unless ``key`` is a chunk key that fits a record."""
    if not isinstance(key, bytes):
        raise TypeError(f"chunk keys must be bytes, got {type(key).__name__}")
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"chunk keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


@functools.cache
def _u64s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}Q")
