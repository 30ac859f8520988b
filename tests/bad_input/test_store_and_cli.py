"""Bad input to the disk store and the `kv-offload` command, as an operator meets it.

Each table row is one odd directory, damaged store or mistyped option; each test asserts
what the user sees: the exit code (or the exception), a message naming the path or option
and the fix, never a traceback, and that nothing outside the store was touched (a
sentinel file beside it survives byte for byte). Issue 35 found the first rows: `clear`
deleted a directory that merely had an `index/`; one index record naming slot 2**60
poisoned the free list and turned the disk tier off for good; a link planted in place
of a slab was followed; inspect rewrote an empty index and ended in tracebacks.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import lmdb
import numpy as np
import pytest

from kv_offload.disk import DiskIndex, ReadResult, SlabFile, StorePathError, admin, list_namespaces
from kv_offload.disk.files import MARKER_NAME, slab_path
from kv_offload.tools.cli import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main

NS = "ab" * 16
SLOT = 4096
NUM_SLOTS = 16
REPO = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def chunk(i: int) -> np.ndarray:
    return np.full(SLOT, i % 251, np.uint8)


def open_index(root: Path, **kw) -> DiskIndex:
    return DiskIndex.open(root, namespace_id=NS, descriptor={"model": "m"}, slot_bytes=SLOT,
                          num_ranks=1, capacity_bytes=NUM_SLOTS * SLOT, **kw)


def open_slab(root: Path, **kw) -> SlabFile:
    return SlabFile(root, namespace_id=NS, rank=0, num_ranks=1, slot_bytes=SLOT, **kw)


def store_chunks(index: DiskIndex, slab: SlabFile, ids: range) -> list[int | None]:
    slots = index.allocate([key(i) for i in ids])
    index.commit([(key(i), s, (slab.write(s, chunk(i)),)) for i, s in zip(ids, slots)
                  if s is not None])
    return slots


def make_store(root: Path, num_chunks: int = 3) -> Path:
    """A healthy store: marker, index and one slab holding ``num_chunks`` chunks."""
    with open_index(root) as index, open_slab(root) as slab:
        store_chunks(index, slab, range(num_chunks))
    return root


def snapshot(path: Path) -> dict[str, tuple]:
    """Every path under ``path`` (links not followed): kind, size, mtime, content hash.
    ``lock.mdb`` is left out: a reader takes a slot in it (LMDB's reader table)."""
    out: dict[str, tuple] = {}
    for p in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
        st = os.lstat(p)
        digest = (hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode)
                  and p.name != "lock.mdb" else "")
        out[str(p)] = (stat.S_IFMT(st.st_mode), 0 if p.name == "lock.mdb" else st.st_size,
                       0 if p.name == "lock.mdb" or p.is_dir() else st.st_mtime_ns, digest)
    return out


def cli(capsys, *argv: object) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def sentinel(tmp_path) -> Path:
    """A user's file beside the store; every test checks it is untouched at the end."""
    path = tmp_path / "precious.txt"
    path.write_text("precious\n")
    yield path
    assert path.read_text() == "precious\n"


def put(root: Path, db: str, name: bytes, value: bytes) -> None:
    """Write one record straight into the store's LMDB index, as damage would."""
    env = lmdb.open(str(root / "index"), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.put(name, value, db=env.open_db(db.encode(), txn=txn))
    env.close()


def get(root: Path, db: str, name: bytes) -> bytes | None:
    env = lmdb.open(str(root / "index"), max_dbs=16, readonly=True)
    with env.begin() as txn:
        value = txn.get(name, db=env.open_db(db.encode(), txn=txn))
    env.close()
    return value


def entry_of(root: Path, i: int) -> bytes:
    value = get(root, "entries", f"{NS}/".encode() + key(i))
    assert value is not None
    return value


# -- 1. clear deletes only a store, and only what kv-offload made -------------------------------


def _foreign_lmdb(d: Path) -> None:
    env = lmdb.open(str(d / "index"), max_dbs=4)
    with env.begin(write=True) as txn:
        txn.put(b"alice", b"42", db=env.open_db(b"users", txn=txn))
    env.close()


def _slabs_only(d: Path) -> None:
    (d / "slabs" / NS).mkdir(parents=True)
    (d / "slabs" / NS / "rank0-of-1.slab").write_bytes(b"mine, not a cache")


def _damaged_marker_and_index(d: Path) -> None:
    make_store(d)
    (d / MARKER_NAME).write_text('{"magic": "something else"}')
    (d / "index" / "data.mdb").write_bytes(b"garbage" * 1000)


def _marker_link(d: Path) -> None:
    make_store(d.parent / "real-store")
    (d / MARKER_NAME).symlink_to(d.parent / "real-store" / MARKER_NAME)
    (d / "index").mkdir()
    (d / "index" / "notes.txt").write_text("x")


def _marker_is_a_directory(d: Path) -> None:
    (d / MARKER_NAME).mkdir()
    (d / "index").mkdir()


def _legacy_garbage_index(d: Path) -> None:
    make_store(d)
    (d / MARKER_NAME).unlink()
    (d / "index" / "data.mdb").write_bytes(b"garbage" * 1000)


NOT_A_STORE: dict[str, Callable[[Path], None]] = {
    "an index/ holding the user's notes (issue 35)":
        lambda d: ((d / "index").mkdir(), (d / "index" / "notes.txt").write_text("x")),
    "slab-like files, no marker, no index": _slabs_only,
    "another program's LMDB environment at index/": _foreign_lmdb,
    "a store made before the marker whose index is garbage": _legacy_garbage_index,
    "marker and index both damaged": _damaged_marker_and_index,
    "the marker is a link to another store's": _marker_link,
    "a directory in place of the marker": _marker_is_a_directory,
}


@pytest.mark.parametrize("case", list(NOT_A_STORE))
def test_clear_refuses_what_it_cannot_prove_is_a_store(tmp_path, capsys, sentinel, case):
    target = tmp_path / "proj"
    target.mkdir()
    NOT_A_STORE[case](target)
    before = snapshot(tmp_path)
    code, _, err = cli(capsys, "clear", target)
    assert code == EXIT_USAGE, err
    assert f"{target} is not a kv-offload disk store" in err and "Nothing was deleted" in err
    assert "delete it yourself" in err
    assert snapshot(tmp_path) == before


def _user_files_inside(d: Path) -> list[str]:
    make_store(d)
    for rel in ("notes.txt", "index/notes.txt", f"slabs/{NS}/readme", "slabs/other/x"):
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text("the user's")
    return ["notes.txt", "index/notes.txt", f"slabs/{NS}/readme", "slabs/other/x"]


def _slab_link_outside(d: Path) -> list[str]:
    make_store(d)
    path = slab_path(d, NS, 0, 1)
    path.unlink()
    path.symlink_to(d.parent / "precious.txt")
    return [f"slabs/{NS}/rank0-of-1.slab"]


def _index_link_outside(d: Path) -> list[str]:
    make_store(d)
    shutil.move(d / "index", d.parent / "elsewhere")
    (d / "index").symlink_to(d.parent / "elsewhere", target_is_directory=True)
    return ["index"]


def _corrupt_index(d: Path) -> list[str]:
    make_store(d)
    (d / "index" / "data.mdb").write_bytes(b"garbage" * 1000)
    return []


def _legacy_store(d: Path) -> list[str]:
    make_store(d)
    (d / MARKER_NAME).unlink()
    return []


def _damaged_marker(d: Path) -> list[str]:
    make_store(d)
    (d / MARKER_NAME).write_text("not json")
    return []


def _slabs_and_marker_only(d: Path) -> list[str]:
    open_slab(d).close()  # a worker made the store before any index existed
    return []


STORES_TO_CLEAR: dict[str, Callable[[Path], list[str]]] = {
    "a store whose index is corrupt (proven by its marker)": _corrupt_index,
    "a store made before the marker (proven by its index)": _legacy_store,
    "a damaged marker, an intact index": _damaged_marker,
    "a store with only a marker and slab files": _slabs_and_marker_only,
    "a store holding the user's files": _user_files_inside,
    "a slab replaced by a link to a file outside": _slab_link_outside,
    "index/ replaced by a link to a directory outside": _index_link_outside,
}


@pytest.mark.parametrize("case", list(STORES_TO_CLEAR))
def test_clear_deletes_only_what_kv_offload_made(tmp_path, capsys, sentinel, case):
    root = tmp_path / "store"
    kept = STORES_TO_CLEAR[case](root)
    outside = {p: v for p, v in snapshot(tmp_path).items() if not p.startswith(f"{root}/")
               and p != str(root) and p != str(tmp_path)}
    code, out, err = cli(capsys, "clear", root)
    assert code == EXIT_OK, err
    assert f"cleared store {root}" in out
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []
    parents = {str(a) for k in kept for a in Path(k).parents} - {"."}
    assert left == sorted({*kept, *parents}), left
    if any("/" in k for k in kept):  # what is left inside index/ or slabs/ is listed
        assert "kv-offload did not create" in err
    after = snapshot(tmp_path)
    assert all(after.get(p) == v for p, v in outside.items())


@pytest.mark.parametrize("command", ["inspect", "verify", "clear"])
@pytest.mark.parametrize("value", ["", " ", "../x", "zz", "ab/cd", "a" * 129])
def test_a_malformed_namespace_option_is_an_error_not_everything(tmp_path, capsys, command,
                                                                 value):
    """`clear STORE --namespace "$NS"` with NS unset cleared the whole store."""
    root = make_store(tmp_path / "store")
    before = snapshot(root)
    code, _, err = cli(capsys, command, root, "--namespace", value)
    assert code == EXIT_USAGE
    assert f"--namespace {value!r} is not a namespace id" in err
    assert "leave --namespace out" in err
    assert snapshot(root) == before


def test_clear_of_one_namespace_on_an_unreadable_index_names_the_whole_store_fix(
        tmp_path, capsys):
    root = make_store(tmp_path / "store")
    (root / "index" / "data.mdb").write_bytes(b"garbage" * 1000)
    code, _, err = cli(capsys, "clear", root, "--namespace", NS)
    assert code == EXIT_FAILURE and f"clear the whole store with `kv-offload clear {root}`" in err
    assert slab_path(root, NS, 0, 1).exists()


# -- 2. a bad index record costs one miss, never the tier --------------------------------------

HEAD = struct.Struct("<BQQ")


def _with_slot(slot: int) -> Callable[[bytes], bytes]:
    return lambda v: v[:1] + struct.pack("<Q", slot) + v[9:]


BAD_RECORDS: dict[str, Callable[[bytes], bytes]] = {
    "slot 2**60 (issue 35)": _with_slot(2 ** 60),
    "slot 2**64-1": _with_slot(2 ** 64 - 1),
    "slot just past the namespace": _with_slot(NUM_SLOTS),
    "cut short to 2 bytes": lambda v: v[:2],
    "cut short inside the checksums": lambda v: v[:-3],
    "one byte too long": lambda v: v + b"\x00",
    "empty": lambda v: b"",
    "an unknown state": lambda v: b"\x07" + v[1:],
    "committed length, reserved state": lambda v: b"\x00" + v[1:],
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_a_bad_entry_record_is_one_miss_and_the_tier_keeps_storing(tmp_path, case, caplog):
    root = make_store(tmp_path / "store", num_chunks=3)
    put(root, "entries", f"{NS}/".encode() + key(1), BAD_RECORDS[case](entry_of(root, 1)))
    with open_index(root) as index, open_slab(root) as slab:
        assert [e.key for e in index.find_prefix([key(0), key(1), key(2)])] == [key(0)]
        assert [e.key for e in index.find_prefix([key(2)])] == [key(2)]
        slots = store_chunks(index, slab, range(10, 20))  # fills the namespace, then evicts
        assert None not in slots and all(0 <= s < NUM_SLOTS for s in slots)
        assert index.stats()["counters"]["bad_records"] == 1
        assert "removed 1 bad index record" in caplog.text
        (slot,) = store_chunks(index, slab, range(1, 2))  # the key can be stored again
        (entry,) = index.find_prefix([key(1)])
        out = np.empty(SLOT, np.uint8)
        assert slab.read(entry.slot, out, entry.checksums[0]) and np.array_equal(out, chunk(1))
    with open_index(root) as index, open_slab(root) as slab:  # and after a restart
        assert None not in store_chunks(index, slab, range(30, 34))


@pytest.mark.parametrize("db, name, value", [
    ("free", struct.pack(">Q", 2 ** 60), b""),  # what the old drop() left: issue 35
    ("free", b"\x01", b""),
    ("lru", struct.pack(">QQ", 1, 2 ** 60), key(99)),
    ("reservations", struct.pack(">Q", 2 ** 60), b"\x01\x02"),
    ("reservations", struct.pack(">Q", 5), b"short"),
    ("counters", b"hwm", b"\x01"),
], ids=["free-2**60", "free-short-key", "lru-2**60", "reservation-2**60", "reservation-short",
        "counter-short"])
def test_bad_free_lru_and_reservation_records_never_hand_out_a_bad_slot(tmp_path, db, name,
                                                                        value):
    root = make_store(tmp_path / "store", num_chunks=NUM_SLOTS)  # full: the next store evicts
    if db == "free":
        put(root, "counters", f"{NS}/free".encode(), struct.pack("<Q", 1))
    put(root, db, f"{NS}/".encode() + name, value)
    with open_index(root) as index, open_slab(root) as slab:
        slots = store_chunks(index, slab, range(100, 100 + NUM_SLOTS))
        assert None not in slots and all(0 <= s < NUM_SLOTS for s in slots)
        assert len(index.find_prefix([key(i) for i in range(100, 100 + NUM_SLOTS)])) == NUM_SLOTS


def test_verify_reports_bad_records_and_repair_drops_them(tmp_path, capsys):
    root = make_store(tmp_path / "store", num_chunks=4)
    put(root, "entries", f"{NS}/".encode() + key(1), _with_slot(2 ** 60)(entry_of(root, 1)))
    put(root, "entries", f"{NS}/".encode() + key(2), entry_of(root, 2)[:5])
    before = snapshot(root)
    code, out, err = cli(capsys, "verify", root)
    assert code == EXIT_FAILURE
    assert f"key {key(1).hex()[:16]}: slot {2 ** 60} lies outside the namespace's" in out
    assert f"key {key(2).hex()[:16]}: cut short: 5 bytes" in out
    assert f"kv-offload verify {root} --repair" in out
    assert snapshot(root) == before  # verify alone writes nothing
    assert cli(capsys, "inspect", root)[0] == EXIT_OK
    code, out, _ = cli(capsys, "verify", root, "--repair")
    assert code == EXIT_OK and "dropped 2" in out and "index consistent" in out
    code, out, _ = cli(capsys, "verify", root)
    assert code == EXIT_OK and "2 chunks checked" in out
    assert list_namespaces(root)[0]["counters"]["bad_records"] == 2


def test_a_damaged_namespace_record_is_an_error_with_the_fix(tmp_path, capsys):
    root = make_store(tmp_path / "store")
    put(root, "namespaces", NS.encode(), b'{"slot_bytes": "big"')
    for command in ("inspect", "verify"):
        code, _, err = cli(capsys, command, root)
        assert code == EXIT_FAILURE and f"namespace {NS}" in err and "is damaged" in err
        assert f"kv-offload clear {root}" in err
    with pytest.raises(Exception, match=f"namespace {NS}.*damaged.*kv-offload clear"):
        open_index(root)
    assert cli(capsys, "clear", root)[0] == EXIT_OK and not (root / "index").exists()


# -- 5. store files are opened as what they must be --------------------------------------------


def _plant(kind: str, path: Path, outside: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() or path.is_symlink():
        (shutil.rmtree if path.is_dir() and not path.is_symlink() else os.unlink)(path)
    if kind == "link":
        path.symlink_to(outside, target_is_directory=outside.is_dir())
    elif kind == "directory":
        path.mkdir(mode=0o700)
    else:
        os.mkfifo(path, 0o600)


PLANTED = [  # (what is planted where, opener)
    ("link", f"slabs/{NS}/rank0-of-1.slab", "slab"),
    ("directory", f"slabs/{NS}/rank0-of-1.slab", "slab"),
    ("fifo", f"slabs/{NS}/rank0-of-1.slab", "slab"),
    ("link", "slabs", "slab"),
    ("link", f"slabs/{NS}", "slab"),
    ("link", "index", "index"),
    ("link", "index/data.mdb", "index"),
    ("link", "index/lock.mdb", "index"),
    ("directory", "index/data.mdb", "index"),
    ("link", MARKER_NAME, "index"),
    ("directory", MARKER_NAME, "slab"),
]


@pytest.mark.parametrize("kind, rel, opener", PLANTED,
                         ids=[f"{k}-at-{r.replace(NS, 'NS')}-{o}" for k, r, o in PLANTED])
def test_a_link_directory_or_fifo_in_place_of_a_store_file_is_refused(tmp_path, kind, rel,
                                                                      opener, sentinel):
    root = make_store(tmp_path / "store")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = sentinel if rel.endswith((".slab", ".mdb", ".json")) else outside
    _plant(kind, root / rel, target)
    before = snapshot(tmp_path / "outside")
    with pytest.raises(StorePathError) as info:
        (open_slab if opener == "slab" else open_index)(root).close()
    message = str(info.value)
    assert str(root / rel) in message and ("Remove" in message or "remove" in message)
    assert snapshot(tmp_path / "outside") == before


def test_a_slab_replaced_by_a_link_under_a_running_store_is_never_followed(tmp_path, sentinel,
                                                                          caplog):
    root = make_store(tmp_path / "store")
    with open_index(root) as index, open_slab(root) as slab:
        (entry,) = index.find_prefix([key(0)])
        slab.path.unlink()
        slab.path.symlink_to(sentinel)
        out = np.empty(SLOT, np.uint8)
        assert slab.read(entry.slot, out, entry.checksums[0]) is ReadResult.IO_ERROR
        with pytest.raises(StorePathError, match="symbolic link"):
            slab.write(entry.slot, chunk(5))
    assert "symbolic link" in caplog.text


def test_verify_names_a_planted_slab_link(tmp_path, capsys, sentinel):
    root = make_store(tmp_path / "store")
    path = slab_path(root, NS, 0, 1)
    path.unlink()
    path.symlink_to(sentinel)
    code, _, err = cli(capsys, "verify", root)
    assert code == EXIT_FAILURE and str(path) in err and "symbolic link" in err


def test_another_programs_lmdb_environment_is_never_written(tmp_path):
    _foreign_lmdb(tmp_path)
    before = snapshot(tmp_path / "index" / "data.mdb")
    with pytest.raises(StorePathError, match="not a kv-offload index.*'users'.*another"):
        open_index(tmp_path)
    assert snapshot(tmp_path / "index" / "data.mdb") == before
    assert not (tmp_path / MARKER_NAME).exists()


def test_a_damaged_marker_stops_start_up_with_the_fix(tmp_path):
    root = make_store(tmp_path / "store")
    (root / MARKER_NAME).write_text("{}")
    with pytest.raises(StorePathError, match=f"{MARKER_NAME} is damaged.*remove"):
        open_index(root)
    (root / MARKER_NAME).unlink()  # the fix it names
    open_index(root).close()
    assert json.loads((root / MARKER_NAME).read_text())["magic"] == "kv-offload disk store"


# -- 6. the CLI never shows a traceback and inspect/verify never write ------------------------


def test_inspect_on_an_empty_index_file_is_an_error_and_writes_nothing(tmp_path, capsys):
    """inspect exited 0 with "0 namespaces" and initialised the empty file."""
    root = tmp_path / "store"
    (root / "index").mkdir(parents=True)
    (root / "index" / "data.mdb").touch()
    for command in ("inspect", "verify"):
        code, _, err = cli(capsys, command, root)
        assert code == EXIT_FAILURE and "data.mdb is empty or cut short (0 bytes)" in err
        assert f"kv-offload clear {root}" in err
    assert [p.name for p in (root / "index").iterdir()] == ["data.mdb"]
    assert (root / "index" / "data.mdb").stat().st_size == 0


def test_inspect_and_verify_write_nothing(tmp_path, capsys):
    """Not even the reclaim of a dead process's reservation every open does."""
    root = make_store(tmp_path / "store")
    code = ("import sys, os\nfrom kv_offload.disk import DiskIndex\n"
            f"i = DiskIndex.open({str(root)!r}, namespace_id={NS!r}, descriptor={{}}, "
            f"slot_bytes={SLOT}, num_ranks=1, capacity_bytes={NUM_SLOTS * SLOT})\n"
            "i.allocate([b'k' * 32]); os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    before = snapshot(root)
    assert cli(capsys, "inspect", root)[0] == EXIT_OK
    assert cli(capsys, "inspect", root, "--json")[0] == EXIT_OK
    assert cli(capsys, "verify", root)[0] == EXIT_OK
    assert snapshot(root) == before


def _as_nobody(*argv: object) -> tuple[int, str]:
    """Run the command in a forked child as user nobody (uid 65534, no capabilities);
    (exit code, stdout + stderr). The index probe's child interpreter is skipped: the
    venv's python may lie where nobody cannot execute it."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 99
        try:
            os.close(read_end)
            sys.stdout = sys.stderr = os.fdopen(write_end, "w")
            admin._probe_index = lambda root: None
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = main([str(a) for a in argv])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        output = f.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), output


@pytest.fixture
def public_dir():
    """A world-traversable directory (pytest's own tmp dirs are 0700)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the command as another user")
    path = Path(tempfile.mkdtemp(prefix="kv-offload-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("command", ["inspect", "verify", "clear"])
def test_a_store_the_user_cannot_read_is_an_error_not_a_traceback(public_dir, command):
    root = make_store(public_dir / "store")  # root's, mode 0700
    before = snapshot(root)
    code, output = _as_nobody(command, root)
    assert "Traceback" not in output and code == EXIT_USAGE, output
    assert f"cannot access {root}: Permission denied" in output
    assert "run as the user that owns" in output
    assert snapshot(root) == before


@pytest.mark.parametrize("command", ["inspect", "verify", "clear"])
def test_a_store_the_user_can_only_read(public_dir, command):
    """Readable (0755/0644) but not writable: LMDB needs lock.mdb writable to read."""
    root = make_store(public_dir / "store")
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    before = snapshot(root)
    code, output = _as_nobody(command, root)
    assert "Traceback" not in output and code == EXIT_USAGE, output
    assert f"{root / 'index'} is not accessible" in output and "Permission denied" in output
    assert "run as the user that owns" in output
    assert snapshot(root) == before


ODD_PATHS: dict[str, tuple[Callable[[Path], Path], int, str]] = {
    "a name with spaces, unicode and a newline": (
        lambda t: make_store(t / "my store ü\nx"), EXIT_OK, "1 namespace"),
    "a link to a store": (
        lambda t: (make_store(t / "s"), (t / "ln").symlink_to(t / "s"), t / "ln")[2],
        EXIT_OK, "1 namespace"),
    "the index file itself": (
        lambda t: make_store(t / "s") / "index" / "data.mdb", EXIT_USAGE, "is a file"),
    "a path below a file": (
        lambda t: (t / "f").write_text("x") and t / "f" / "store", EXIT_USAGE,
        "a part of the path is a file"),
    "a directory in place of index/data.mdb": (
        lambda t: ((t / "s" / "index" / "data.mdb").mkdir(parents=True), t / "s")[1],
        EXIT_USAGE, "data.mdb is not a file"),
    "a file in place of index/": (
        lambda t: ((t / "s").mkdir(), (t / "s" / "index").write_text("x"), t / "s")[2],
        EXIT_USAGE, "not a kv-offload disk store"),
    "a store whose slabs/ is a link": (
        lambda t: (make_store(t / "s"), shutil.move(t / "s" / "slabs", t / "sl"),
                   (t / "s" / "slabs").symlink_to(t / "sl"), t / "s")[3],
        EXIT_OK, "1 namespace"),
}


@pytest.mark.parametrize("case", list(ODD_PATHS))
def test_inspect_on_odd_paths(tmp_path, capsys, case):
    build, expected_code, expected = ODD_PATHS[case]
    path = build(tmp_path)
    code, out, err = cli(capsys, "inspect", path)
    assert code == expected_code and expected in out + err, err


def test_inspect_into_a_closed_pipe_is_quiet(tmp_path):
    """`kv-offload inspect STORE | head -1` ended in a BrokenPipeError traceback."""
    root = make_store(tmp_path / "store")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(f"{sys.executable} -m kv_offload.tools.cli inspect '{root}' | head -c 1",
                          shell=True, capture_output=True, text=True, env=env, timeout=120)
    assert "Traceback" not in proc.stderr and "Broken pipe" not in proc.stderr, proc.stderr
