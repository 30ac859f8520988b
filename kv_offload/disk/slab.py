"""Worker side of the disk tier: one slab file per rank, fixed-size slots, pread/pwrite.

Layout: ``<root>/slabs/<namespace_id>/rank<r>-of-<n>.slab``; slot ``s`` lives at byte
offset ``s * slot_bytes``. Files are sparse and grow on write. Only the namespace id (hex,
validated) and the rank go into paths, never a key. No lmdb, torch or vLLM in here; the
store's paths, its marker and how its files are opened: files.py.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kv_offload.checksum import checksum, new_hasher
from kv_offload.disk.errors import StorePathError
from kv_offload.disk.files import (
    check_dir,
    check_private,
    ensure_marker,
    make_private_dirs,
    open_file,
    slab_path,
    validate_namespace_id,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

logger = logging.getLogger(__name__)

# I/O goes in pieces, each hashed right after it is read (writes: right before it is
# written). Reads: 128 KiB to 2 MiB pieces, or one preadv of the whole slot then one
# hash, all ran within noise of each other (0.82-0.90x a raw read, docs/disk-tier.md), so
# reads keep 256 KiB pieces, each still in L2 (1 MiB per core here) when it is hashed.
# Writes: 2 MiB pieces. Each pwritev into ext4's page cache pays a per-call cost (inode
# lock, timestamps); 256 KiB pieces wrote at 0.74-0.82x a raw file, 2 MiB pieces at
# 0.86-0.92x (interleaved A/B runs, issue 15, docs/disk-tier.md). ``write_many`` gives
# runs of consecutive slots smaller than that one pwritev per 2 MiB too.
_READ_PIECE = 256 << 10
_WRITE_PIECE = 2 << 20
_MAX_FILE_BYTES = (1 << 63) - 1  # off_t: a slot past it is a damaged record, not a slot


class ReadResult(enum.Enum):
    """Outcome of SlabFile.read; truthy only for OK. Every other value is a miss."""

    OK = "ok"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    SHORT_READ = "short_read"  # slab truncated or slot never written
    MISSING = "missing"  # slab file deleted
    IO_ERROR = "io_error"

    def __bool__(self) -> bool:
        return self is ReadResult.OK


def _as_bytes_view(buf: Buffer, slot_bytes: int, *, writable: bool) -> memoryview:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError("slot buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("read() needs a writable slot buffer")
    view = view.cast("B")
    if view.nbytes != slot_bytes:
        raise ValueError(f"slot buffer has {view.nbytes} bytes, expected {slot_bytes}")
    return view


class SlabFile:
    """One rank's slab of one namespace: write and read whole slots.

    Thread-safe: any number of threads may read and write *different* slots at once
    (positional I/O on one descriptor). Each call checks that the path still names the
    open file; if the slab was deleted or replaced it reopens (write) or reports MISSING
    (read), so it never serves bytes of a file the index no longer describes. Old
    descriptors are retired, not closed, until close(), so a concurrent call never sees
    a reused descriptor number. close() must not race with I/O (join the pool first).

    The constructor creates the directories (0700), the store marker and the sparse file
    (0600); it raises StorePathError if they cannot be created, if a link, directory or
    special file holds a path of them (none is followed), or, unless
    ``allow_unsafe_permissions``, they belong to another user or are writable by group or
    others; ValueError for bad arguments. ``readonly`` (kv-offload verify) creates and
    writes nothing: the file is opened for reading if it exists (else every read is
    MISSING) and ``write`` raises ValueError.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        namespace_id: str,
        rank: int,
        num_ranks: int,
        slot_bytes: int,
        fsync: bool = False,
        allow_unsafe_permissions: bool = False,
        readonly: bool = False,
    ) -> None:
        if not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks!r}")
        if not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, {num_ranks}), got {rank!r}")
        if not isinstance(slot_bytes, int) or slot_bytes < 1:
            raise ValueError(f"slot_bytes must be >= 1, got {slot_bytes!r}")
        self._root = Path(root)
        self._namespace_id = validate_namespace_id(namespace_id)
        self._slot_bytes = slot_bytes
        self._fsync = fsync
        self._allow_unsafe = allow_unsafe_permissions
        self._readonly = readonly
        self.path = slab_path(root, namespace_id, rank, num_ranks)
        self._lock = threading.Lock()
        self._retired: list[int] = []
        self._fd = -1
        self._ino: tuple[int, int] = (0, 0)
        with self._lock:
            self._reopen_locked(create=not readonly)

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def write(self, slot: int, buf: Buffer) -> int:
        """Write the whole slot from ``buf`` and return the checksum of the bytes written.

        ``buf`` is a C-contiguous buffer of exactly ``slot_bytes`` (a memoryview of a host
        slot); it is written in place, without copies. Loops on short writes; with
        ``fsync=True`` the data is fdatasync'ed before returning. Raises OSError (ENOSPC,
        EIO...): the caller must then release the slot and not publish it.
        """
        return self.write_many([slot], [buf])[0]

    def write_many(self, slots: Sequence[int], bufs: Sequence[Buffer]) -> list[int]:
        """Write each slot from its buffer (as ``write``) and return their checksums.

        Slots smaller than 2 MiB that are consecutive (in any order of ``slots``) go out
        together, one ``pwritev`` per 2 MiB, each buffer hashed just before; with
        ``fsync=True`` one fdatasync at the end. Raises OSError as ``write`` does: then
        no slot of the call may be published (``write`` each to learn which failed).
        """
        if len(slots) != len(bufs):
            raise ValueError(f"{len(slots)} slots but {len(bufs)} buffers")
        if self._readonly:
            raise ValueError(f"write to read-only SlabFile {self.path}")
        views = [_as_bytes_view(b, self._slot_bytes, writable=False) for b in bufs]
        offsets = [self._offset(slot) for slot in slots]
        fd = self._current_fd(create=True)
        sums = [0] * len(views)
        if self._slot_bytes >= _WRITE_PIECE:
            for i, (view, offset) in enumerate(zip(views, offsets)):
                hasher = new_hasher()
                for start in range(0, view.nbytes, _WRITE_PIECE):
                    piece = view[start : start + _WRITE_PIECE]
                    hasher.update(piece)
                    self._pwrite_all(fd, [piece], offset + start)
                sums[i] = hasher.intdigest()
        else:
            per_call = _WRITE_PIECE // self._slot_bytes
            order = sorted(range(len(views)), key=offsets.__getitem__)
            start = 0
            while start < len(order):
                end = start + 1
                while (end < len(order) and end - start < per_call
                       and offsets[order[end]] == offsets[order[end - 1]] + self._slot_bytes):
                    end += 1
                run = order[start:end]
                for i in run:
                    sums[i] = checksum(views[i])
                self._pwrite_all(fd, [views[i] for i in run], offsets[run[0]])
                start = end
        if self._fsync:
            os.fdatasync(fd)
        return sums

    def _pwrite_all(self, fd: int, views: list[memoryview], offset: int) -> None:
        """``pwritev`` until every byte of ``views`` is written at ``offset``."""
        while views:
            n = os.pwritev(fd, views, offset)
            if n <= 0:
                raise OSError(errno.EIO, f"pwritev wrote {n} bytes to {self.path}")
            offset += n
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views = views[1:]
            if views and n:
                views = [views[0][n:], *views[1:]]

    def read(self, slot: int, buf: Buffer, expected_checksum: int | None) -> ReadResult:
        """Read the whole slot into ``buf`` and verify it against ``expected_checksum``.

        Returns ReadResult.OK (truthy) only when every byte was read and the checksum
        matches (``expected_checksum=None`` skips verification: the operator turned
        ``verify_checksums`` off); any other result is a miss and the contents of ``buf`` are undefined.
        I/O errors are reported as IO_ERROR, not raised. ``buf`` must be writable,
        C-contiguous and exactly ``slot_bytes`` long.
        """
        view = _as_bytes_view(buf, self._slot_bytes, writable=True)
        offset = self._offset(slot)
        try:
            fd = self._current_fd(create=False)
            if fd < 0:
                return ReadResult.MISSING
            hasher = new_hasher() if expected_checksum is not None else None
            for start in range(0, view.nbytes, _READ_PIECE):
                piece = view[start : start + _READ_PIECE]
                done = 0
                while done < piece.nbytes:
                    n = os.preadv(fd, [piece[done:]], offset + start + done)
                    if n == 0:
                        return ReadResult.SHORT_READ
                    done += n
                if hasher is not None:
                    hasher.update(piece)
        except (OSError, StorePathError) as exc:  # StorePathError: a link planted in its place
            logger.warning("disk tier: reading slot %d of %s failed: %s", slot, self.path, exc)
            return ReadResult.IO_ERROR
        if hasher is not None and hasher.intdigest() != expected_checksum:
            return ReadResult.CHECKSUM_MISMATCH
        return ReadResult.OK

    def close(self) -> None:
        """Close every descriptor; later calls raise ValueError. Idempotent."""
        with self._lock:
            for fd in (*self._retired, self._fd):
                if fd >= 0:
                    os.close(fd)
            self._retired.clear()
            self._fd = -2

    def __enter__(self) -> SlabFile:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _offset(self, slot: int) -> int:
        if not isinstance(slot, int) or slot < 0:
            raise ValueError(f"slot must be a non-negative int, got {slot!r}")
        if (slot + 1) * self._slot_bytes > _MAX_FILE_BYTES:
            raise ValueError(f"slot {slot} lies beyond the largest file offset")
        return slot * self._slot_bytes

    def _current_fd(self, *, create: bool) -> int:
        """Descriptor of the file the path names now; -1 if it is gone and not created.

        The path is looked up on every call (``lstat``, ~2-3 us: a link planted in its
        place is a new file, which ``open_file`` refuses). The open file's own link
        count (``fstat``) cannot replace it: a store moved away or a slab file system
        lazily unmounted (``umount -l``) and then deleted leaves the open file linked and
        readable while the path names nothing, and its bytes would still be served."""
        if self._fd == -2:
            raise ValueError(f"I/O on closed SlabFile {self.path}")
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._ino:
                return self._fd
        except FileNotFoundError:
            if not create:
                return -1
        with self._lock:
            if self._fd == -2:
                raise ValueError(f"I/O on closed SlabFile {self.path}")
            return self._reopen_locked(create=create)

    def _reopen_locked(self, *, create: bool) -> int:
        create = create and not self._readonly
        if create:
            make_private_dirs(self._root, "slabs", self._namespace_id,
                              allow_unsafe_permissions=self._allow_unsafe)
            ensure_marker(self._root)
        else:  # no link on the way either (make_private_dirs checks that when creating)
            check_dir(self.path.parent.parent)
            check_dir(self.path.parent)
        try:
            fd = open_file(self.path, os.O_RDONLY if self._readonly else os.O_RDWR,
                           create=create)
        except (FileNotFoundError, NotADirectoryError):
            if create:
                raise
            return -1
        st = os.fstat(fd)
        try:
            check_private(self.path, st, allow_unsafe=self._allow_unsafe)
        except StorePathError:
            os.close(fd)
            raise
        if (st.st_dev, st.st_ino) == self._ino:  # another thread reopened already
            os.close(fd)
            return self._fd
        if self._fd >= 0:
            logger.warning("disk tier: slab %s was replaced or deleted; reopened", self.path)
            self._retired.append(self._fd)
        self._fd, self._ino = fd, (st.st_dev, st.st_ino)
        return fd
