"""The files of a disk store: their names and modes, the marker that proves a directory is
a store, and opening each as what it must be (never through a link).

A store is ``<root>/kv-offload-store.json`` (the marker), ``<root>/index/{data,lock}.mdb``
and ``<root>/slabs/<namespace_id>/rank<r>-of-<n>.slab``; nothing else in it is ours
(invariant 9). ``<root>`` itself may be a link (the operator's ``disk_path``); no path below
it is followed when it is one. No lmdb, torch or vLLM in here.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import stat
from datetime import datetime, timezone
from pathlib import Path

from kv_offload.disk.errors import StorePathError

DIR_MODE = 0o700
FILE_MODE = 0o600
MARKER_NAME = "kv-offload-store.json"
MARKER_MAGIC = "kv-offload disk store"
MARKER_VERSION = 1
INDEX_DIR, INDEX_FILES, SLABS_DIR = "index", ("data.mdb", "lock.mdb"), "slabs"
_MARKER_MAX_BYTES = 4096
_MARKER_TMP_RE = re.compile(r"\.kv-offload-store\.json\.[0-9a-f]+\.tmp")
_NAMESPACE_RE = re.compile(r"[0-9a-f]{1,128}")
_SLAB_RE = re.compile(r"rank[0-9]+-of-[0-9]+\.slab")


def validate_namespace_id(namespace_id: str) -> str:
    """Return ``namespace_id`` if it is 1..128 lowercase hex characters, else ValueError."""
    if not isinstance(namespace_id, str) or not _NAMESPACE_RE.fullmatch(namespace_id):
        raise ValueError(
            f"namespace_id must be 1-128 lowercase hex characters, got {namespace_id!r}"
        )
    return namespace_id


def slab_dir(root: str | os.PathLike, namespace_id: str) -> Path:
    """Directory holding a namespace's slab files (not created)."""
    return Path(root) / SLABS_DIR / validate_namespace_id(namespace_id)


def slab_path(root: str | os.PathLike, namespace_id: str, rank: int, num_ranks: int) -> Path:
    """Path of rank ``rank``'s slab file in a namespace (not created)."""
    return slab_dir(root, namespace_id) / f"rank{rank}-of-{num_ranks}.slab"


def is_slab_name(name: str) -> bool:
    """Whether ``name`` is a slab file name kv-offload gives (``rank<r>-of-<n>.slab``)."""
    return _SLAB_RE.fullmatch(name) is not None


def is_namespace_name(name: str) -> bool:
    """Whether ``name`` is a namespace id, as a slab directory is named."""
    return _NAMESPACE_RE.fullmatch(name) is not None


def is_marker_leftover(name: str) -> bool:
    """Whether ``name`` is a temporary marker file a creator died before renaming."""
    return _MARKER_TMP_RE.fullmatch(name) is not None


def check_private(path: Path, st: os.stat_result, *, allow_unsafe: bool) -> None:
    """StorePathError unless ``path`` (with stat ``st``) belongs to this user and is not
    writable by group or others: whoever can write the store can plant KV (with matching
    checksums) that this process would serve. ``allow_unsafe`` skips the check."""
    if allow_unsafe:
        return
    problems = []
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        problems.append(f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        raise StorePathError(
            f"disk store path {path} is {' and '.join(problems)}: another user could plant KV "
            "that this server would serve. Make it yours with mode 0700 (files 0600), choose "
            "another disk path, or, if the store is shared on purpose, set "
            "disk_allow_unsafe_permissions (allow_unsafe_permissions=True)"
        )


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a file"
    return "a special file (fifo, socket or device)"


def not_ours(path: Path, mode: int, expected: str) -> StorePathError:
    """The error for a store path that is not the ``expected`` kind ("a directory", "a
    file"): kv-offload neither follows nor replaces it."""
    return StorePathError(
        f"disk store path {path} is {_kind(mode)}, not {expected} kv-offload created; "
        "kv-offload never follows a link out of its store or opens what it did not make. "
        f"Remove {path} (kv-offload recreates it) or choose another disk path"
    )


def check_dir(path: Path, *, follow: bool = False) -> os.stat_result | None:
    """The stat of directory ``path``; None if it does not exist. StorePathError when it
    is anything else, a link included unless ``follow`` (the store root only)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise StorePathError(f"disk store path {path} lies below a file; point the disk tier "
                             "at a directory (or remove the file)") from None
    if not stat.S_ISDIR(st.st_mode):
        if follow or not stat.S_ISLNK(st.st_mode):
            raise StorePathError(f"disk store path {path} exists and is not a directory; "
                                 "point the disk tier at a directory (or remove the file)")
        raise not_ours(path, st.st_mode, "a directory")
    return st


def check_file(path: Path) -> os.stat_result | None:
    """The stat of regular file ``path`` (not followed if a link); None if it does not
    exist; StorePathError when it is a link, a directory or a special file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise not_ours(path, st.st_mode, "a file")
    return st


def make_private_dirs(root: Path, *parts: str, allow_unsafe_permissions: bool = False) -> Path:
    """Create ``root`` and each of ``parts`` below it with mode 0700; return the leaf.

    Existing directories keep their mode. ``root`` may be a link to a directory; a part
    may not. Raises StorePathError when a component is a file, a link (a part) or cannot
    be created (read-only, permissions), or, unless ``allow_unsafe_permissions``, is owned
    by another user or writable by group or others.
    """
    path = Path(root)
    for part in ("", *parts):
        path = path / part if part else path
        try:
            st = check_dir(path, follow=not part)
            if st is None:
                with contextlib.suppress(FileExistsError):  # another process was first
                    os.mkdir(path, DIR_MODE)
                st = check_dir(path, follow=not part)
            if st is None:
                raise FileNotFoundError(errno.ENOENT, "vanished while being created")
            check_private(path, st, allow_unsafe=allow_unsafe_permissions)
        except OSError as exc:
            raise StorePathError(
                f"cannot create disk store directory {path}: {exc.strerror}; "
                "choose a writable location or fix its permissions"
            ) from exc
    return path


def open_file(path: Path, flags: int, *, create: bool = False) -> int:
    """``os.open`` a store file without following a link (O_NOFOLLOW) and check that it
    is a regular file; the descriptor (close-on-exec). StorePathError naming the path and
    the fix for a link, a directory or a special file; other OSErrors pass through
    (FileNotFoundError when it is missing and not ``create``d). Never blocks on a fifo."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                raise exc from None
            raise not_ours(path, mode, "a file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise not_ours(path, st.st_mode, "a file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def marker_problem(root: Path) -> str | None:
    """None when ``root`` holds a valid store marker; else what is wrong with it ("no
    marker file" when there is none). Read-only; never follows a link."""
    path = root / MARKER_NAME
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return f"no marker file {path}"
    except StorePathError:
        return f"its marker {path} is not a regular file"
    except OSError as exc:
        return f"its marker {path} cannot be read ({exc.strerror})"
    try:
        raw = os.read(fd, _MARKER_MAX_BYTES + 1)
    except OSError as exc:
        return f"its marker {path} cannot be read ({exc.strerror})"
    finally:
        os.close(fd)
    try:
        data = json.loads(raw) if len(raw) <= _MARKER_MAX_BYTES else None
    except (ValueError, UnicodeDecodeError):
        data = None
    if not isinstance(data, dict) or data.get("magic") != MARKER_MAGIC:
        return f"its marker {path} is damaged (not a kv-offload store marker)"
    version = data.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return f"its marker {path} is damaged (no format_version)"
    return None


def ensure_marker(root: Path) -> None:
    """Write the store marker unless a valid one is there. Atomic: a temporary file is
    linked into place, so no reader sees half a marker and concurrent creators agree.
    StorePathError when a damaged marker (or a link, a directory) holds its name."""
    path = root / MARKER_NAME
    problem = marker_problem(root)
    if problem is None:
        return
    if os.path.lexists(path):
        raise StorePathError(
            f"disk store {root}: {problem}. If {root} is a kv-offload store, remove {path} "
            "(it is written again at the next start); otherwise choose another disk path")
    body = json.dumps({"magic": MARKER_MAGIC, "format_version": MARKER_VERSION,
                       "created": datetime.now(timezone.utc).isoformat()}, indent=2) + "\n"
    tmp = root / f".{MARKER_NAME}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE)
        try:
            os.write(fd, body.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it first: it must be valid
            pass
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise StorePathError(f"cannot write the store marker {path}: {exc.strerror}; "
                             "choose a writable location or fix its permissions") from exc
    problem = marker_problem(root)
    if problem is not None:
        raise StorePathError(f"disk store {root}: {problem}; remove {path} and start again")
