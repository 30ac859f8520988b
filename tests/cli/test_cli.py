"""`kv-offload` inspect / verify / clear on stores filled directly with DiskIndex + SlabFile,
and every input error of `warm` (caught before any engine starts). No vLLM engine here."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kv_offload.disk import DiskIndex, SlabFile, iter_entries, list_namespaces
from kv_offload.disk.files import slab_dir, slab_path
from kv_offload.tools.cli import EXIT_BUSY, EXIT_FAILURE, EXIT_OK, EXIT_USAGE, main
from kv_offload.tools.warm_prompts import load_prompts

NS_A = "a1" * 16  # two ranks, six chunks
NS_B = "b2" * 16  # one rank, three chunks
SLOT = 4096
NUM_SLOTS = 64


def key_of(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def payload(key: bytes, rank: int) -> bytes:
    return hashlib.blake2b(key + bytes([rank]), digest_size=64).digest() * (SLOT // 64)


def fill(root: Path, ns: str, *, num_ranks: int, names: list[str], model: str) -> None:
    """Store one chunk per name the way the connector does: allocate, write, commit."""
    descriptor = {"model": model, "dtype": "float32", "kv_cache_dtype": "auto",
                  "num_layers": 2, "block_size": 32, "chunk_tokens": 64, "tp_size": num_ranks,
                  "hash_algo": "sha256", "attention": "full_attention"}
    keys = [key_of(n) for n in names]
    with DiskIndex.open(root, namespace_id=ns, descriptor=descriptor, slot_bytes=SLOT,
                        num_ranks=num_ranks, capacity_bytes=NUM_SLOTS * SLOT * num_ranks) as index:
        slabs = [SlabFile(root, namespace_id=ns, rank=r, num_ranks=num_ranks, slot_bytes=SLOT)
                 for r in range(num_ranks)]
        slots = index.allocate(keys)
        items = [(k, s, tuple(slab.write(s, payload(k, r)) for r, slab in enumerate(slabs)))
                 for k, s in zip(keys, slots)]
        assert all(index.commit(items))
        for slab in slabs:
            slab.close()


@pytest.fixture
def store(tmp_path) -> Path:
    root = tmp_path / "store"
    fill(root, NS_A, num_ranks=2, names=[f"a{i}" for i in range(6)], model="model-a")
    fill(root, NS_B, num_ranks=1, names=[f"b{i}" for i in range(3)], model="model-b")
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def corrupt(root: Path, ns: str, key: bytes, rank: int, num_ranks: int) -> int:
    slot = next(e.slot for e, _ in iter_entries(root, ns) if e.key == key)
    with open(slab_path(root, ns, rank, num_ranks), "r+b") as f:
        f.seek(slot * SLOT + 100)
        f.write(b"\xff\x00\xff")
    return slot


# -- help and usage ----------------------------------------------------------------------------


@pytest.mark.parametrize("command, option", [
    ([], "COMMAND"), (["warm"], "--prompts"), (["warm"], "--disk-path"),
    (["inspect"], "--json"), (["verify"], "--repair"), (["clear"], "--force"),
])
def test_help_of_every_command(capsys, command, option):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert out.startswith("usage: kv-offload") and option in out


def test_no_command_prints_help_and_fails(capsys):
    code, _, err = run(capsys)
    assert code == EXIT_USAGE and "COMMAND" in err


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_lists_namespaces_with_layout_and_sizes(store, capsys):
    code, out, _ = run(capsys, "inspect", store)
    assert code == EXIT_OK
    assert f"namespace {NS_A}" in out and f"namespace {NS_B}" in out
    assert "model-a" in out and "model-b" in out
    assert "6 of 64 slots" in out and "3 of 64 slots" in out
    assert "2 namespaces, 9 chunks" in out
    assert "commits 6" in out and "oldest 20" in out


def test_inspect_json_counts_bytes_and_access_times(store, capsys):
    code, out, _ = run(capsys, "inspect", store, "--json")
    data = json.loads(out)
    by_id = {n["namespace_id"]: n for n in data["namespaces"]}
    a = by_id[NS_A]
    assert code == EXIT_OK and data["chunks"] == 9
    assert a["chunks"] == 6 and a["num_ranks"] == 2 and a["chunk_bytes"] == 2 * SLOT
    assert a["used_bytes"] == 6 * 2 * SLOT and a["capacity_bytes"] == NUM_SLOTS * 2 * SLOT
    assert a["disk_bytes"] >= a["used_bytes"]
    assert a["oldest_access"] <= a["newest_access"]
    assert a["counters"]["commits"] == 6 and a["counters"]["checksum_failures"] == 0
    assert a["descriptor"]["model"] == "model-a"


def test_inspect_counts_request_tails(store, capsys):
    """Issue 33: the request tails among a namespace's chunks are counted (each takes a
    slot like a chunk)."""
    with DiskIndex.open(store, namespace_id=NS_B, descriptor={"model": "model-b"},
                        slot_bytes=SLOT, num_ranks=1, capacity_bytes=NUM_SLOTS * SLOT) as index:
        key = key_of("tail")
        (slot,) = index.allocate([key])
        index.settle([(key, slot, (0,))], tails={key: (key_of("b0"), (1, 2, 3))})
    code, out, _ = run(capsys, "inspect", store, "--json")
    by_id = {n["namespace_id"]: n for n in json.loads(out)["namespaces"]}
    assert by_id[NS_B]["chunks"] == 4 and by_id[NS_B]["tails"] == 1
    assert by_id[NS_A]["tails"] == 0
    code, out, _ = run(capsys, "inspect", store)
    assert code == EXIT_OK and "4 of 64 slots, 1 of them request tails" in out


def test_namespace_option_takes_a_unique_prefix(store, capsys):
    code, out, _ = run(capsys, "inspect", store, "--namespace", NS_B[:6], "--json")
    assert code == EXIT_OK
    assert [n["namespace_id"] for n in json.loads(out)["namespaces"]] == [NS_B]
    code, _, err = run(capsys, "inspect", store, "--namespace", "c3c3")
    assert code == EXIT_USAGE
    assert "not a namespace of this store" in err and NS_A in err and NS_B in err


@pytest.mark.parametrize("command", ["inspect", "verify", "clear"])
def test_path_errors_name_the_problem(tmp_path, capsys, command):
    code, _, err = run(capsys, command, tmp_path / "missing")
    assert code == EXIT_USAGE and "does not exist" in err
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, command, tmp_path / "file")
    assert code == EXIT_USAGE and "is a file" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, command, tmp_path / "empty")
    assert code == EXIT_USAGE and "not a kv-offload disk store" in err
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())


# -- verify ------------------------------------------------------------------------------------


def test_verify_clean_store(store, capsys):
    code, out, err = run(capsys, "verify", store)
    assert code == EXIT_OK and "OK: 2 namespaces, no bad chunks" in out
    assert "6/6 chunks" in err and "3/3 chunks" in err


def test_verify_reports_a_corrupt_chunk_and_repair_drops_it(store, capsys):
    bad = key_of("a2")
    slot = corrupt(store, NS_A, bad, rank=1, num_ranks=2)
    code, out, _ = run(capsys, "verify", store)
    assert code == EXIT_FAILURE
    assert f"key {bad.hex()[:16]} slot {slot} rank 1: checksum_mismatch" in out
    assert "1 bad chunks" in out and "--repair" in out
    assert len(list(iter_entries(store, NS_A))) == 6  # verify alone changes nothing

    code, out, _ = run(capsys, "verify", store, "--repair")
    assert code == EXIT_OK and "dropped 1" in out
    keys = {e.key for e, _ in iter_entries(store, NS_A)}
    assert bad not in keys and len(keys) == 5
    counters = {n["namespace_id"]: n["counters"] for n in list_namespaces(store)}
    assert counters[NS_A]["checksum_failures"] == 1 and counters[NS_B]["entries"] == 3
    assert run(capsys, "verify", store)[0] == EXIT_OK


def test_verify_missing_slab_file_marks_its_chunks_bad_without_recreating_it(store, capsys):
    path = slab_path(store, NS_B, 0, 1)
    path.unlink()
    code, out, _ = run(capsys, "verify", store, "--namespace", NS_B)
    assert code == EXIT_FAILURE and out.count(": missing") == 3
    assert not path.exists()
    code, out, _ = run(capsys, "verify", store, "--namespace", NS_B, "--repair")
    assert code == EXIT_OK and "dropped 3" in out
    assert list(iter_entries(store, NS_B)) == [] and len(list(iter_entries(store, NS_A))) == 6


def test_verify_namespace_checks_only_that_namespace(store, capsys):
    corrupt(store, NS_A, key_of("a0"), rank=0, num_ranks=2)
    code, out, _ = run(capsys, "verify", store, "--namespace", NS_B)
    assert code == EXIT_OK and NS_A not in out


def test_verify_reports_index_inconsistencies(store, capsys):
    """Counter drift, written through LMDB as docs/disk-tier.md lays the index out."""
    import lmdb

    env = lmdb.open(str(store / "index"), max_dbs=8)
    with env.begin(write=True) as txn:
        counters = env.open_db(b"counters", txn=txn)
        txn.put(f"{NS_B}/entries".encode(), (99).to_bytes(8, "little"), db=counters)
    env.close()
    code, out, _ = run(capsys, "verify", store)
    assert code == EXIT_FAILURE
    assert f"index problem: namespace {NS_B[:12]}: counter entries=99, found 3" in out
    assert "index INCONSISTENT" in out and f"kv-offload clear {store} --namespace" in out


# -- clear -------------------------------------------------------------------------------------


def test_clear_one_namespace_keeps_the_others(store, capsys):
    code, out, _ = run(capsys, "clear", store, "--namespace", NS_B)
    assert code == EXIT_OK and f"cleared namespace {NS_B}: 3 chunks" in out
    assert [n["namespace_id"] for n in list_namespaces(store)] == [NS_A]
    assert not slab_dir(store, NS_B).exists() and slab_dir(store, NS_A).is_dir()
    assert run(capsys, "verify", store)[0] == EXIT_OK


def test_clear_whole_store(store, capsys):
    code, out, _ = run(capsys, "clear", store)
    assert code == EXIT_OK and "2 namespaces" in out and "9 chunks" in out
    assert not (store / "index").exists() and not (store / "slabs").exists()


def test_a_corrupt_store_fails_inspect_but_can_be_cleared(store, capsys):
    (store / "index" / "data.mdb").write_bytes(b"garbage" * 1000)
    code, _, err = run(capsys, "inspect", store)
    assert code == EXIT_FAILURE and f"kv-offload clear {store}" in err  # the fix it names
    code, out, err = run(capsys, "clear", store)
    assert code == EXIT_OK and "index was unreadable" in out
    assert not (store / "index").exists() and not (store / "slabs").exists()


def test_an_index_cut_short_is_an_error_not_a_crash_and_can_be_cleared(store, capsys):
    """LMDB maps the index: reading a truncated data.mdb would kill the CLI with SIGBUS."""
    os.truncate(store / "index" / "data.mdb", 8192)
    code, _, err = run(capsys, "inspect", store)
    assert code == EXIT_FAILURE and "kv-offload clear" in err
    code, out, err = run(capsys, "clear", store)
    assert code == EXIT_OK and "index was unreadable" in out
    assert not (store / "index").exists()


HOLDER = textwrap.dedent("""
    import sys
    from kv_offload.disk import DiskIndex, SlabFile
    root, ns, what, slot = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    if what == "index":
        held = DiskIndex.open(root, namespace_id=ns, descriptor={}, slot_bytes=slot,
                              num_ranks=1, capacity_bytes=64 * slot, create=False)
    else:
        held = SlabFile(root, namespace_id=ns, rank=0, num_ranks=1, slot_bytes=slot)
    print("ready", flush=True)
    sys.stdin.read()  # holds the store until the test ends (kills it or closes stdin)
""")


@pytest.fixture
def holder(store):
    """Start another process that holds the store open; yields a starter function."""
    procs: list[subprocess.Popen] = []

    def start(ns: str, what: str) -> int:
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store), ns, what, str(SLOT)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc.pid

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_clear_refuses_while_another_process_has_the_store_open(store, holder, capsys):
    pid = holder(NS_B, "index")
    code, _, err = run(capsys, "clear", store)
    assert code == EXIT_BUSY and f"pid {pid}" in err and "--force" in err
    assert len(list_namespaces(store)) == 2  # nothing removed
    code, out, err = run(capsys, "clear", store, "--force")
    assert code == EXIT_OK and "warning" in err and not (store / "index").exists()


def test_clear_namespace_refuses_while_its_slab_is_open(store, holder, capsys):
    pid = holder(NS_B, "slab")
    code, _, err = run(capsys, "clear", store, "--namespace", NS_B)
    assert code == EXIT_BUSY and f"pid {pid}" in err
    assert run(capsys, "clear", store, "--namespace", NS_A)[0] == EXIT_OK  # not in use
    assert [n["namespace_id"] for n in list_namespaces(store)] == [NS_B]


def test_warm_finds_the_namespace_whose_slabs_its_engine_holds(store, holder, tmp_path,
                                                               monkeypatch):
    """warm asks the engine (its child processes) which namespace it opened, also through
    a relative, symlinked store path; none open is a clear error."""
    from kv_offload.tools.warm import WarmError, engine_namespace

    (tmp_path / "link").symlink_to(store, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(WarmError, match="did not open exactly one.*found: none"):
        engine_namespace("link")
    holder(NS_B, "slab")
    assert engine_namespace("link")["namespace_id"] == NS_B
    holder(NS_A, "slab")
    with pytest.raises(WarmError, match=f"found: {NS_A}, {NS_B}"):
        engine_namespace(str(store))


# -- warm: input errors, all caught before an engine starts ------------------------------------


@pytest.fixture
def warm_inputs(tmp_path, monkeypatch):
    """A fake model dir and a valid prompt file; vLLM made unimportable, so a case that got
    past validation would fail at once instead of starting an engine."""
    monkeypatch.setitem(sys.modules, "vllm", None)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    return tmp_path, model, prompts


def warm_args(model, prompts, *extra) -> list[str]:
    return ["warm", "--model", model, "--prompts", prompts, *extra]


@pytest.mark.parametrize("case, expected", [
    ("no_disk_path", "needs a disk path"),
    ("disk_path_is_file", "is a file, not a directory"),
    ("model_missing", "does not exist; check --model"),
    ("model_is_file", "is a file; pass a model directory"),
    ("model_without_config", "has no config.json"),
    ("prompts_missing", "does not exist; check --prompts"),
    ("prompts_empty", "holds no prompts"),
    ("prompts_not_utf8", "is not UTF-8 text"),
    ("prompts_bad_json", "prompts.jsonl:2: not valid JSON"),
    ("prompts_no_prompt_field", "prompts.jsonl:1: expected an object"),
    ("prompts_bad_type", "unsupported type '.csv'"),
    ("prompts_dir_without_txt", "has no .txt files"),
    ("config_missing", "cannot read --config"),
    ("config_bad_json", "bad.json: kv-offload config is not valid JSON"),
    ("config_unknown_key", "Did you mean 'disk_size'"),
    ("chunk_not_block_multiple", "not a multiple of vLLM's block size 32"),
    ("bad_size", "cannot parse 'lots'"),
    ("bad_engine_arg", "write KEY=VALUE"),
    ("bad_batch_size", "--batch-size must be >= 1"),
])
def test_warm_input_errors(warm_inputs, capsys, case, expected):
    tmp, model, prompts = warm_inputs
    disk = ["--disk-path", tmp / "store"]
    bad = tmp / ("prompts.csv" if case == "prompts_bad_type" else "prompts.jsonl")
    args = {
        "no_disk_path": warm_args(model, prompts),
        "disk_path_is_file": warm_args(model, prompts, "--disk-path", prompts),
        "model_missing": warm_args(tmp / "nope", prompts, *disk),
        "model_is_file": warm_args(prompts, prompts, *disk),
        "model_without_config": warm_args(tmp, prompts, *disk),
        "prompts_missing": warm_args(model, tmp / "nope.jsonl", *disk),
        "prompts_empty": warm_args(model, bad, *disk),
        "prompts_not_utf8": warm_args(model, bad, *disk),
        "prompts_bad_json": warm_args(model, bad, *disk),
        "prompts_no_prompt_field": warm_args(model, bad, *disk),
        "prompts_bad_type": warm_args(model, bad, *disk),
        "prompts_dir_without_txt": warm_args(model, tmp / "docs", *disk),
        "config_missing": warm_args(model, prompts, "--config", tmp / "nope.json"),
        "config_bad_json": warm_args(model, prompts, "--config", tmp / "bad.json"),
        "config_unknown_key": warm_args(model, prompts, "--config", tmp / "cfg.json"),
        "chunk_not_block_multiple": warm_args(model, prompts, *disk, "--block-size", "32",
                                              "--chunk-tokens", "48"),
        "bad_size": warm_args(model, prompts, *disk, "--disk-size", "lots"),
        "bad_engine_arg": warm_args(model, prompts, *disk, "--engine-arg", "oops"),
        "bad_batch_size": warm_args(model, prompts, *disk, "--batch-size", "0"),
    }[case]
    contents = {"prompts_empty": "\n\n", "prompts_not_utf8": b"\xff\xfe\x00",
                "prompts_bad_json": '{"prompt": "ok"}\n{"prompt": \n',
                "prompts_no_prompt_field": '{"text": "hello"}\n', "prompts_bad_type": "a,b\n"}
    if case in contents:
        data = contents[case]
        bad.write_bytes(data) if isinstance(data, bytes) else bad.write_text(data)
    (tmp / "docs").mkdir()
    (tmp / "docs" / "readme.md").write_text("not a prompt")
    (tmp / "bad.json").write_text("{disk_path: /x}")
    (tmp / "cfg.json").write_text(json.dumps({"disk_path": str(tmp / "s"), "disk_sise": "1GiB"}))
    code, _, err = run(capsys, *args)
    assert code == EXIT_USAGE, err
    assert err.startswith("kv-offload warm: error: ") and expected in err, err
    assert not (tmp / "store").exists()


def test_load_prompts_reads_jsonl_txt_and_directories(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a b"}\n\n{"messages": [{"role": "user", "content": "hi"}], '
                     '"cache_salt": "t1"}\n')
    first, second = load_prompts(jsonl)
    assert first.text == "a b" and first.messages is None
    assert second.messages == ({"role": "user", "content": "hi"},) and second.cache_salt == "t1"
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\n  \ntwo words\n")
    assert [p.text for p in load_prompts(txt)] == ["one", "two words"]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "b.txt").write_text("second doc\n")
    (docs / "a.txt").write_text("first doc\nline two\n")
    (docs / "skip.md").write_text("ignored")
    assert [p.text for p in load_prompts(docs)] == ["first doc\nline two\n", "second doc\n"]
