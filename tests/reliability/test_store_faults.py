"""A store that fills up or turns read-only under a running scheduler and worker (``Rig``),
on real file systems: a small tmpfs (disk full) and a read-only bind mount (root ignores
chmod, so permissions cannot make a directory read-only for these tests).

Both need root and mount(8); without them the tests skip with the reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from reliability_support import (
    NS,
    RIG_CHUNK,
    Rig,
    mount_tmpfs,
    open_rig_index,
    open_rig_slab,
    rig_request,
    rig_tokens,
    unmount,
)

from kv_offload.disk.health import DISK_BROKEN_AFTER

TOKENS = 4 * RIG_CHUNK + 1


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs (skips where it cannot be mounted)."""
    mnt = tmp_path / "mnt"
    why_not = mount_tmpfs(mnt, "1m")
    if why_not:
        pytest.skip(f"disk-full variant needs a small tmpfs: {why_not}")
    yield mnt
    unmount(mnt)


def fill(path: Path, keep: int) -> None:
    """Fill the file system of ``path`` until ``keep`` bytes are left."""
    st = os.statvfs(path)
    fd = os.open(path / "filler", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(st.f_bavail * st.f_frsize - keep, 4096))
    finally:
        os.close(fd)


def test_index_on_a_full_disk_does_not_crash_the_scheduler(tmpfs, caplog):
    """Index and slabs share the store directory, so a full disk hits LMDB too."""
    store = tmpfs / "store"
    index, slab = open_rig_index(store), open_rig_slab(store)
    rig = Rig(disk_index=index, slab=slab)
    fill(tmpfs, keep=0)
    with caplog.at_level(logging.ERROR, logger="kv_offload"):
        for i in range(3):
            rid = f"r{i}"
            rig.admit(rig_request(rid, rig_tokens(i, TOKENS)))
            rig.run_step([(rid, TOKENS)])
        rig.drain()
    assert not rig.sched.disk_enabled
    assert any("No space left" in r.getMessage() for r in caplog.records)
    assert rig.sched.cpu.counts()["ready"] == 12, "the CPU tier keeps serving"
    rig.close()


def test_slab_file_system_full_fails_stores_softly(tmp_path):
    """Only the slabs are on the full tmpfs (the index is not): stores fail with ENOSPC,
    nothing half-written is published, the tier stays on and serves what fit."""
    store = tmp_path / "store"
    why_not = mount_tmpfs(store / "slabs", "32k")  # 64 slots of 512 bytes
    if why_not:
        pytest.skip(f"disk-full variant needs a small tmpfs: {why_not}")
    try:
        index, slab = open_rig_index(store, num_slots=256), open_rig_slab(store)
        rig = Rig(disk_index=index, slab=slab, num_cpu_slots=128)
        for i in range(40):  # 160 chunks: more than the tmpfs holds
            rid = f"r{i}"
            rig.admit(rig_request(rid, rig_tokens(i, TOKENS)))
            rig.run_step([(rid, TOKENS)])
            rig.sched.request_finished(rid)
        rig.drain()
        stats = rig.stats
        committed = index.stats()["num_entries"]
        assert stats.get("disk_write_errors", 0) > 0, "the tmpfs never filled"
        assert committed + stats["disk_write_errors"] == 160
        assert rig.sched.disk_enabled
        assert index.stats()["reserved"] == 0 and index.check() == []
        assert rig.idle_problems() == []
        rig.close()  # and everything committed reads back (no half-written chunk visible)
        reader = Rig(disk_index=index, slab=open_rig_slab(store), num_cpu_slots=128)
        hits = sum(reader.admit(rig_request(f"q{i}", rig_tokens(i, TOKENS))) > 0
                   for i in range(40))
        reader.drain()
        assert hits > 0 and not reader.failed_blocks
        reader.close()
        index.close()
    finally:
        unmount(store / "slabs")


def bind_read_only(path: Path) -> str | None:
    """Bind-mount ``path`` read-only onto itself; None on success, else why not."""
    if os.geteuid() != 0:
        return "a read-only bind mount needs root"
    for cmd in (["mount", "--bind", str(path), str(path)],
                ["mount", "-o", "remount,bind,ro", str(path)]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            unmount(path)
            return f"{' '.join(cmd)} failed: {proc.stderr.strip()}"
    return None


@pytest.mark.parametrize("removed", [
    "slab_file",
    pytest.param("slab_directory"),
])
def test_read_only_store_disables_the_tier_once(tmp_path, caplog, removed):
    """The slab file (or its directory) is gone and the store turned read-only: every write
    fails with EROFS, the worker reports the disk broken once, the scheduler disables the
    tier with one error line, and serving continues from the CPU tier."""
    store = tmp_path / "store"
    index, slab = open_rig_index(store), open_rig_slab(store)
    rig = Rig(disk_index=index, slab=slab, num_cpu_slots=32)
    rig.admit(rig_request("ok", rig_tokens(100, TOKENS)))
    rig.run_step([("ok", TOKENS)])
    rig.drain()
    assert index.stats()["num_entries"] == 4
    if removed == "slab_file":
        slab.path.unlink()
    else:
        shutil.rmtree(store / "slabs" / NS)
    why_not = bind_read_only(store / "slabs")
    if why_not:
        rig.close()
        index.close()
        pytest.skip(why_not)
    try:
        with caplog.at_level(logging.WARNING, logger="kv_offload"):
            for i in range(DISK_BROKEN_AFTER // 4 + 2):
                rid = f"r{i}"
                rig.admit(rig_request(rid, rig_tokens(i, TOKENS)))
                rig.run_step([(rid, TOKENS)])
                rig.sched.request_finished(rid)
            rig.drain()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "disk tier keeps failing" in errors[0]
        assert "Read-only file system" in errors[0]
        assert not rig.sched.disk_enabled
        assert index.stats()["num_entries"] == 4 and index.stats()["reserved"] == 0
        assert rig.admit(rig_request("again", rig_tokens(0, TOKENS))) == 4 * RIG_CHUNK
        rig.drain()
        assert rig.idle_problems() == []
    finally:
        rig.close()
        index.close()
        unmount(store / "slabs")
