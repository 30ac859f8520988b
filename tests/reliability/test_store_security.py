"""Security of the disk store: private by default, and a store someone else could write
is not trusted.

The checksum (xxh3) only detects accidents; whoever can write the store can plant KV
with matching checksums, and this server would serve answers computed from it. So a
store directory or file owned by another user, or writable by group or others, must be
refused unless the operator allows it explicitly (``allow_unsafe_permissions``). Key
and prompt data never name a file (see also test_engine_faults.py for a real engine).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from reliability_support import NS, SLOT_BYTES

from kv_offload.disk import DiskIndex, SlabFile, StorePathError


def open_index(root: Path, **kw) -> DiskIndex:
    return DiskIndex.open(root, namespace_id=NS, descriptor={}, slot_bytes=SLOT_BYTES,
                          num_ranks=1, capacity_bytes=8 * SLOT_BYTES, **kw)


def open_slab(root: Path, **kw) -> SlabFile:
    return SlabFile(root, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT_BYTES, **kw)


def make_store(root: Path) -> None:
    index, slab = open_index(root), open_slab(root)
    index.close()
    slab.close()


def loose_modes(root: Path) -> dict[str, str]:
    """Paths of the store whose mode is not 0700 (directories) or 0600 (files)."""
    out = {}
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode != (0o700 if path.is_dir() else 0o600):
            out[str(path.relative_to(root))] = oct(mode)
    return out


def test_a_new_store_is_private_even_with_a_permissive_umask(tmp_path):
    """Index files included (tests/disk checks the slab side only)."""
    old = os.umask(0)
    try:
        make_store(tmp_path / "store")
    finally:
        os.umask(old)
    root = tmp_path / "store"
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "index", "index/data.mdb", "index/lock.mdb", "kv-offload-store.json", "slabs",
        f"slabs/{NS}", f"slabs/{NS}/rank0-of-1.slab"]
    assert loose_modes(root) == {}


LOOSE = [(".", 0o777), ("index", 0o770), ("slabs", 0o777), (f"slabs/{NS}", 0o722)]


@pytest.mark.parametrize(("part", "mode"), LOOSE, ids=[p for p, _ in LOOSE])
def test_a_store_writable_by_others_is_refused(tmp_path, part, mode):
    root = tmp_path / "store"
    make_store(root)
    (root / part).chmod(mode)
    with pytest.raises(StorePathError, match="writable by") as info:
        open_index(root).close()
        open_slab(root).close()
    assert str(root) in str(info.value) and "allow_unsafe_permissions" in str(info.value)


def test_a_store_owned_by_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to hand the store to another user")
    root = tmp_path / "store"
    make_store(root)
    for path in [root, *root.rglob("*")]:
        os.chown(path, 65534, 65534)
    with pytest.raises(StorePathError, match="owned by"):
        open_index(root).close()
    with pytest.raises(StorePathError, match="owned by"):
        open_slab(root).close()


def test_an_unsafe_store_opens_when_explicitly_allowed(tmp_path):
    root = tmp_path / "store"
    make_store(root)
    root.chmod(0o777)
    open_index(root, allow_unsafe_permissions=True).close()
    open_slab(root, allow_unsafe_permissions=True).close()


@pytest.mark.parametrize("bad", ["../escape", "ab/cd", "AB", "", "x" * 129, "ab\x00"])
def test_nothing_but_a_hex_namespace_id_reaches_a_path(tmp_path, bad):
    """Paths are built from the namespace id and rank only; anything else is refused
    before a file is touched."""
    with pytest.raises(ValueError, match="namespace_id"):
        SlabFile(tmp_path, namespace_id=bad, rank=0, num_ranks=1, slot_bytes=8)
    assert list(tmp_path.iterdir()) == []
