"""Fast non-cryptographic checksum of a KV slot.

xxh3_64 was chosen by measurement (docs/disk-tier.md): on this project's reference
machine it hashes ~50-60 GB/s on one core (the xxhash wheel dispatches to AVX2/AVX-512 at
run time), against ~10 GB/s for xxh64 and ~3.5 GB/s for zlib.crc32. A page-cache read
copies ~6-12 GB/s, so verifying adds ~10-20% to a warm read and a few percent to a read
from disk. The xxhash package releases the GIL while it hashes a large buffer (over
64 KiB in 4.x, 100 kB before), so I/O threads hash in parallel. It only guards against
torn, stale or corrupted bytes; it is not a defence against an adversary who can write
the store.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer

CHECKSUM_ALGORITHM = "xxh3_64"


def checksum(buf: Buffer) -> int:
    """Return the xxh3_64 digest of ``buf`` as an unsigned 64-bit int.

    ``buf`` is any C-contiguous buffer-protocol object (bytes, memoryview of a numpy or
    torch host slot); it is read in place, never copied. Pure; safe from any thread.
    """
    return xxhash.xxh3_64_intdigest(buf)


def new_hasher() -> xxhash.xxh3_64:
    """A streaming hasher: ``update(piece)`` per piece, then ``intdigest()`` equals
    ``checksum`` of the concatenated pieces. Lets I/O hash each piece while it is still
    in the CPU cache. One per thread; not shared."""
    return xxhash.xxh3_64()
