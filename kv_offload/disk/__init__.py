"""Disk tier: an LMDB index (scheduler side) over per-rank slab files (worker side).

``DiskIndex`` decides which key lives in which slot; ``SlabFile`` moves a slot's bytes.
See docs/disk-tier.md for the store layout, crash safety and sharing rules.
"""

from kv_offload.disk.errors import (
    NamespaceMismatchError,
    StoreCorruptError,
    StoreError,
    StorePathError,
    StoreVersionError,
)
from kv_offload.disk.index import DiskEntry, DiskIndex, clear, iter_entries, list_namespaces
from kv_offload.disk.slab import ReadResult, SlabFile

__all__ = [
    "DiskEntry",
    "DiskIndex",
    "NamespaceMismatchError",
    "ReadResult",
    "SlabFile",
    "StoreCorruptError",
    "StoreError",
    "StorePathError",
    "StoreVersionError",
    "clear",
    "iter_entries",
    "list_namespaces",
]
