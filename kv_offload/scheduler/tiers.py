"""What the planner needs of its collaborators: requests, the disk index, the remote tier.

Protocols only (the planner imports neither vLLM nor the disk or remote packages at run
time): ``kv_offload.disk.DiskIndex`` and ``kv_offload.remote.RemoteTier`` satisfy them,
and so do the fakes of the unit tests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol


class RequestLike(Protocol):
    """A vLLM request as the planner reads it (read-only: the planner never sets these)."""

    @property
    def request_id(self) -> str: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class DiskEntryLike(Protocol):
    """A committed disk chunk (``kv_offload.disk.DiskEntry``)."""

    @property
    def key(self) -> bytes: ...

    @property
    def slot(self) -> int: ...

    @property
    def checksums(self) -> tuple[int, ...]: ...


class DiskIndexLike(Protocol):
    """The disk tier's index (``kv_offload.disk.DiskIndex``): which key lives in which
    slot. Any method may raise ``StoreError`` (see ``DiskTier``)."""

    def find_prefix(self, keys: Sequence[bytes]) -> Sequence[DiskEntryLike]: ...

    def count_lookup(self, *, hits: int, misses: int) -> None: ...

    def pin(self, slots: Sequence[int]) -> None: ...

    def unpin(self, slots: Sequence[int]) -> None: ...

    def allocate(self, keys: Sequence[bytes]) -> list[int | None]: ...

    def commit(self, items: Sequence[tuple[bytes, int, tuple[int, ...]]]) -> list[bool]: ...

    def release(self, slots: Sequence[int]) -> None: ...

    def settle(self, commits: Sequence[tuple[bytes, int, tuple[int, ...]]] = (),
               releases: Sequence[int] = (), keys: Sequence[bytes] = (),
               blocks: Mapping[bytes, bytes] | None = None,
               tails: Mapping[bytes, tuple[bytes, Sequence[int]]] | None = None
               ) -> tuple[list[bool], list[int | None]]: ...

    def tails_of(self, parent: bytes) -> list[tuple[bytes, tuple[int, ...]]]: ...

    # The KV events of the disk tier (``scheduler/events.py``): only used when they are on.
    track_removed: bool

    def take_removed(self) -> list[tuple[bytes, bytes | None]]: ...

    def read_blocks(self, after: bytes, limit: int) -> list[tuple[bytes, bytes | None]]: ...

    def drop(self, key: bytes, slot: int) -> bool: ...

    def flush_access(self) -> None: ...

    def num_pending_accesses(self) -> int: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


class RemoteHealthLike(Protocol):
    """Failures of the remote tier so far, and whether it is usable now."""

    @property
    def num_failures(self) -> int: ...

    @property
    def up(self) -> bool: ...


class RemoteLookupsLike(Protocol):
    """Asynchronous remote lookups (``kv_offload.remote.RemoteLookups``): never block."""

    @property
    def num_timeouts(self) -> int: ...

    def ask(self, req_id: str, keys: Sequence[bytes]) -> int | None: ...

    def forget(self, req_id: str) -> None: ...

    def close(self) -> None: ...


class RemoteTierLike(Protocol):
    """The remote tier as the scheduler uses it (``kv_offload.remote.RemoteTier``)."""

    @property
    def health(self) -> RemoteHealthLike: ...

    def async_lookups(self, *, clock: Callable[[], float]) -> RemoteLookupsLike: ...

    def close(self) -> None: ...
