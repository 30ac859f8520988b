"""kv-offload under vLLM's real Scheduler and AsyncScheduler, without a model.

``SchedulerHarness`` (kv_offload/testing) runs vLLM's scheduler with kv-offload on both
sides, a fake model runner whose KV is a function of the tokens, and deterministic
background tasks and faults. Seeded random workloads (shared prefixes, aborts also while
loading, preemption under a small block pool, prefix-cache resets, slow, corrupt and
failing reads, copy failures, a full disk) must end idle: no request stuck, vLLM's block
pool free, no pins, reservations or jobs on either side, every CPU and disk slot holding
the KV of its key; every token is computed on the right KV (checked as it is computed).

More seeds: KV_OFFLOAD_HARNESS_SEEDS=200 (a count) or =100-300 (a range); the runs with
store copies behind the forward take the first KV_OFFLOAD_BG_SEEDS (default 10) of them.
The random runs call the worker hooks in the order of each model runner the installed
vLLM has (``MODEL_RUNNERS``: V1 and V2 on 0.32, V2 alone on 0.34; docs/architecture.md
"Hook order on both model runners"); the hybrid runs alternate them by seed, the
regressions use the installed vLLM's CPU backend's.
The regressions of issue 17 follow the random runs; the mamba hybrid runs (a mamba group
in vLLM's "align" mode, V1's hook order) come last.
"""

from __future__ import annotations

import logging
import os

import pytest
from harness_workload import run_workload
from vllm.v1.request import RequestStatus

from kv_offload.testing.scheduler_harness import Faults, SchedulerHarness
from kv_offload.testing.vllm_compat import installed_model_runners
from kv_offload.worker import host_copies

FAULTS = dict(delay=0.3, slow=0.05, corrupt_read=0.05, failed_read=0.05, copy_failure=0.05,
              enospc=0.05)
MODEL_RUNNERS = installed_model_runners()


def _seeds() -> list[int]:
    spec = os.environ.get("KV_OFFLOAD_HARNESS_SEEDS", "20")
    if "-" in spec:
        low, high = (int(x) for x in spec.split("-"))
        return list(range(low, high))
    return list(range(int(spec)))


@pytest.fixture(autouse=True)
def quiet_injected_faults(caplog):
    """Injected faults log errors by design; keep the test output readable."""
    caplog.set_level(logging.CRITICAL, logger="kv_offload")


@pytest.mark.parametrize("model_runner", MODEL_RUNNERS)
@pytest.mark.parametrize("copy_thread", [True, False], ids=["copy_thread", "vllm_thread"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", _seeds())
def test_random_workload_ends_idle_with_every_token_on_the_right_kv(
        harness_factory, seed, async_scheduling, copy_thread, model_runner):
    faults = Faults(seed=seed, **FAULTS) if seed % 2 else Faults(seed=seed, delay=0.3)
    harness = harness_factory(async_scheduling=async_scheduling, num_blocks=24, cpu_slots=8,
                              faults=faults, copy_thread=copy_thread,
                              model_runner=model_runner)
    stats = run_workload(harness, seed, num_requests=60, p_abort=0.05, max_tokens=12,
                         p_reset=0.2 if async_scheduling else 0.05)
    assert harness.check_idle() == [], f"seed {seed}: {stats}"
    assert harness.runner.num_checked_tokens > 0


def _store_on_disk_only(harness: SchedulerHarness, prompt: list[int]) -> None:
    """Compute ``prompt`` once (its chunks reach the CPU tier and the disk), then drop
    vLLM's prefix cache and the CPU tier: the disk alone holds it."""
    harness.add("writer", prompt, max_tokens=1)
    harness.run()
    assert harness.reset_prefix_cache(reset_connector=True)


def _doc(n: int, base: int) -> list[int]:
    return [3 + (base + 7 * i) % 997 for i in range(n)]


def test_a_cpu_chunk_past_a_cpu_miss_does_not_crash_the_scheduler(harness_factory):
    """Issue 17, bug 1: disk holds chunks 0 and 1, the CPU tier chunk 1 only, with a free
    slot; a request on that prefix made plan_load raise KeyError out of
    Scheduler.schedule(), which kills vLLM's engine core."""
    harness = harness_factory(cpu_slots=4, num_blocks=64)
    prefix = _doc(32, 0)  # chunks 0 and 1
    writer = harness.add("a", prefix + [5], max_tokens=1)
    harness.run()
    harness.scheduler_side.cpu.discard(writer.block_hashes[1])  # chunk 0 left the CPU tier
    assert harness.reset_prefix_cache(reset_connector=False)  # vLLM's own cache only
    harness.add("b", prefix + [9], max_tokens=2)
    harness.run()
    assert harness.check_idle() == []
    counters = harness.scheduler_side.counters
    assert counters.hit_tokens_disk == 16 and counters.hit_tokens_cpu == 16


def test_a_load_that_fails_from_its_first_block_does_not_stall_vllm(harness_factory):
    """Issue 17, bug 3: after a load failed from its first block, vLLM 0.32 re-admitted
    the request with a new asynchronous hit and counted its whole need twice (it stays in
    _inflight_prefills); with a pool smaller than twice that need it waited forever, and
    every request behind it too. kv-offload now answers "later", then a miss."""
    harness = harness_factory(num_blocks=24, faults=Faults(copy_failure=1.0))
    prompt = _doc(96, 0) + [5]  # 13 blocks of 8: twice that exceeds the 23 usable
    _store_on_disk_only(harness, prompt)
    harness.add("again", prompt, max_tokens=2)
    harness.add("behind", _doc(20, 500), max_tokens=2)
    harness.run(max_steps=400)
    assert harness.check_idle() == []
    assert harness.scheduler_side.counters.loads_given_up == 1


def test_a_shared_staging_slot_is_not_reused_under_a_waiting_job(harness_factory):
    """Issue 17, bug 2: job A stages a chunk from disk; job B hits it while it stages.
    A times out (its reads outlast load_timeout_s) although they succeed; A's report
    discarded the chunk and freed its slot with B's pin on it, a store took the slot
    and B copied the store's bytes into the engine: B computed on wrong KV silently."""
    fired: dict[str, int] = {"read": 0, "b_copy": 0}

    def delays(fn, args):
        name = getattr(fn, "__name__", "")
        if name == "_read":  # OffloadWorker._read: a read from a tier
            fired["read"] += 1
            return 8  # past the timeout of 5 steps
        job = getattr(args[0], "job", None) if args else None
        if name == "_copy_load" and getattr(job, "req_id", None) == "b":
            fired["b_copy"] += 1
            return 2  # B copies after a store could take a freed slot
        return None

    harness = harness_factory(num_blocks=64, cpu_slots=6, load_timeout_steps=5,
                              delay_rule=delays)
    prefix = _doc(32, 0)
    _store_on_disk_only(harness, prefix + [5])
    harness.add("a", prefix + [6], max_tokens=1)
    harness.step()
    assert harness.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    start = harness.step_index
    while harness.step_index < start + 5:
        harness.step()
    harness.add("b", prefix + [7], max_tokens=1)
    while harness.step_index < start + 8:
        harness.step()
    harness.add("c", _doc(20, 300), max_tokens=1)  # its store runs before B's copy
    harness.run()
    assert fired["read"] == 2 and fired["b_copy"] == 1, "the scripted delays did not apply"
    assert harness.scheduler_side.counters.hit_tokens_cpu >= 32, "B shared A's staging"
    assert harness.check_idle() == []


@pytest.mark.parametrize("copy_thread", [True, False], ids=["copy_thread", "vllm_thread"])
@pytest.mark.parametrize("ending", ["preempt", "abort"])
def test_a_failed_same_step_load_leaves_no_wrong_kv_in_vllms_prefix_cache(
        harness_factory, ending, copy_thread):
    """Seed 33's KVMismatchError (docs/vllm-bugs.md): a same-step load's copy fails;
    vLLM truncates the request and, under "recompute", keeps the blocks it cached when it
    allocated them (the failed ones, and those the forward then computed on them) in its
    prefix cache for the request to recompute in place. The request is preempted (or
    aborted) before it does; then the same prompt (the request resumed, or a new one)
    hit those blocks in vLLM's own cache and was computed on the failed KV. kv-offload
    now drops a failed load's blocks from vLLM's prefix cache."""
    harness = harness_factory(num_blocks=9, copy_thread=copy_thread)  # 8 usable blocks
    prompt = _doc(40, 0) + [5]  # 6 blocks of 8
    harness.add("writer", prompt, max_tokens=1)
    harness.run()
    assert harness.reset_prefix_cache(reset_connector=False)  # the CPU tier alone holds it
    for layer in harness.kv:  # the engine's blocks hold other KV than the prompt's
        layer.fill_(-3.0)
    ahead = harness.add("ahead", _doc(15, 500), max_tokens=4)  # a block more at its 3rd step
    harness.step()
    harness.faults = Faults(copy_failure=1.0)
    victim = harness.add("victim", prompt, max_tokens=2)
    harness.step()  # the same-step load fails; vLLM truncates the request to 0 tokens
    harness.faults = Faults()
    assert harness.scheduler_side.counters.loads_same_step == 1
    assert victim.status == RequestStatus.RUNNING and victim.num_computed_tokens == 0
    if ending == "abort":
        harness.abort("victim")
        harness.add("again", prompt, max_tokens=2)
    harness.step()  # "ahead" needs a block: vLLM preempts the victim, which recomputed nothing
    if ending == "preempt":
        assert victim.num_preemptions == 1 and victim.num_computed_tokens == 0
    harness.run()  # the KV of every position is checked before a token is computed on it
    assert ahead.is_finished() and harness.check_idle() == []
    again = harness.requests["victim" if ending == "preempt" else "again"]
    assert again.is_finished() and again.num_output_tokens == 2


def test_exceptions_in_connector_hooks_never_reach_vllm(harness_factory, monkeypatch):
    """Every scheduler hook degrades to a miss: a lookup that raises is a miss; a load
    plan that raises after vLLM was told to wait fails the load (recomputed, not hung);
    a step plan that raises still hands out the queued loads."""
    harness = harness_factory(num_blocks=64)
    prefix = _doc(32, 0)
    _store_on_disk_only(harness, prefix + [5])
    planner = harness.scheduler_side
    calls = {"plan_load": 0, "plan_step": 0}

    def failing(name, real):
        def run(*args, **kwargs):
            calls[name] += 1
            if calls[name] == 1:
                raise RuntimeError(f"injected {name} bug")
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(planner, "plan_load", failing("plan_load", planner.plan_load))
    monkeypatch.setattr(planner, "plan_step", failing("plan_step", planner.plan_step))
    harness.add("a", prefix + [6], max_tokens=2)
    harness.run()
    monkeypatch.setattr(planner, "num_matched_tokens", lambda *a: 1 // 0)
    harness.add("b", prefix + [7], max_tokens=2)
    harness.run()
    assert all(harness.requests[r].is_finished() for r in ("a", "b"))
    assert harness.check_idle() == [f"{planner.counters.hook_errors} exceptions caught in "
                                    "connector hooks"]
    assert planner.counters.hook_errors >= 3


@pytest.mark.parametrize("model_runner", MODEL_RUNNERS)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", _seeds()[:int(os.environ.get("KV_OFFLOAD_BG_SEEDS", "10"))])
def test_random_workload_with_store_copies_behind_the_forward(harness_factory, seed,
                                                               async_scheduling, model_runner):
    """Store copies run on their own thread and finish steps later (cpu_background_stores;
    as CUDA streams do): blocks of finished requests are held, preempted ones fenced, so
    no copy ever reads a block that another request already rewrote."""
    faults = Faults(seed=seed, delay=0.5)
    harness = harness_factory(async_scheduling=async_scheduling, num_blocks=24, cpu_slots=8,
                              faults=faults, background_stores=True,
                              model_runner=model_runner)
    stats = run_workload(harness, seed, num_requests=60, p_abort=0.05, max_tokens=12,
                         p_reset=0.05)
    assert harness.check_idle() == [], f"seed {seed}: {stats}"


def test_blocks_freed_under_a_slow_store_copy_are_reused_only_after_it(harness_factory):
    """Issue 15: request A finishes while the copy of its blocks to the CPU tier is still
    running (held back 4 steps); B needs every free block at once. A's blocks go back to
    vLLM only once the copy is done, so the CPU tier holds A's KV, not B's, and both
    requests' tokens are computed on the right KV."""
    def slow_store(fn, args):
        return 4 if getattr(fn, "__name__", "") == "store" else None

    harness = harness_factory(num_blocks=12, cpu_slots=8, background_stores=True,
                              delay_rule=slow_store, disk=False)
    harness.add("a", _doc(40, 0), max_tokens=1)  # 5 of the 11 usable blocks
    harness.step()
    harness.step()
    assert harness.requests["a"].is_finished()
    assert harness.scheduler_side.holds.num_held() == 1  # its copy is still running
    harness.add("b", _doc(80, 400), max_tokens=1)  # 10 blocks: needs A's
    harness.run()
    assert harness.requests["b"].is_finished()
    assert harness.check_idle() == []  # every CPU slot holds its key's KV
    counters = harness.scheduler_side.counters
    assert counters.chunks_stored_cpu - counters.tails_stored == 2 + 5  # whole chunks


def test_a_request_aborted_while_loading_is_not_also_held(harness_factory, monkeypatch):
    """A request is preempted while a store copy of its blocks runs (fenced), comes back
    with an asynchronous hit, and is aborted while that load runs. The scheduler side
    still counted the old copy and held the request; on CUDA, where a fence does not wait
    on the host, the worker reported it sent at once: vLLM freed its blocks under the
    running load, then asserted on its finished_recving and the engine core died."""
    stores = {"n": 0}

    def delays(fn, args):
        name = getattr(fn, "__name__", "")
        if name == "store":
            stores["n"] += 1
            return 8 if stores["n"] >= 2 else 0  # the second store copy is slow
        job = getattr(args[0], "job", None) if args else None
        if name == "_copy_load" and getattr(job, "req_id", None) == "a":
            return 3
        return None

    # As on CUDA: the fence orders the next forward after the copy on the device, and the
    # host does not wait (the copy may still run when poll looks at it).
    monkeypatch.setattr(host_copies.HostCopy, "fence", lambda self: None)
    harness = harness_factory(num_blocks=64, cpu_slots=8, disk=False, background_stores=True,
                              max_num_batched_tokens=32, delay_rule=delays,
                              load_timeout_steps=50, sync_load_budget_ms=0)  # an async load
    harness.add("a", _doc(56, 0), max_tokens=30)
    while stores["n"] < 2 and harness.step_index < 40:
        harness.step()
    assert harness.scheduler_side.holds.is_copying("a"), "the scripted delays did not apply"
    assert harness.reset_prefix_cache(reset_connector=False)  # preempts a
    harness.step()
    assert harness.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    harness.abort("a")
    harness.run(max_steps=40)
    assert harness.check_idle() == []


def test_a_full_connector_reset_serves_nothing_computed_before_it(harness_factory):
    """connector_reset="all" (the default): after vLLM resets the connector (as around a
    weight update), a prompt stored on disk and in the CPU tier is computed again, and
    everything ends idle."""
    harness = harness_factory(num_blocks=64, connector_reset="all")
    prompt = _doc(48, 0) + [5]
    harness.add("first", prompt, max_tokens=2)
    harness.run()
    assert harness.reset_prefix_cache(reset_connector=True)
    harness.add("again", prompt, max_tokens=2)
    harness.run()
    counters = harness.scheduler_side.counters
    assert counters.hit_tokens_cpu == counters.hit_tokens_disk == 0
    assert not harness.scheduler_side.disk_enabled
    assert harness.check_idle() == []


@pytest.mark.parametrize("ending", ["finish", "abort"])
def test_a_request_resumed_by_a_reset_is_held_for_the_copy_planned_with_its_fence(
        harness_factory, ending):
    """Issue 27: vLLM's reset with running requests (around weight updates) preempts a
    request and resumes it in the next schedule(), whose plan fences its old copies and
    stores a new chunk of its new blocks. That new copy's hold was forgotten with the
    fence: the request finished (or was aborted) while the copy ran, vLLM gave its blocks
    to another request, and the copy published that request's KV under this one's key."""
    def slow_store(fn, args):
        return 6 if getattr(fn, "__name__", "") == "store" else None

    harness = harness_factory(num_blocks=12, cpu_slots=8, background_stores=True,
                              delay_rule=slow_store, disk=False, max_num_batched_tokens=32,
                              partial_hits=False)  # b would also store a tail (slowly),
    # and vLLM refuses a reset while b is held for that copy
    harness.add("b", _doc(15, 900), max_tokens=1)  # shares step 1: a gets 17 tokens
    harness.add("a", _doc(40, 0), max_tokens=1 if ending == "finish" else 20)
    harness.step()  # a: chunk 0 complete, its copy held back
    assert harness.requests["b"].is_finished()
    assert harness.reset_prefix_cache(reset_connector=False)  # preempts a
    harness.step()  # a resumes: 32 tokens, fence of chunk 0's copy, chunk 1 stored
    assert harness.requests["a"].num_computed_tokens == 32
    assert harness.scheduler_side.holds.is_copying("a"), "the new copy is not tracked"
    if ending == "abort":
        harness.abort("a")
    else:
        harness.step()
        assert harness.requests["a"].is_finished()
    harness.add("c", _doc(80, 400), max_tokens=1)  # needs a's blocks
    harness.run()
    assert harness.requests["c"].is_finished()
    assert harness.check_idle() == []  # every CPU slot holds its own key's KV


WINDOWS = [(5,), (17,), (40,), (9, 30)]  # chunk 16 tokens, blocks of 8: a tail of 1 block,
# the whole chunk (window - 1 = chunk), longer than a chunk; two sliding-window groups


@pytest.mark.parametrize("background_stores", [False, True], ids=["stores_inline", "stores_behind"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("windows", WINDOWS, ids=lambda w: "w" + "-".join(map(str, w)))
@pytest.mark.parametrize("seed", _seeds()[:int(os.environ.get("KV_OFFLOAD_HYBRID_SEEDS", "5"))])
def test_hybrid_random_workload_ends_idle_with_every_token_on_the_right_kv(
        harness_factory, seed, windows, async_scheduling, background_stores):
    """vLLM's hybrid KV cache manager: a full-attention group and sliding-window groups
    over the same tensors (each group's KV differs, so a block copied through another
    group's layers shows). Sliding-window blocks are freed while requests run and when
    they finish; copies of them behind the forward are fenced before reuse; loads write
    only the blocks vLLM allocates; failed loads go through failed_recving."""
    faults = (Faults(seed=seed, **FAULTS) if seed % 2 and not background_stores
              else Faults(seed=seed, delay=0.5))
    harness = harness_factory(async_scheduling=async_scheduling, num_blocks=24, cpu_slots=8,
                              faults=faults, windows=windows,
                              background_stores=background_stores,
                              model_runner=MODEL_RUNNERS[seed % len(MODEL_RUNNERS)])
    stats = run_workload(harness, seed, num_requests=40, p_abort=0.05, max_tokens=12,
                         p_reset=0.1 if async_scheduling else 0.05)
    assert harness.check_idle() == [], f"seed {seed}: {stats}"
    assert harness.runner.num_checked_tokens > 0


PAUSES = {
    # vLLM 0.33/0.34 sleep(mode="abort"): every request aborted, then Worker.sleep ->
    # unregister_kv_caches; wake_up -> restore_kv_caches; the engine steps again after.
    "sleep_abort": dict(abort=True, steps_released=0),
    # vLLM 0.34 layer-wise weight update borrowing the KV cache (extensible_kv_cache):
    # unregister_kv_caches, the weights load, restore_kv_caches; no step in between.
    "weight_update": dict(abort=False, steps_released=0),
    # The engine steps while the KV cache is released (0.33/0.34 do not, as their pause
    # drains first; a batch in flight or a future vLLM may): the workers' reports tell the
    # scheduler side, which stops planning; plans made before it knew are refused.
    "steps_while_released": dict(abort=False, steps_released=6),
}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("pause", list(PAUSES))
def test_a_released_kv_cache_pauses_offloading_and_restoring_it_resumes(
        harness_factory, pause, async_scheduling):
    """Issue 32: vLLM 0.33+ calls unregister_kv_caches when it releases the KV cache
    memory (release_kv_cache_memory, sleep; 0.34 also a weight update borrowing it) and
    restore_kv_caches when it is back. kv-offload closed its worker on the first and
    ignored the second: the loading request never finished, held blocks were never
    released, stores planned afterwards were never reported, and the engine never went
    idle. Now it pauses: at the moment of the pause L is loading (its disk read held
    back), S is running with its store copy held back and H has finished, held for its
    copy. No engine copy runs between unregister and restore, everything ends idle,
    and the chunks stored before and during the pause serve the next requests."""
    held = {"_read": 0, "store": 0}  # OffloadWorker._read: a read from a tier
    fired: set[str] = set()

    def delays(fn, args):
        name = getattr(fn, "__name__", "")
        if held.get(name):
            fired.add(name)
        return held.get(name)

    mode = PAUSES[pause]
    harness = harness_factory(num_blocks=64, cpu_slots=12, background_stores=True,
                              delay_rule=delays, load_timeout_steps=100,
                              async_scheduling=async_scheduling)
    prompt = _doc(48, 0) + [5]
    _store_on_disk_only(harness, prompt)  # L's chunks: on disk only
    held.update(_read=30, store=30)
    harness.add("L", prompt[:-1] + [6], max_tokens=2)
    harness.add("H", _doc(33, 300), max_tokens=1)
    harness.add("S", _doc(40, 600), max_tokens=30)
    planner = harness.scheduler_side
    for _ in range(10):
        harness.step()
        if harness.requests["H"].is_finished() and planner.holds.is_copying("S"):
            break
    assert harness.requests["L"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert fired == {"_read", "store"}, "the scripted delays did not apply"
    assert planner.holds.num_held() == 1 and planner.holds.is_copying("S")
    assert harness.worker.has_pending_jobs()
    hits_before = planner.counters.hit_tokens_cpu + planner.counters.hit_tokens_disk
    jobs_before = set(planner.loads.records) | set(planner.stores.records)
    if mode["abort"]:
        harness.abort("L")
        harness.abort("S")
    harness.release_kv_cache()
    if mode["steps_released"]:
        for _ in range(mode["steps_released"]):
            harness.step()
        assert planner.paused, "the workers' reports did not tell the scheduler side"
        harness.add("M", prompt[:-1] + [7], max_tokens=2)  # all of it on disk
        for _ in range(4):
            harness.step()
        assert planner.counters.hit_tokens_cpu + planner.counters.hit_tokens_disk == (
            hits_before), "a lookup answered a hit while the KV cache was released"
        assert set(planner.loads.records) | set(planner.stores.records) <= jobs_before, (
            "a job planned while paused is still in flight")
    held.update(_read=0, store=0)
    harness.restore_kv_cache()
    harness.run()
    assert harness.check_idle() == []
    assert not planner.paused
    assert harness.reset_prefix_cache(reset_connector=False)  # the released memory's KV
    hits = planner.counters.hit_tokens_cpu + planner.counters.hit_tokens_disk
    harness.add("again", prompt[:-1] + [8], max_tokens=2)  # stored before the pause
    harness.add("again_h", _doc(32, 300) + [9], max_tokens=2)  # H's copy, held back
    harness.run()
    assert planner.counters.hit_tokens_cpu + planner.counters.hit_tokens_disk == hits + 48 + 32
    assert harness.check_idle() == []


MAMBA_RUNNERS = [r for r in MODEL_RUNNERS if r == "v1"]  # V2 zeroes before the fence
mamba_runner = pytest.mark.skipif(not MAMBA_RUNNERS, reason=(
    "mamba hybrids need V1's hook order (Model Runner V2 zeroes a reused block before "
    "the connector's fence; docs/architecture.md, Mamba state entries), which this vLLM "
    "no longer has"))


@mamba_runner
@pytest.mark.parametrize("background_stores", [False, True], ids=["stores_inline", "stores_behind"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", _seeds()[:int(os.environ.get("KV_OFFLOAD_MAMBA_SEEDS", "6"))])
def test_mamba_random_workload_ends_idle_with_every_state_right(
        harness_factory, seed, async_scheduling, background_stores):
    """A full-attention group and a mamba group in vLLM's "align" mode over the same
    tensors (docs/architecture.md, "Mamba state entries"): chunks are stored with the
    state vLLM hands over for their end, loads end at such a chunk and write its state
    into the block vLLM allocates, every step starts from the right state and every
    token on the right KV; state blocks vLLM frees under a copy behind the forward are
    fenced; with faults, preemption, aborts and resets, sync and async. Prefill steps of
    16 tokens (every chunk end is a step end) or, on odd seeds, 24 (one chunk end in two:
    chunks without a state are not stored, and runs break there)."""
    faults = (Faults(seed=seed, **FAULTS) if seed % 2 and not background_stores
              else Faults(seed=seed, delay=0.5))
    harness = harness_factory(async_scheduling=async_scheduling, num_blocks=24, cpu_slots=8,
                              faults=faults, mamba=True, background_stores=background_stores,
                              max_num_batched_tokens=24 if seed % 2 else 16,
                              model_runner=MAMBA_RUNNERS[0])
    stats = run_workload(harness, seed, num_requests=40, p_abort=0.05, max_tokens=12,
                         p_reset=0.1 if async_scheduling else 0.05)
    assert harness.check_idle() == [], f"seed {seed}: {stats}"
    counters = harness.scheduler_side.counters
    assert counters.chunks_stored_cpu > 0 and harness.runner.num_checked_tokens > 0


@mamba_runner
def test_a_state_block_freed_under_a_slow_store_copy_is_fenced_before_reuse(harness_factory):
    """vLLM frees a request's mamba state block two steps after handing it over (the next
    state was copied from it) and gives it to the other request, which zeroes and writes
    it. The copy of it to the CPU tier is held back 6 steps: the plan that sees the block
    gone from its place fences the copy before that step's forward, so the CPU slots hold
    the states of their keys (without the fence, both chunks' slots hold another state)."""
    def slow_store(fn, args):
        return 6 if getattr(fn, "__name__", "") == "store" else None

    harness = harness_factory(mamba=True, num_blocks=14, cpu_slots=8, disk=False,
                              background_stores=True, delay_rule=slow_store,
                              max_num_batched_tokens=16, model_runner=MAMBA_RUNNERS[0])
    harness.add("a", _doc(40, 100), max_tokens=1)
    harness.add("b", _doc(40, 500), max_tokens=1)
    harness.run()
    assert harness.check_idle() == []
    assert harness.scheduler_side.counters.chunks_stored_cpu == 3

