"""What the remote tier stores: key names and self-describing values.

Pure: no I/O. A value is a 40-byte header followed by one chunk of one rank::

    magic "KVOR" | format u16 | header bytes u16 | payload bytes u64
    | xxh3_64(payload) u64 | xxh3_128(key name)[:16]

Reading verifies every field, so a value written by another format version, truncated
by the server, or stored under the wrong key is a miss (never loaded).

A request tail's value is a chunk value like any other (a whole host slot, under the
tail's key); its *record* (``tails_name``: a hash per parent, one field per tail key) says
which tokens it holds, so that a lookup finds it from its parent.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kv_offload.checksum import checksum

if TYPE_CHECKING:
    from typing_extensions import Buffer

MAGIC = b"KVOR"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQQ16s")
HEADER_BYTES = _HEADER.size
_TAIL_STAMP = struct.Struct("<Q")
MAX_TAIL_TOKENS = 1 << 20  # a tail is shorter than a chunk; more is not a record of ours


class ValueCheck(enum.Enum):
    """Outcome of verifying a fetched value; only OK is loadable."""

    OK = "ok"
    MISSING = "missing"  # no such key (evicted, expired, server restarted)
    BAD_FORMAT = "bad_format"  # not a kv-offload value, or another format version
    WRONG_KEY = "wrong_key"  # a value stored under a different key name
    BAD_LENGTH = "bad_length"
    BAD_CHECKSUM = "bad_checksum"

    def __bool__(self) -> bool:
        return self is ValueCheck.OK


def key_name(prefix: str, namespace: str, chunk_key: bytes, rank: int, num_ranks: int) -> bytes:
    """The Redis key of one chunk on one rank.

    The braces are a Redis Cluster hash tag over namespace and chunk: every rank's part
    of a chunk lands on the same node (one multi-key EXISTS checks them all) while
    different chunks spread over the nodes.
    """
    return f"{prefix}:{{{namespace}:{chunk_key.hex()}}}:r{rank}of{num_ranks}".encode()


def tails_name(prefix: str, namespace: str, parent: bytes) -> bytes:
    """The key of the hash holding the request tails stored under ``parent``
    (``scheduler/tails.py``): one field per tail key, its value a ``tail record``. The
    hash tag is the parent chunk's, so the records sit on that chunk's cluster node."""
    return f"{prefix}:{{{namespace}:{parent.hex()}}}:tails".encode()


def encode_tail_record(stamp: int, tokens: Sequence[int]) -> bytes:
    """A tail record: when it was written (``stamp``, ns since the epoch: orders the
    records of a parent, oldest replaced first) and the tail's token ids, int32 LE."""
    return _TAIL_STAMP.pack(stamp) + struct.pack(f"<{len(tokens)}i", *tokens)


def decode_tail_record(value: bytes) -> tuple[int, tuple[int, ...]] | None:
    """(stamp, token ids) of a tail record; None when it is not one (too short, not a
    whole number of tokens). Whether the tokens make the key is the caller's check."""
    body = len(value) - _TAIL_STAMP.size
    if body <= 0 or body % 4 or body > 4 * MAX_TAIL_TOKENS:
        return None
    (stamp,) = _TAIL_STAMP.unpack_from(value)
    return stamp, struct.unpack_from(f"<{body // 4}i", value, _TAIL_STAMP.size)


def meta_key(prefix: str, namespace: str) -> bytes:
    """The key of a namespace's descriptor (model, layout), for ``inspect --remote``."""
    return f"{prefix}:meta:{namespace}".encode()


def namespace_pattern(prefix: str, namespace: str | None = None) -> bytes:
    """A SCAN MATCH pattern for every chunk key of the namespaces whose id starts with
    ``namespace`` (all namespaces when None)."""
    return f"{prefix}:{{{namespace or ''}*".encode()


def encode_header(name: bytes, payload: Buffer) -> bytes:
    """The header for ``payload`` (any contiguous buffer) stored under key ``name``."""
    view = memoryview(payload).cast("B")
    return _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, len(view), checksum(view),
                        _key_digest(name))


def check_value(name: bytes, value: bytes | memoryview | None, payload_bytes: int,
                *, verify_checksum: bool = True) -> ValueCheck:
    """Verify ``value`` fetched under ``name`` for a payload of ``payload_bytes``."""
    if value is None:
        return ValueCheck.MISSING
    view = memoryview(value)
    result, expected = check_header(name, view[:HEADER_BYTES], len(view), payload_bytes)
    if result is not ValueCheck.OK:
        return result
    if verify_checksum and checksum(view[HEADER_BYTES:]) != expected:
        return ValueCheck.BAD_CHECKSUM
    return ValueCheck.OK


def check_header(name: bytes, head: bytes | bytearray | memoryview, value_bytes: int,
                 payload_bytes: int) -> tuple[ValueCheck, int]:
    """Verify the header ``head`` of a value of ``value_bytes`` bytes stored under
    ``name`` before its payload is read; (outcome, the payload's expected checksum).

    Lets a reader reject a foreign, truncated or misplaced value before it writes a
    single payload byte into a host slot."""
    if len(head) < HEADER_BYTES or value_bytes < HEADER_BYTES:
        return ValueCheck.BAD_FORMAT, 0
    magic, version, header_bytes, length, expected, digest = _HEADER.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        return ValueCheck.BAD_FORMAT, 0
    if digest != _key_digest(name):
        return ValueCheck.WRONG_KEY, 0
    if length != payload_bytes or value_bytes != HEADER_BYTES + payload_bytes:
        return ValueCheck.BAD_LENGTH, 0
    return ValueCheck.OK, expected


def _key_digest(name: bytes) -> bytes:
    return xxhash.xxh3_128_digest(name)
