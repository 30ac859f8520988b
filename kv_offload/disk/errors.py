"""Exceptions of the disk tier: a broken environment, never an expected outcome.

Misses, "no room" and checksum mismatches are return values. These exceptions mean the
store itself cannot be used as asked; every message names the problem and the fix.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class: the disk store cannot be used (path, version, corruption, layout)."""


class StorePathError(StoreError):
    """The store path is not a usable directory (a file, not writable, not a store)."""


class StoreVersionError(StoreError):
    """The store was written by a newer, incompatible format version of kv-offload."""


class StoreCorruptError(StoreError):
    """The LMDB index is unreadable; the store must be cleared."""


class NamespaceMismatchError(StoreError):
    """A namespace id exists with a different slot size or rank count."""
