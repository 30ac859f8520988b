"""Broken environments: each gives a clear StoreError with a fix, or recovers safely."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kv_offload.disk import (
    DiskIndex,
    ReadResult,
    SlabFile,
    StoreCorruptError,
    StorePathError,
    StoreVersionError,
)

SLOT = 8192
NS = "5eed"


def open_index(root, *, num_slots=16, **kw) -> DiskIndex:
    return DiskIndex.open(root, namespace_id=NS, descriptor={}, slot_bytes=SLOT, num_ranks=1,
                          capacity_bytes=num_slots * SLOT, **kw)


def open_slab(root) -> SlabFile:
    return SlabFile(root, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def chunk(i: int) -> np.ndarray:
    return np.full(SLOT, i % 251, np.uint8)


def store_one(index: DiskIndex, slab: SlabFile, i: int) -> int:
    (slot,) = index.allocate([key(i)])
    index.commit([(key(i), slot, (slab.write(slot, chunk(i)),))])
    return slot


def test_store_path_is_a_file(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    with pytest.raises(StorePathError, match="is a file.*directory"):
        open_index(path)
    with pytest.raises(StorePathError, match="not a directory"):
        open_slab(path)


def test_store_path_not_writable(tmp_path):
    """/sys refuses mkdir even to root; as a normal user a 0500 directory does too."""
    with pytest.raises(StorePathError, match="cannot create.*writable location"):
        open_index("/sys/kv-offload-test-store")
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(StorePathError, match="writable"):
            open_index(locked / "store")


@pytest.fixture
def public_dir():
    """A world-traversable temporary directory (pytest's own tmp dirs are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="kv-offload-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_existing_store_not_writable_as_other_user(public_dir):
    """A store owned by someone else (0700) is refused with a path error, not a crash."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    open_index(public_dir / "store").close()
    code = (
        "import os\n"
        "from kv_offload.disk import DiskIndex, StorePathError\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    DiskIndex.open({str(public_dir / 'store')!r}, namespace_id='ab', descriptor={{}},"
        " slot_bytes=8, num_ranks=1, capacity_bytes=64)\n"
        "except StorePathError as exc:\n"
        "    print('StorePathError', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd="/", timeout=60)
    assert "StorePathError" in out.stdout, out.stderr[-2000:]


def test_disk_full_write_is_released_and_tier_keeps_working(tmp_path, monkeypatch):
    """ENOSPC mid-write: the write raises, the caller releases, nothing is published,
    and the slot is reused once space is back."""
    index, slab = open_index(tmp_path), open_slab(tmp_path)
    real = os.pwritev
    calls = []

    def full_after_some(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:  # a short write first, then the disk is full
            return real(fd, [memoryview(buffers[0])[:4096]], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    (slot,) = index.allocate([key(1)])
    monkeypatch.setattr(os, "pwritev", full_after_some)
    with pytest.raises(OSError) as info:
        slab.write(slot, chunk(1))
    assert info.value.errno == errno.ENOSPC
    index.release([slot])
    monkeypatch.undo()
    assert index.find_prefix([key(1)]) == [] and index.stats()["reserved"] == 0
    assert store_one(index, slab, 1) == slot
    (entry,) = index.find_prefix([key(1)])
    out = np.empty(SLOT, np.uint8)
    assert slab.read(entry.slot, out, entry.checksums[0]) and np.array_equal(out, chunk(1))
    assert index.check() == []
    index.close()
    slab.close()


def test_slab_truncated_deleted_or_replaced_under_a_running_store(tmp_path):
    """A damaged slab never yields data: short read, missing, or checksum mismatch; the
    failed entries are dropped and new writes recreate the file."""
    index, slab = open_index(tmp_path), open_slab(tmp_path)
    slots = [store_one(index, slab, i) for i in range(4)]
    entries = index.find_prefix([key(i) for i in range(4)])
    out = np.empty(SLOT, np.uint8)

    os.truncate(slab.path, 2 * SLOT)
    assert slab.read(slots[3], out, entries[3].checksums[0]) is ReadResult.SHORT_READ
    assert slab.read(slots[0], out, entries[0].checksums[0]) is ReadResult.OK

    other = open_slab(tmp_path)  # a second handle, as a second worker would hold
    os.unlink(slab.path)
    assert slab.read(slots[0], out, entries[0].checksums[0]) is ReadResult.MISSING
    for entry in entries:
        index.drop(entry.key, entry.slot)

    fresh = tmp_path / "replacement"
    fresh.write_bytes(b"\x07" * (4 * SLOT))
    os.replace(fresh, slab.path)
    assert other.read(slots[1], out, entries[1].checksums[0]) is ReadResult.CHECKSUM_MISMATCH

    new_slot = store_one(index, slab, 9)  # the writer reopens the path it now names
    (entry,) = index.find_prefix([key(9)])
    assert other.read(new_slot, out, entry.checksums[0]) and np.array_equal(out, chunk(9))
    assert index.stats()["counters"]["checksum_failures"] == 4
    for handle in (index, slab, other):
        handle.close()


def test_lmdb_map_full_grows_instead_of_crashing(tmp_path):
    index = open_index(tmp_path, num_slots=6000, map_size=64 * 1024)
    for start in range(0, 5000, 250):
        keys = [key(i) for i in range(start, start + 250)]
        slots = index.allocate(keys)
        assert None not in slots
        index.commit([(k, s, (s,)) for k, s in zip(keys, slots)])
    assert index.stats()["num_entries"] == 5000 and index.check() == []
    index.close()
    index = open_index(tmp_path, num_slots=6000, map_size=64 * 1024)
    assert len(index.find_prefix([key(i) for i in range(5000)])) == 5000
    index.close()


def _set_meta(root: Path, name: bytes, value: bytes) -> None:
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(name, value, db=env.open_db(b"meta", txn=txn))
    env.close()


def test_store_written_by_newer_format_version(tmp_path):
    open_index(tmp_path).close()
    _set_meta(tmp_path, b"format_version", b"99")
    with pytest.raises(StoreVersionError, match="newer kv-offload.*99.*kv-offload clear"):
        open_index(tmp_path)


def test_corrupt_index_file_tells_the_user_to_clear(tmp_path):
    open_index(tmp_path).close()
    data = tmp_path / "index" / "data.mdb"
    data.write_bytes(np.random.default_rng(0).bytes(64 * 1024))
    with pytest.raises(StoreCorruptError, match=f"kv-offload clear {tmp_path}"):
        open_index(tmp_path)


def test_bad_keys_checksums_and_capacity_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="holds no slot"):
        open_index(tmp_path, num_slots=0)
    index = open_index(tmp_path)
    with pytest.raises(TypeError, match="bytes"):
        index.allocate(["text-key"])
    with pytest.raises(ValueError, match="1..64"):
        index.allocate([b"x" * 65])
    (slot,) = index.allocate([key(1)])
    with pytest.raises(ValueError, match="checksums"):
        index.commit([(key(1), slot, (1, 2))])
    assert index.check() == []
    index.close()
