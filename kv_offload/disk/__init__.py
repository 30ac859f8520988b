"""Disk tier: an LMDB index (scheduler side) over per-rank slab files (worker side).

``DiskIndex`` decides which key lives in which slot; ``SlabFile`` moves a slot's bytes;
the administration helpers list, verify and clear stores. Modules: ``records`` (the
codec of each on-disk record), ``env`` (this process's LMDB environments and their
transactions), ``namespace`` (the record changes of one namespace in a transaction),
``owners`` (who holds a reservation), ``index``, ``slab``, ``admin``, ``errors``.
See docs/disk-tier.md for the store layout, crash safety and sharing rules.
"""

from typing import TYPE_CHECKING, Any

from kv_offload.disk.errors import (
    NamespaceMismatchError,
    StoreCorruptError,
    StoreError,
    StorePathError,
    StoreVersionError,
)

if TYPE_CHECKING:
    from kv_offload.disk.admin import clear, iter_entries, list_namespaces
    from kv_offload.disk.index import DiskIndex
    from kv_offload.disk.records import DiskEntry
    from kv_offload.disk.slab import ReadResult, SlabFile

# Loaded on first use: importing the errors (the scheduler does) needs no lmdb.
_LAZY = {
    "clear": "kv_offload.disk.admin", "iter_entries": "kv_offload.disk.admin",
    "list_namespaces": "kv_offload.disk.admin", "DiskIndex": "kv_offload.disk.index",
    "DiskEntry": "kv_offload.disk.records", "ReadResult": "kv_offload.disk.slab",
    "SlabFile": "kv_offload.disk.slab",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
