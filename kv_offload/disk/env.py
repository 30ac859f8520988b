"""This process's LMDB environment of each disk store, and its transactions.

LMDB forbids opening one environment twice in a process, so every DiskIndex (and every
administration helper) of a store in this process shares one ``StoreEnv`` from the
registry (``acquire_env`` / ``release_env``). Every transaction runs under the
environment's lock, through ``StoreEnv.transaction``. Administration helpers that only
read (kv-offload inspect, verify) open a read-only environment, which writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeVar

import lmdb

from kv_offload.checksum import CHECKSUM_ALGORITHM
from kv_offload.disk.errors import (
    StoreCorruptError,
    StoreError,
    StorePathError,
    StoreVersionError,
)
from kv_offload.disk.files import (
    DIR_MODE,
    INDEX_FILES,
    check_dir,
    check_file,
    check_private,
    ensure_marker,
    make_private_dirs,
)
from kv_offload.disk.records import DB_NAMES, FORMAT_VERSION

logger = logging.getLogger(__name__)

T = TypeVar("T")
MIN_MAP_SIZE = 64 << 10
DEFAULT_MAP_SIZE = 64 << 20
READER_CHECK_EVERY_S = 10.0
"""How often a write first frees reader slots of dead processes (``clear_stale_readers``)."""
_CORRUPT = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.VersionMismatchError,
            lmdb.PageNotFoundError, lmdb.PanicError, lmdb.BadChecksumError, lmdb.IncompatibleError)
_LMDB_MAGIC = 0xBEEFC0DE
# An LMDB meta page (64-bit): 16-byte page header, magic, version, address, map size,
# two MDB_db records of 48 bytes (the free pages' and the main database's; the first's
# md_pad is the page size; md_root at byte 40 of each), last used page, txn id.
_META_PAGE = struct.Struct("<16xII16xI36xQ40xQQQ")
# magic, version, page size, free-pages root, main root, last page, txnid
_NO_PAGE = (1 << 64) - 1  # an empty database's root
_UNWRITTEN_TAIL_PAGES = 64
"""Pages at the end of ``data.mdb`` that LMDB may count as used (``mm_last_pg``) without
having written them: a page allocated and freed again in one write transaction (a split
undone by deletes) is never flushed, yet its number stays in use. A process killed after
such a commit leaves the file that much shorter than its last page: normal for LMDB, and
those pages are free (never read before written)."""


def clear_hint(root: Path) -> str:
    return f"it is only a cache: run `kv-offload clear {root}` or delete that directory"


def lmdb_failure(store_root: Path, exc: Exception) -> StoreError:
    """Translate an LMDB error into the StoreError that tells the user what to do."""
    index_dir = store_root / "index"
    if isinstance(exc, _CORRUPT):
        return StoreCorruptError(
            f"the disk-tier index {index_dir} is unreadable or corrupt ({exc}); "
            + clear_hint(store_root)
        )
    if isinstance(exc, lmdb.ReadonlyError):
        return StorePathError(
            f"the disk-tier index {index_dir} is not accessible ({exc}); fix its permissions "
            "(or run as the user that owns it) or choose another disk path"
        )
    return StoreError(f"the disk-tier index {index_dir} failed: {exc}")


def check_data_file(root: Path, *, strict: bool = False) -> None:
    """Raise StoreCorruptError when ``index/data.mdb`` is shorter than its newest meta page
    says: a root page past its end, or more than ``_UNWRITTEN_TAIL_PAGES`` short of its last
    page. LMDB maps the file, so reading past its end (a copy cut short, an OS crash with
    ``sync=False``) would kill the process with SIGBUS instead of raising. ``strict``
    (a read-only open, which must not initialise it): also when it is too short to hold
    a meta page, e.g. empty."""
    path = root / "index" / "data.mdb"
    try:
        with open(path, "rb") as f:
            first = f.read(_META_PAGE.size)
            if len(first) < _META_PAGE.size:
                if strict:
                    raise StoreCorruptError(
                        f"the disk-tier index {path} is empty or cut short ({len(first)} "
                        "bytes); " + clear_hint(root))
                return  # a new store, or too short to be LMDB (lmdb.open says so)
            page_size = _META_PAGE.unpack(first)[2]
            if _META_PAGE.unpack(first)[0] != _LMDB_MAGIC or not 512 <= page_size <= 1 << 16:
                return  # not an LMDB file: lmdb.open says so
            f.seek(page_size)
            second = f.read(_META_PAGE.size)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return
    metas = [_META_PAGE.unpack(first)]
    if len(second) == _META_PAGE.size and _META_PAGE.unpack(second)[0] == _LMDB_MAGIC:
        metas.append(_META_PAGE.unpack(second))
    newest = max(metas, key=lambda m: m[6])
    roots = [r for r in newest[3:5] if r != _NO_PAGE]
    needed = (newest[5] + 1) * page_size
    # What a lookup reads first must be there; the last pages may be free ones LMDB never
    # wrote (_UNWRITTEN_TAIL_PAGES); a file shorter than that was cut.
    if (any((r + 1) * page_size > size for r in roots)
            or size < needed - _UNWRITTEN_TAIL_PAGES * page_size):
        raise StoreCorruptError(
            f"the disk-tier index {path} is cut short ({size} of {needed} bytes); "
            + clear_hint(root))


class StoreEnv:
    """This process's LMDB environment of one store.

    Every transaction of every DiskIndex on the store in this process runs under
    ``lock``, which also makes resizing the map safe (it needs no live transaction).
    ``live_tokens`` holds the instance tokens of the open DiskIndex objects. A
    ``readonly`` environment writes nothing, not even a new index's format records
    (StoreCorruptError for an index that has none); without ``lock.mdb`` it takes no
    reader slot (no process has the store open then).
    """

    def __init__(self, root: Path, *, map_size: int, sync: bool, readonly: bool = False
                 ) -> None:
        self.root, self.lock, self.refs = root, threading.RLock(), 0
        self.readonly = readonly
        self.live_tokens: set[int] = set()
        self._next_reader_check = 0.0
        check_data_file(root, strict=readonly)
        index = root / "index"
        try:
            self.env = lmdb.open(
                str(index), map_size=map_size, subdir=True, max_dbs=len(DB_NAMES),
                sync=sync, metasync=sync, readahead=False, meminit=False, mode=DIR_MODE,
                max_spare_txns=4, readonly=readonly,
                lock=not readonly or (index / "lock.mdb").exists(),
            )
        except lmdb.Error as exc:
            raise lmdb_failure(root, exc) from exc
        try:
            self._check_tables()
            if readonly:
                self.dbs = {name: self.env.open_db(name.encode(), create=False)
                            for name in DB_NAMES}
                with self.read() as txn:
                    self._check_format(txn)
            else:
                self.clear_stale_readers()
                self.dbs = {name: self.env.open_db(name.encode()) for name in DB_NAMES}
                self.write(self._check_format)
        except lmdb.Error as exc:
            self.env.close()
            raise lmdb_failure(root, exc) from exc
        except BaseException:
            self.env.close()
            raise

    def _check_tables(self) -> None:
        """StorePathError unless the environment holds only kv-offload's tables (a new,
        empty one too; read-only: StoreCorruptError if it lacks one), so that another
        program's LMDB environment at ``index/`` is never written."""
        with self.read() as txn:
            names = {key.decode("utf-8", "replace") for key, _ in txn.cursor()}
        foreign = sorted(names - set(DB_NAMES))
        if foreign:
            raise StorePathError(
                f"{self.root / 'index'} holds an LMDB environment that is not a kv-offload "
                f"index (it has {', '.join(map(repr, foreign[:4]))}); kv-offload does not "
                "touch it. Point disk_path at another directory")
        if self.readonly and names != set(DB_NAMES):
            raise StoreCorruptError(
                f"the disk-tier index {self.root / 'index'} lacks kv-offload's tables "
                f"({', '.join(sorted(set(DB_NAMES) - names))}); " + clear_hint(self.root))

    def _check_format(self, txn: lmdb.Transaction[bytes]) -> None:
        raw = txn.get(b"format_version", db=self.dbs["meta"])
        if raw is None and not self.readonly and not txn.stat(self.dbs["namespaces"])["entries"]:
            for name, value in ((b"format_version", str(FORMAT_VERSION)),
                                (b"created", datetime.now(timezone.utc).isoformat()),
                                (b"checksum", CHECKSUM_ALGORITHM)):
                txn.put(name, value.encode(), db=self.dbs["meta"])
            return
        if raw is None or not raw.isdigit():
            raise StoreCorruptError(
                f"the disk-tier index {self.root / 'index'} has no readable format version; "
                + clear_hint(self.root)
            )
        if int(raw) > FORMAT_VERSION:
            raise StoreVersionError(
                f"the disk store {self.root} was written by a newer kv-offload (format version "
                f"{int(raw)}; this one reads up to {FORMAT_VERSION}); upgrade kv-offload, choose "
                f"another disk path, or run `kv-offload clear {self.root}`"
            )

    @contextlib.contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[lmdb.Transaction[bytes]]:
        """One LMDB transaction under the store lock: committed when the block ends
        normally (``write``), aborted when it raises.

        LMDB errors become StoreError subclasses, except ``lmdb.MapFullError``, which
        ``write`` handles. Keep read transactions short: a long one pins old pages.
        """
        with self.lock:
            try:
                try:
                    txn = self.env.begin(write=write)
                except lmdb.MapResizedError:  # another process grew the map: adopt its size
                    self.env.set_mapsize(0)
                    txn = self.env.begin(write=write)
                with txn:
                    yield txn
            except lmdb.MapFullError:
                raise
            except lmdb.Error as exc:
                raise lmdb_failure(self.root, exc) from exc

    def read(self) -> contextlib.AbstractContextManager[lmdb.Transaction[bytes]]:
        """A short read transaction (``transaction()``)."""
        return self.transaction()

    def write(self, fn: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``fn(txn)`` in one write transaction and commit; return its result.

        Atomic: if ``fn`` raises, nothing is written. A callback rather than a ``with``
        block because on a full map the map is grown and ``fn`` runs again from scratch
        (so ``fn`` must not mutate in-memory state).
        """
        with self.lock:
            if time.monotonic() >= self._next_reader_check:
                self.clear_stale_readers()
            while True:
                try:
                    with self.transaction(write=True) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    if self.clear_stale_readers():
                        continue  # pages a dead reader pinned are free again: retry
                    try:
                        size = self.env.info()["map_size"]
                    except lmdb.Error as exc:
                        raise lmdb_failure(self.root, exc) from exc
                    self.grow_map(2 * size)

    def grow_map(self, new_size: int) -> None:
        """Grow the memory map to at least ``new_size`` bytes; never shrinks it.
        LMDB errors become StoreError, as in ``transaction``."""
        with self.lock:
            try:
                old = self.env.info()["map_size"]
                if new_size > old:
                    self.env.set_mapsize(new_size)
            except lmdb.Error as exc:
                raise lmdb_failure(self.root, exc) from exc
            if new_size > old:
                logger.info("disk tier: index map grown from %d to %d KiB", old >> 10,
                            new_size >> 10)

    def clear_stale_readers(self) -> int:
        """Free the reader slots of processes that died inside a read transaction (a
        ``kill -9`` during a lookup): while one stays, LMDB reuses no page freed after
        that snapshot and the index grows with every write. How many were cleared."""
        with self.lock:
            self._next_reader_check = time.monotonic() + READER_CHECK_EVERY_S
            try:
                cleared = self.env.reader_check()
            except lmdb.Error as exc:
                raise lmdb_failure(self.root, exc) from exc
        if cleared:
            logger.warning("disk tier: cleared %d reader slot(s) left by processes that died "
                           "during a lookup", cleared)
        return cleared


def check_store_path(root: Path) -> None:
    """StorePathError unless ``root`` is a directory or does not exist yet."""
    if os.path.exists(root) and not os.path.isdir(root):
        raise StorePathError(
            f"disk_path: {root} is a file, not a directory; point disk_path at a directory "
            "(it is created if missing) or remove the file"
        )


_ENVS: dict[tuple[int, int, int], StoreEnv] = {}  # (pid, st_dev, st_ino) of index/ -> env
_ENVS_LOCK = threading.Lock()


def acquire_env(root: Path, *, create: bool, map_size: int | None, sync: bool,
                allow_unsafe_permissions: bool = False, readonly: bool = False) -> StoreEnv:
    """Open, or share, this process's environment of the store at ``root``; a new
    writable one also writes the store marker (files.py). Unless
    ``allow_unsafe_permissions``, refuses (StorePathError) a store directory or index
    file owned by another user or writable by group or others; always refuses a link, a
    file or a special file in place of ``index/`` or its files, and another program's
    LMDB environment there. ``readonly`` (never with ``create``) writes nothing; it
    shares an environment this process has open already. Pair with release_env."""
    index = root / "index"
    try:
        check_store_path(root)
        if not create and check_file(index / "data.mdb") is None:
            raise StorePathError(f"no disk store at {root} (missing index/data.mdb)")
        if readonly:
            st = check_dir(index)
            if st is None:
                raise StorePathError(f"no disk store at {root} (missing index/)")
        else:
            make_private_dirs(root, "index", allow_unsafe_permissions=allow_unsafe_permissions)
            st = os.lstat(index)
        for name in INDEX_FILES:
            file_st = check_file(index / name)
            if file_st is not None:
                check_private(index / name, file_st, allow_unsafe=allow_unsafe_permissions)
    except PermissionError as exc:
        raise StorePathError(
            f"cannot access the disk store {root}: {exc.strerror}; fix its permissions (or "
            "run as the user that owns it) or choose another disk path"
        ) from exc
    ident = (os.getpid(), st.st_dev, st.st_ino)
    with _ENVS_LOCK:
        env = _ENVS.get(ident)
        if env is not None and env.readonly and not readonly:
            raise StoreError(f"the disk store {root} is open read-only in this process (an "
                             "inspect or verify scan); retry once it is done")
        if env is None:
            size = max(map_size or DEFAULT_MAP_SIZE, MIN_MAP_SIZE)
            env = StoreEnv(root, map_size=size, sync=sync, readonly=readonly)
            if not readonly:
                try:
                    ensure_marker(root)
                except BaseException:
                    env.env.close()
                    raise
            _ENVS[ident] = env
        env.refs += 1
    return env


def release_env(env: StoreEnv) -> None:
    """Drop one reference; the last one syncs and closes the environment."""
    # The environment is closed while _ENVS_LOCK is held: a concurrent acquire_env of
    # the same files must not open a second environment before this one is closed
    # (LMDB forbids two in one process).
    with _ENVS_LOCK:
        env.refs -= 1
        if env.refs > 0:
            return
        for ident in [i for i, e in _ENVS.items() if e is env]:
            del _ENVS[ident]
        with env.lock:
            with contextlib.suppress(lmdb.Error):
                env.env.sync(True)
            env.env.close()


def is_open_here(root: Path) -> bool:
    """Whether this process holds an environment of the store at ``root``."""
    return any(e.root.resolve() == root.resolve() for e in list(_ENVS.values()))


@contextlib.contextmanager
def existing_env(root: str | os.PathLike, *, write: bool = False
                 ) -> Iterator[StoreEnv | None]:
    """The environment of the store at ``root`` for an administration helper, or None
    when there is no store; never creates one. Read-only (it writes nothing) unless
    ``write``."""
    root = Path(root)
    if not os.path.lexists(root / "index" / "data.mdb"):
        yield None
        return
    # Inspecting or clearing is what an operator does to an unsafe store: no check.
    env = acquire_env(root, create=False, map_size=None, sync=False,
                      allow_unsafe_permissions=True, readonly=not write)
    try:
        yield env
    finally:
        release_env(env)
