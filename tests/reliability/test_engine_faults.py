"""Faults injected into running engines, judged by what a user sees: tokens equal to a
no-connector recompute, no crash or hang, and the connector back to idle.

Two engines share one store (``<store>/slabs`` is a small tmpfs when mounting works):

1. An engine process is SIGKILLed, whole process group, while it stores heavy prompts
   to disk (in-process engine: scheduler, worker and their I/O threads die at the same
   instant; a multiprocess engine costs two more start-ups of vLLM and kills the same
   writers). Every committed entry must then verify with kv-offload's disk API alone.
2. A restarted engine on the same store, in-process (so the tests can read both connector
   halves), with a KV cache of 64 blocks so that vLLM preempts. Its phases, in order:
   convoy (N identical prefixes share one disk load), after_kill (only intact chunks hit;
   preemptions), abort (requests aborted while loading and while storing), salt_* (a
   different ``cache_salt`` never hits), fill (the slab file system is full), after_fill,
   truncated (slab truncated under the engine), deleted (store removed under the engine:
   the tier disables itself), disabled (serving goes on without it).

Both use ``--prefix-caching-hash-algo xxhash`` with PYTHONHASHSEED set: the disk tier
must then be on and hit across the restart (invariant 8).
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import numpy as np
import pytest
from engine_phases import run_phases
from reliability_support import CHUNK, MAX_TOKENS, PROMPTS, idle_problems, mount_tmpfs, unmount

from kv_offload.disk import DiskIndex, SlabFile, iter_entries, list_namespaces

pytestmark = pytest.mark.engine

ENV = {"PYTHONHASHSEED": "0"}
ENGINE = {"prefix_caching_hash_algo": "xxhash"}
# Slab bytes written in the heavy phase before SIGKILL. One step stores 4 prompts = 60
# chunks = 15 MiB in one job, committed when the whole job is written: at 24 MiB the
# first job is committed and the second is half written (torn, must stay invisible).
KILL_AFTER_BYTES = 24 << 20
SLAB_FS_SIZE = "96m"
# 64 usable blocks of 32 tokens (vLLM keeps one back): two 1020-token prompts fill them,
# so decoding preempts one.
SMALL_KV = {"kv_cache_memory_bytes": 65 * 32 * 4096, "max_model_len": 2048}
SALT_A = {"prompt": PROMPTS["salted"][0], "cache_salt": "a"}
SALT_B = {"prompt": PROMPTS["salted"][0], "cache_salt": "b"}
H = PROMPTS["heavy"]
F = PROMPTS["fresh"]
ABORT_PROMPTS = [F[0], H[0], F[1], H[1], H[2], F[2]]
ABORTED = [0, 1, 2]  # F[0] is storing, H[0] loading from disk, F[1] waiting for blocks


def offload(store: Path) -> dict:
    # connector_reset "cpu": the phases reset the CPU tier to make the disk tier answer.
    return {"cpu_size": "32MiB", "disk_path": str(store), "disk_size": "256MiB",
            "chunk_tokens": CHUNK, "io_threads": 2, "connector_reset": "cpu"}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The store; ``slabs/`` on a 96 MiB tmpfs when this machine lets us mount one."""
    root = tmp_path_factory.mktemp("faults") / "store"
    why_not = mount_tmpfs(root / "slabs", SLAB_FS_SIZE)
    yield root, why_not
    unmount(root / "slabs")


def slab_bytes(store: Path) -> int:
    """Bytes allocated to slab files (sparse files: blocks, not sizes)."""
    total = 0
    for path in store.glob("slabs/*/*.slab"):
        with contextlib.suppress(FileNotFoundError):  # a slab may vanish while we look
            total += path.stat().st_blocks * 512
    return total


def committed_entries(root) -> int:
    """Committed chunks in the store's (only) namespace; 0 before it exists."""
    try:
        namespaces = list_namespaces(root)
    except Exception:  # the engine is creating the store right now
        return 0
    return namespaces[0]["counters"]["entries"] if namespaces else 0


@pytest.fixture(scope="module")
def killed(store, start_engine, reference) -> dict:
    """Engine 1: stores the seed prompt, then is SIGKILLed during the heavy phase."""
    root, _ = store
    engine = start_engine("killed", offload(root), env=ENV, **ENGINE).wait_ready()
    engine.generate(PROMPTS["seed"], max_tokens=MAX_TOKENS)
    engine.drain()
    baseline, seed_entries = slab_bytes(root), committed_entries(root)  # its chunks and tail
    engine.submit({"op": "generate", "prompts": H, "max_tokens": MAX_TOKENS})
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None or engine.has_answer():
            pytest.fail(f"the heavy phase ended before the kill:\n{engine.log(4000)}")
        # Kill once a heavy job is committed (more entries than the seed's) and the next
        # one is being written: on a loaded machine the commit can trail the bytes.
        if (slab_bytes(root) >= baseline + KILL_AFTER_BYTES
                and committed_entries(root) > seed_entries):
            break
        time.sleep(0.05)
    else:
        engine.kill()
        pytest.fail(f"the heavy phase never wrote {KILL_AFTER_BYTES} bytes:\n"
                    f"{engine.log(4000)}")
    written = slab_bytes(root) - baseline
    engine.kill()
    return {"written_in_heavy": written, "seed_entries": seed_entries, "log": engine.log()}


@pytest.fixture(scope="module")
def restarted(store, killed, start_engine, unseeded_engine, quick_soak) -> dict:
    """Engine 2 on the same store; see the module docstring for its phases. (It asks for
    ``unseeded_engine`` and ``quick_soak`` only to start them now: vLLM start-ups, mostly
    imports, overlap well even on 2 cores.)"""
    root, why_not = store
    run = lambda name, prompts, **kw: {"name": name, "prompts": prompts,  # noqa: E731
                                       "max_tokens": MAX_TOKENS, **kw}
    phases = [
        run("convoy", PROMPTS["convoy"]),
        run("after_kill", H, verify=True),
        run("abort", ABORT_PROMPTS, reset="all", abort={"after_steps": 1, "indexes": ABORTED}),
        run("salt_a", [SALT_A]),
        run("salt_b", [SALT_B], reset="all"),
        run("salt_a_again", [SALT_A], reset="all"),
    ]
    if why_not is None:
        phases += [
            run("fill", PROMPTS["fill"], before=["fill_slab_fs"], verify=True),
            run("after_fill", PROMPTS["fill"], reset="all", before=["free_slab_fs"]),
        ]
    phases += [
        run("truncated", [SALT_A, H[3], H[4]], reset="all",
            before=["snapshot_files", "truncate_slabs"]),
        run("deleted", H[5:8], reset="all", before=["delete_store"]),
        run("disabled", H[8:10], reset="all"),
    ]
    engine = start_engine("restarted", offload(root), env=ENV, **ENGINE, **SMALL_KV)
    return run_phases(engine, phases, store=root)


def phase(run: dict, name: str) -> dict:
    if name not in run["by_name"]:
        pytest.skip(f"phase {name} did not run")
    return run["by_name"][name]


# ---- 1. kill -9 during heavy stores ------------------------------------------------------

def test_after_kill_every_committed_entry_verifies_without_the_engine(killed, store):
    """Invariant 7 on a real engine: what the killed process committed is intact, its
    reservations are reclaimed on reopen, and the index is consistent."""
    root, _ = store
    assert killed["written_in_heavy"] >= KILL_AFTER_BYTES
    (ns,) = list_namespaces(root)
    slot_bytes, ns_id = ns["slot_bytes"], ns["namespace_id"]
    buf = np.empty(slot_bytes, np.uint8)
    entries = [entry for entry, _ in iter_entries(root, ns_id)]
    assert len(entries) > killed["seed_entries"], "no heavy chunk was committed before the kill"
    with SlabFile(root, namespace_id=ns_id, rank=0, num_ranks=1, slot_bytes=slot_bytes) as slab:
        results = [slab.read(e.slot, buf, e.checksums[0]) for e in entries]
    assert [r.name for r in results if not r] == []
    index = DiskIndex.open(root, namespace_id=ns_id, descriptor=ns["descriptor"],
                           slot_bytes=slot_bytes, num_ranks=1,
                           capacity_bytes=ns["num_slots"] * slot_bytes)
    try:
        assert index.check() == []
        assert index.stats()["reserved"] == 0
    finally:
        index.close()


def test_restart_after_kill_hits_only_intact_chunks_and_matches_recompute(restarted,
                                                                           reference):
    p = phase(restarted, "after_kill")
    assert p["tokens"] == reference.tokens(H)
    assert p["metrics"]["hits_disk"] > 0, "nothing the killed engine committed was served"
    assert p["counters_delta"]["load_errors"] == 0
    assert p["kv_offload"].get("kv_offload_checksum_failures_total{}", 0) == 0
    assert set(p["verify"]) == {"OK"}, p["verify"]


def test_seeded_xxhash_keeps_the_disk_tier_on_across_restarts(restarted):
    p = phase(restarted, "convoy")
    assert p["connector"]["persistent"]
    assert p["metrics"]["hits_disk"] >= 320


# ---- 6. a convoy of identical prefixes shares one load -------------------------------------

def test_identical_prefixes_share_one_disk_load(restarted, reference):
    """Five requests for the same 5-chunk prefix, all at once after a restart: the disk
    is read once (5 chunks); the other four wait on that read and copy from the host."""
    p = phase(restarted, "convoy")
    assert p["tokens"] == reference.tokens(PROMPTS["convoy"])
    delta, chunks = p["counters_delta"], 320 // CHUNK
    assert delta["chunks_loaded_disk"] == chunks
    assert delta["chunks_loaded_cpu"] == chunks * (len(PROMPTS["convoy"]) - 1)
    read = p["kv_offload"]["kv_offload_transfer_bytes_total{direction=disk_read}"]
    assert read == chunks * p["connector"]["slot_bytes"]


# ---- 5. preemption and abort -----------------------------------------------------------------

def test_preempted_requests_leave_no_pins_and_match_recompute(restarted, reference):
    p = phase(restarted, "after_kill")
    assert p["metrics"]["preemptions"] > 0, "the scenario did not preempt"
    assert p["tokens"] == reference.tokens(H)
    assert idle_problems(p["connector"]) == []


def test_requests_aborted_while_loading_or_storing_leave_no_pins(restarted, reference):
    p = phase(restarted, "abort")
    kept = [q for i, q in enumerate(ABORT_PROMPTS) if i not in ABORTED]
    assert p["tokens"] == reference.tokens(kept)
    assert idle_problems(p["connector"]) == []


def test_every_phase_ends_idle(restarted):
    """After each phase drained: no pinned, STORING or STAGING CPU entry, no job, no disk
    pin or reservation (also after faults)."""
    problems = {p["name"]: idle_problems(p["connector"]) for p in restarted["phases"]}
    assert {k: v for k, v in problems.items() if v} == {}


# ---- 7. isolation ----------------------------------------------------------------------------

def test_cache_salt_never_shares_chunks(restarted, reference):
    a, b, again = (phase(restarted, n) for n in ("salt_a", "salt_b", "salt_a_again"))
    ref = reference.tokens([SALT_A])
    assert a["tokens"] == b["tokens"] == again["tokens"] == ref
    assert b["metrics"]["external_hits"] == 0
    assert b["counters_delta"]["hit_tokens_cpu"] == b["counters_delta"]["hit_tokens_disk"] == 0
    assert again["metrics"]["external_hits"] >= 640  # salt "a" still hits after "b"


FIXED_NAMES = [r"index", r"index/(data|lock)\.mdb", r"kv-offload-store\.json", r"slabs",
               r"slabs/[0-9a-f]{32}", r"slabs/[0-9a-f]{32}/rank0-of-1\.slab"]


def test_store_is_private_and_no_request_data_names_a_file(restarted):
    """Every file the store holds after serving salted and unsalted prompts matches a fixed
    pattern (no key, salt or prompt in a name); directories 0700, files 0600."""
    snap = phase(restarted, "truncated")["faults"]["snapshot_files"]
    assert snap, "the store is empty"
    odd = [f["path"] for f in snap if not any(re.fullmatch(r, f["path"]) for r in FIXED_NAMES)]
    assert odd == []
    modes = {f["path"]: f["mode"] for f in snap}
    files = (".mdb", ".slab", ".json")
    assert {m for p, m in modes.items() if p.endswith(files)} == {"0o600"}
    assert {m for p, m in modes.items() if not p.endswith(files)} == {"0o700"}


# ---- 2. disk full ----------------------------------------------------------------------------

def test_full_disk_fails_stores_softly(restarted, reference):
    """The slab file system is full: stores fail (counted, one log line per burst),
    serving continues, and nothing half-written becomes visible."""
    p = phase(restarted, "fill")
    assert p["faults"]["fill_slab_fs"] <= 2 << 20
    assert p["tokens"] == reference.tokens(PROMPTS["fill"])
    errors = p["kv_offload"].get("kv_offload_disk_write_errors_total{}", 0)
    assert errors > 0
    delta = p["counters_delta"]
    assert delta["chunks_stored_disk"] + errors <= delta["chunks_stored_cpu"]
    assert set(p["verify"]) == {"OK"}, p["verify"]
    assert p["connector"]["disk_enabled"], "a full disk is per chunk, not a broken tier"
    # One line per burst of failures, never one per chunk: a write that still fits (a
    # slot whose pages the slab already holds) ends a burst, and the next failure logs again.
    lines = restarted["log"].count("disk write failed")
    assert lines >= 1 and (lines < errors or errors == 1), (lines, errors)
    after = phase(restarted, "after_fill")
    assert after["tokens"] == reference.tokens(PROMPTS["fill"])
    assert after["counters_delta"]["load_errors"] == 0


# ---- 3. store damaged under a running engine ---------------------------------------------

def test_truncated_slab_is_recomputed(restarted, reference):
    p = phase(restarted, "truncated")
    assert p["tokens"] == reference.tokens([SALT_A, H[3], H[4]])
    assert p["counters_delta"]["load_errors"] > 0, "the truncated chunks were not looked up"
    assert p["connector"]["disk_enabled"], "short reads are misses, not a broken disk"
    assert "could not be read (ReadResult.SHORT_READ)" in restarted["log"]


def test_deleted_store_disables_the_tier_with_a_clear_log_line(restarted, reference):
    p = phase(restarted, "deleted")
    assert p["tokens"] == reference.tokens(H[5:8])
    assert not p["connector"]["disk_enabled"]
    line = next(x for x in restarted["log"].splitlines() if "disk tier keeps failing" in x)
    assert "disabled for this run" in line and "restart" in line
    later = phase(restarted, "disabled")
    assert later["tokens"] == reference.tokens(H[8:10])
    assert later["metrics"]["hits_disk"] == 0
