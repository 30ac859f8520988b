"""Contracts of SlabFile: whole-slot positional I/O, checksums, modes, threads."""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from kv_offload.checksum import checksum
from kv_offload.disk import ReadResult, SlabFile

SLOT = 16 * 1024


def make_slab(root, *, rank=0, num_ranks=1, slot_bytes=SLOT, **kw) -> SlabFile:
    return SlabFile(root, namespace_id="c0ffee", rank=rank, num_ranks=num_ranks,
                    slot_bytes=slot_bytes, **kw)


def pattern(seed: int, nbytes: int = SLOT) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.fixture
def slab(tmp_path):
    s = make_slab(tmp_path)
    yield s
    s.close()


def test_write_then_read_round_trips_and_verifies(slab):
    data = pattern(1)
    digest = slab.write(3, memoryview(data))
    assert digest == checksum(data)
    out = np.zeros(SLOT, np.uint8)
    result = slab.read(3, memoryview(out), digest)
    assert result is ReadResult.OK and result
    assert np.array_equal(out, data)
    assert os.path.getsize(slab.path) == 4 * SLOT  # sparse up to the written slot


def test_slots_larger_than_one_io_piece(tmp_path):
    """Multi-MiB slots go in pieces, hashed piece by piece: same digest as one pass."""
    size = (5 << 20) // 2 + 3
    data = pattern(7, size)
    with make_slab(tmp_path, slot_bytes=size) as s:
        digest = s.write(1, data)
        assert digest == checksum(data)
        out = np.empty(size, np.uint8)
        assert s.read(1, out, digest) and np.array_equal(out, data)
        os.truncate(s.path, size + size // 2)  # the second half of slot 1 is gone
        assert s.read(1, out, digest) is ReadResult.SHORT_READ


def test_torch_host_slot_is_written_in_place(slab):
    host = torch.arange(SLOT // 4, dtype=torch.float32)
    digest = slab.write(0, host.numpy())
    out = torch.empty_like(host)
    assert slab.read(0, out.numpy(), digest)
    assert torch.equal(out, host)


def test_checksum_mismatch_is_a_failed_read_never_data(slab):
    """Invariant 5: flipped bytes on disk are reported, not returned as a hit."""
    data = pattern(2)
    digest = slab.write(1, data)
    with open(slab.path, "r+b") as f:
        f.seek(SLOT + 100)
        f.write(b"\xff\x00")
    result = slab.read(1, np.empty(SLOT, np.uint8), digest)
    assert result is ReadResult.CHECKSUM_MISMATCH and not result
    assert slab.read(1, np.empty(SLOT, np.uint8), digest ^ 1) is ReadResult.CHECKSUM_MISMATCH


def test_slot_beyond_end_of_file_is_a_short_read(slab):
    slab.write(0, pattern(3))
    assert slab.read(5, np.empty(SLOT, np.uint8), 0) is ReadResult.SHORT_READ


def test_files_and_directories_are_private(tmp_path):
    s = make_slab(tmp_path / "store", rank=1, num_ranks=2)
    assert s.path == tmp_path / "store" / "slabs" / "c0ffee" / "rank1-of-2.slab"
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    for d in (tmp_path / "store", tmp_path / "store" / "slabs", s.path.parent):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    s.close()


def test_rejects_bad_buffers_and_slots(slab):
    with pytest.raises(ValueError, match="expected 16384"):
        slab.write(0, b"short")
    with pytest.raises(ValueError, match="writable"):
        slab.read(0, bytes(SLOT), 0)
    with pytest.raises(ValueError, match="contiguous"):
        slab.write(0, np.zeros((SLOT, 2), np.uint8)[:, 0])
    with pytest.raises(ValueError, match="slot"):
        slab.write(-1, bytes(SLOT))


@pytest.mark.parametrize("kwargs", [
    {"namespace_id": "../etc"}, {"namespace_id": "C0FFEE"}, {"rank": 2},
    {"num_ranks": 0}, {"slot_bytes": 0},
])
def test_rejects_bad_construction(tmp_path, kwargs):
    base = {"namespace_id": "c0ffee", "rank": 0, "num_ranks": 2, "slot_bytes": SLOT}
    with pytest.raises(ValueError):
        SlabFile(tmp_path, **{**base, **kwargs})


def test_short_writes_are_continued(slab, monkeypatch):
    real = os.pwritev

    def dribble(fd, buffers, offset):
        (view,) = buffers
        return real(fd, [memoryview(view)[:1000]], offset)

    monkeypatch.setattr(os, "pwritev", dribble)
    data = pattern(4)
    digest = slab.write(2, data)
    monkeypatch.undo()
    out = np.empty(SLOT, np.uint8)
    assert slab.read(2, out, digest) and np.array_equal(out, data)


BIG = (9 << 20) // 2 + 7  # several read pieces and write pieces, the last one partial


def test_short_io_is_continued_across_pieces(tmp_path, monkeypatch):
    """Short pwritev/preadv calls that end inside a piece resume at the right offset, in
    every piece of a multi-MiB slot, and the digest still covers each byte once."""
    real_write, real_read = os.pwritev, os.preadv
    sizes: list[int] = []

    def dribble(real, limit):
        def call(fd, buffers, offset):
            (view,) = buffers
            n = real(fd, [memoryview(view)[:limit]], offset)
            sizes.append(n)
            return n
        return call

    data = pattern(8, BIG)
    with make_slab(tmp_path, slot_bytes=BIG) as s:
        monkeypatch.setattr(os, "pwritev", dribble(real_write, 700 << 10))
        monkeypatch.setattr(os, "preadv", dribble(real_read, 100 << 10))
        digest = s.write(2, data)
        out = np.zeros(BIG, np.uint8)
        result = s.read(2, out, digest)
    assert digest == checksum(data)
    assert result is ReadResult.OK and np.array_equal(out, data)
    assert sum(sizes) == 2 * BIG and max(sizes) <= 700 << 10


def test_mismatch_in_a_middle_piece_is_a_failed_read(tmp_path):
    """Invariant 5 for multi-piece slots: one byte flipped deep inside the slot (neither
    the first nor the last piece) fails the read."""
    data = pattern(9, BIG)
    with make_slab(tmp_path, slot_bytes=BIG) as s:
        digest = s.write(0, data)
        with open(s.path, "r+b") as f:
            f.seek(BIG // 2 + 12345)
            f.write(bytes([data[BIG // 2 + 12345] ^ 0x40]))
        assert s.read(0, np.empty(BIG, np.uint8), digest) is ReadResult.CHECKSUM_MISMATCH


def test_fsync_option_syncs_each_write(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(os, "fdatasync", synced.append)
    with make_slab(tmp_path, fsync=True) as s:
        s.write(0, pattern(5))
        s.write(1, pattern(6))
    assert len(synced) == 2


def test_concurrent_io_on_different_slots(slab):
    """Thread-safety: a pool writes and reads 64 slots at once; every slot verifies."""
    datas = [pattern(100 + i) for i in range(64)]
    with ThreadPoolExecutor(8) as pool:
        digests = list(pool.map(lambda i: slab.write(i, datas[i]), range(64)))
        outs = [np.empty(SLOT, np.uint8) for _ in range(64)]
        results = list(pool.map(lambda i: slab.read(i, outs[i], digests[i]), range(64)))
    assert all(r is ReadResult.OK for r in results)
    assert all(np.array_equal(o, d) for o, d in zip(outs, datas))


def test_closed_slab_refuses_io(tmp_path):
    s = make_slab(tmp_path)
    s.close()
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.write(0, bytes(SLOT))
    with pytest.raises(ValueError, match="closed"):
        s.read(0, bytearray(SLOT), 0)


def test_replaced_file_takes_effect_at_once(slab):
    """``os.replace`` onto the slab: the next read sees the new file's bytes (a miss, never
    the old bytes) and the next write lands in the file the path names now."""
    data = pattern(1)
    digest = slab.write(0, data)
    out = np.empty(SLOT, np.uint8)
    fresh = slab.path.with_name("replacement")
    fresh.write_bytes(b"\x07" * (2 * SLOT))
    fresh.chmod(0o600)
    os.replace(fresh, slab.path)
    assert slab.read(0, out, digest) is ReadResult.CHECKSUM_MISMATCH  # the new file's bytes
    other = pattern(2)
    slab.write(1, other)
    with open(slab.path, "rb") as f:
        f.seek(SLOT)
        assert f.read(SLOT) == other.tobytes()  # written into the file the path names now


def test_store_moved_away_while_open_is_missing_not_served(tmp_path):
    """Regression (engine test of a store deleted under a running engine, after 22:06):
    the open slab file keeps its link when the store directory is moved away, or when
    its file system is lazily unmounted (``umount -l``) before the store is deleted. A
    liveness check on the open descriptor (``fstat().st_nlink``) then kept serving its
    bytes, the worker saw no I/O error and the disk tier was never disabled. The path
    is what counts: reads are MISSING, a write starts a new file at the path."""
    slab = make_slab(tmp_path / "store")
    data = pattern(1)
    digest = slab.write(0, data)
    os.rename(tmp_path / "store", tmp_path / "moved")
    out = np.empty(SLOT, np.uint8)
    assert slab.read(0, out, digest) is ReadResult.MISSING
    slab.write(1, data)
    assert slab.path.stat().st_size == 2 * SLOT  # a new sparse file at the path
    # slot 0 of the new file is a hole: a miss, never the moved file's bytes
    assert slab.read(0, out, digest) is ReadResult.CHECKSUM_MISMATCH
    slab.close()


def counting_pwritev(monkeypatch, limit=None):
    """Record (offset, bytes) of each pwritev; ``limit``: write at most that many bytes."""
    real, calls = os.pwritev, []

    def call(fd, buffers, offset):
        views = [memoryview(b) for b in buffers]
        if limit is not None:
            kept, left = [], limit
            for v in views:
                if left <= 0:
                    break
                kept.append(v[:left])
                left -= min(left, v.nbytes)
            views = kept
        n = real(fd, views, offset)
        calls.append((offset, n))
        return n

    monkeypatch.setattr(os, "pwritev", call)
    return calls


def read_back(slab, slot, digest, nbytes=SLOT):
    out = np.zeros(nbytes, np.uint8)
    assert slab.read(slot, out, digest) is ReadResult.OK
    return out


def test_write_many_writes_each_run_of_consecutive_slots_in_one_call(slab, monkeypatch):
    """Small slots cost one pwritev each into ext4's page cache (its per-call cost made
    256 KiB chunks write at ~0.75x a raw file): runs of consecutive slots, in any order
    of the call, go out together; every slot still verifies with its own checksum."""
    calls = counting_pwritev(monkeypatch)
    slots = [5, 3, 4, 9, 10, 7]
    data = [pattern(s) for s in slots]
    sums = slab.write_many(slots, data)
    assert sums == [checksum(d) for d in data]
    assert sorted(calls) == [(3 * SLOT, 3 * SLOT), (7 * SLOT, SLOT), (9 * SLOT, 2 * SLOT)]
    monkeypatch.undo()
    for slot, d, digest in zip(slots, data, sums):
        assert np.array_equal(read_back(slab, slot, digest), d)


def test_write_many_continues_short_writes_across_buffers(slab, monkeypatch):
    calls = counting_pwritev(monkeypatch, limit=5000)  # ends inside a buffer, not at one
    data = [pattern(20 + i) for i in range(4)]
    sums = slab.write_many([0, 1, 2, 3], data)
    assert sum(n for _, n in calls) == 4 * SLOT and len(calls) > 4
    monkeypatch.undo()
    for slot, d, digest in zip(range(4), data, sums):
        assert np.array_equal(read_back(slab, slot, digest), d)


def test_write_many_writes_at_most_one_io_piece_per_call_and_syncs_once(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(os, "fdatasync", synced.append)
    per_call = (2 << 20) // SLOT
    with make_slab(tmp_path, fsync=True) as s:
        calls = counting_pwritev(monkeypatch)
        data = [pattern(i) for i in range(per_call + 3)]
        sums = s.write_many(list(range(per_call + 3)), data)
    assert [n for _, n in calls] == [2 << 20, 3 * SLOT] and len(synced) == 1
    assert sums[-1] == checksum(data[-1])
