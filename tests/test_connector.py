"""KVOffloadConnector's scheduler side with scheduler outputs built by hand (as vLLM tests
its connectors): the arithmetic of ``build_connector_meta`` (speculative drafts are not
stored), holds through ``request_finished`` / ``finished_sending``, preemption fences."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kv_offload import OffloadConfig
from kv_offload.jobs import ChunkMove, LoadJob, StepPlan, StoreJob, WorkerReport
from kv_offload.plugin.connector import (
    KVOffloadConnector,
    OffloadConnectorMetadata,
    OffloadWorkerMetadata,
)
from kv_offload.plugin.engine_info import UnsupportedEngineError
from kv_offload.testing.scheduler_harness import build_kv_cache_config, build_vllm_config
from kv_offload.worker.runner import PollResult

BLOCK = 8
CHUNK = 2 * BLOCK


class FakeCacheManager:
    """The two things the connector asks vLLM's KV cache manager."""

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}
        self.block_pool = None

    def get_block_ids(self, req_id: str) -> tuple[list[int]]:
        return (self.blocks[req_id],)


@pytest.fixture
def connector(request):
    extra = {"partial_hits": False, **getattr(request, "param", {})}  # one store job a step
    offload = OffloadConfig(cpu_size=64 * 2 * CHUNK * 4 * 4 * 4, chunk_tokens=CHUNK, **extra)
    vllm_config = build_vllm_config(offload, block_size=BLOCK, max_num_batched_tokens=64,
                                    max_num_seqs=8)
    conn = KVOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER,
                              build_kv_cache_config(64, BLOCK))
    manager = FakeCacheManager()
    conn._kv_cache_manager = manager  # what bind_kv_cache_manager sets
    yield conn, manager
    conn.shutdown()


def new_request(manager: FakeCacheManager, req_id: str, num_tokens: int, first_block: int):
    from vllm import SamplingParams

    init_none_hash(sha256)
    tokens = [(7 * i + len(req_id)) % 500 + 3 for i in range(num_tokens)]
    request = Request(req_id, tokens, SamplingParams(max_tokens=8), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    manager.blocks[req_id] = list(range(first_block, first_block + num_tokens // BLOCK + 1))
    return request


def scheduler_output(*, new=(), cached=(), spec=None, preempted=()):
    """The SchedulerOutput fields the connector reads. ``new``: (request, tokens
    scheduled); ``cached``: (req_id, computed before, tokens scheduled)."""
    num_scheduled = {**{r.request_id: n for r, n in new}, **{rid: n for rid, _, n in cached}}
    return SimpleNamespace(
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens=spec or {},
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, num_computed_tokens=0)
                            for r, _ in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[rid for rid, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached]),
        preempted_req_ids=set(preempted))


def admit(conn, request) -> None:
    hit, _ = conn.get_num_new_matched_tokens(request, 0)
    assert hit == 0
    conn.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([],)), 0)


def test_prefill_stores_every_completed_chunk(connector):
    conn, manager = connector
    request = new_request(manager, "a", 3 * CHUNK + 5, first_block=10)
    admit(conn, request)
    plan = conn.build_connector_meta(scheduler_output(new=[(request, 3 * CHUNK + 5)])).plan
    (job,) = plan.stores
    assert [m.block_ids for m in job.chunks] == [(10, 11), (12, 13), (14, 15)]
    assert job.req_ids == ("a", "a", "a")


@pytest.mark.parametrize("connector", [{"store_generated": True}], indirect=True)
def test_speculative_drafts_are_not_counted_as_computed(connector):
    """Regression guard: vLLM schedules drafts as tokens; the KV of rejected drafts must
    never complete a chunk. A request at 14 computed tokens with 1 new token and 3 drafts
    reaches 15, not 18: chunk 0 (16 tokens) is not stored yet; the next step reaches 16."""
    conn, manager = connector
    request = new_request(manager, "s", 14, first_block=0)
    admit(conn, request)
    conn.build_connector_meta(scheduler_output(new=[(request, 14)]))
    for _ in range(2 + 3):  # tokens the request "generated", drafts included
        request.append_output_token_ids(11)
    out = scheduler_output(cached=[("s", 14, 4)], spec={"s": [11, 11, 11]})
    assert conn.build_connector_meta(out).plan.stores == ()
    out = scheduler_output(cached=[("s", 15, 2)], spec={"s": [11]})  # reaches 16
    (job,) = conn.build_connector_meta(out).plan.stores
    assert [m.block_ids for m in job.chunks] == [(0, 1)]


def test_a_request_finishing_under_its_copy_is_held_until_sent(connector):
    conn, manager = connector
    request = new_request(manager, "h", 2 * CHUNK + 1, first_block=20)
    admit(conn, request)
    plan = conn.build_connector_meta(scheduler_output(new=[(request, 2 * CHUNK + 1)])).plan
    (job,) = plan.stores
    assert conn.request_finished(request, manager.blocks["h"]) == (True, None)
    assert conn.has_pending_block_frees()
    assert conn.build_connector_meta(scheduler_output()).plan.held == ("h",)
    report = WorkerReport(host_stored={job.job_id: 1})
    conn.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=OffloadWorkerMetadata(report), kv_connector_stats=None,
        finished_sending={"h"}))
    assert not conn.has_pending_block_frees() and not conn.has_pending_push_work()


def test_a_request_whose_copies_are_reported_is_freed_at_once(connector):
    conn, manager = connector
    request = new_request(manager, "f", CHUNK + 1, first_block=30)
    admit(conn, request)
    (job,) = conn.build_connector_meta(scheduler_output(new=[(request, CHUNK + 1)])).plan.stores
    conn.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=OffloadWorkerMetadata(WorkerReport(host_stored={job.job_id: 1})),
        kv_connector_stats=None, finished_sending=None))
    assert conn.request_finished(request, manager.blocks["f"]) == (False, None)


def test_preempted_requests_with_copies_in_flight_are_fenced(connector):
    conn, manager = connector
    a = new_request(manager, "p", CHUNK + 1, first_block=40)
    b = new_request(manager, "q", 4, first_block=50)
    admit(conn, a)
    admit(conn, b)
    conn.build_connector_meta(scheduler_output(new=[(a, CHUNK + 1), (b, 4)]))
    plan = conn.build_connector_meta(scheduler_output(preempted=["p", "q"])).plan
    assert plan.preempted == ("p",)  # "q" stored nothing: nothing to fence


def test_workers_wait_for_loads_only_in_a_step_without_forward(connector):
    """The plan marks a step in which vLLM scheduled no token; only then does the
    worker's ``get_finished`` wait (briefly) for loads in flight instead of returning."""
    conn, manager = connector
    request = new_request(manager, "w", CHUNK + 1, 0)
    admit(conn, request)
    assert conn.build_connector_meta(scheduler_output()).idle
    assert not conn.build_connector_meta(scheduler_output(new=[(request, CHUNK + 1)])).idle

    worker_side = KVOffloadConnector(conn._vllm_config, KVConnectorRole.WORKER,
                                     build_kv_cache_config(64, BLOCK))
    polls = []
    worker_side._worker = SimpleNamespace(
        poll=lambda *, idle=False: polls.append(idle) or PollResult(set(), set()))
    for idle in (True, False):
        worker_side.bind_connector_metadata(OffloadConnectorMetadata(StepPlan(), idle=idle))
        assert worker_side.get_finished(set()) == (None, None)
        worker_side.clear_connector_metadata()
    assert polls == [True, False]
    worker_side._worker = None


def test_a_healthy_server_slower_than_the_lookup_budget_is_not_a_failure(redis_server):
    """The lookup budget bounds a request's wait, not the connection: replies held 60 ms
    against a 20 ms budget make that request miss, but the tier stays up (no backoff, no
    failure logged), because its connection keeps ``remote_timeout_s``. (It used the
    budget as its socket and connect timeout: every slow reply was a failure, and a
    server farther than the budget, or a TLS handshake longer, never connected.)"""
    from kv_offload.testing.redis_server import SlowProxy

    with SlowProxy(redis_server.port, delay_s=(0.06, 0.06)) as proxy:
        offload = OffloadConfig(cpu_size=64 * 2 * CHUNK * 4 * 4 * 4, chunk_tokens=CHUNK,
                                remote_url=proxy.url, remote_lookup_budget_ms=20,
                                remote_timeout_s=2)
        conn = KVOffloadConnector(build_vllm_config(offload, block_size=BLOCK,
                                                    max_num_batched_tokens=64, max_num_seqs=8),
                                  KVConnectorRole.SCHEDULER, build_kv_cache_config(64, BLOCK))
        try:
            manager = FakeCacheManager()
            conn._kv_cache_manager = manager
            request = new_request(manager, "r", 2 * CHUNK + 1, first_block=0)
            index = conn._scheduler.tier("remote")
            remote = index.remote
            assert conn.get_num_new_matched_tokens(request, 0)[0] is None  # asked, pending
            deadline = time.monotonic() + 30  # bounds a hang only
            while index.num_pending():  # the lookup threads started with the engine
                assert time.monotonic() < deadline, "the lookup's round trip never ended"
                time.sleep(0.005)
            # Past the budget whether or not the answer is published yet: a miss.
            assert conn.get_num_new_matched_tokens(request, 0)[0] == 0  # nothing stored
            assert remote.health.up and remote.health.num_failures == 0
        finally:
            conn.shutdown()


@pytest.mark.parametrize("verify", [True, False])
def test_unverified_loads_from_a_store_are_warned_about(tmp_path, caplog, verify):
    """Without checksums, a chunk another instance sharing the store rewrites during a
    read is served as is: the operator is told so at start-up."""
    offload = OffloadConfig(cpu_size=64 * 2 * CHUNK * 4 * 4 * 4, chunk_tokens=CHUNK,
                            disk_path=str(tmp_path), verify_checksums=verify)
    vllm_config = build_vllm_config(offload, block_size=BLOCK, max_num_batched_tokens=64,
                                    max_num_seqs=8)
    with caplog.at_level("WARNING", logger="kv_offload"):
        conn = KVOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER,
                                  build_kv_cache_config(64, BLOCK))
    conn.shutdown()
    assert ("verify_checksums is off" in caplog.text) is not verify


@pytest.fixture
def worker_connector():
    """A worker-side connector over fake CPU-backend KV tensors (two layers)."""
    from kv_offload.testing.fake_model import make_kv_tensors

    offload = OffloadConfig(cpu_size=8 * 2 * CHUNK * 4 * 4 * 2, chunk_tokens=CHUNK)
    vllm_config = build_vllm_config(offload, block_size=BLOCK, max_num_batched_tokens=64,
                                    max_num_seqs=8)
    kv_cache_config = build_kv_cache_config(64, BLOCK)
    conn = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv = make_kv_tensors(len(kv_cache_config.kv_cache_groups[0].layer_names), 64, BLOCK)
    for i, layer in enumerate(kv):
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).reshape(layer.shape) + i)
    conn.register_kv_caches(dict(zip(kv_cache_config.kv_cache_groups[0].layer_names, kv)))
    yield conn, kv
    conn.shutdown()


def worker_step(conn, plan: StepPlan, *, runner: str = "v1",
                after_forward=lambda: None) -> tuple[set[str], WorkerReport]:
    """One step of the worker-side hooks in ``runner``'s order with ``plan``: the requests
    reported loaded and the report. The CPU backend's engine copies stores where they are
    issued and CPU-tier loads in ``start_load_kv``, so one step reports both.
    ``after_forward``: what the runner does between the forward and ``wait_for_save``
    (V2: ``finish_forward`` first, then sampling and drafting)."""
    meta = OffloadConnectorMetadata(plan)
    conn.handle_preemptions(meta)
    conn.bind_connector_metadata(meta)
    if runner == "v2":
        conn.finish_forward()
    after_forward()
    conn.start_load_kv(None)
    conn.wait_for_save()
    _, recving = conn.get_finished(set())
    out = conn.build_connector_worker_meta()
    conn.clear_connector_metadata()
    return set(recving or ()), out.report if out is not None else WorkerReport()


def store_then_load(conn, src: int, dst: int, job_id: int) -> WorkerReport:
    """Store blocks (src, src+1) to CPU slot 0, then load the slot into (dst, dst+1)."""
    store = StoreJob(job_id, (ChunkMove((src, src + 1), 0),))
    _, stored = worker_step(conn, StepPlan(stores=(store,)))
    load = LoadJob(job_id + 1, "r", (ChunkMove((dst, dst + 1), 0),))
    loaded, report = worker_step(conn, StepPlan(loads=(load,)))
    assert loaded == {"r"}
    return stored.merge(report)


def test_unregister_pauses_offloading_and_restore_resumes_it_in_place(worker_connector, caplog):
    """Issue 32: vLLM 0.33+ releases the KV cache memory after unregister_kv_caches and
    commits it again at the same addresses before restore_kv_caches. In between, a store
    planned before the scheduler side knew is refused (reported failed) and copies
    nothing; after restore the same views copy again (not registered anew). The old
    connector closed its worker: nothing was ever reported again."""
    conn, kv = worker_connector
    conn.unregister_kv_caches()
    conn.unregister_kv_caches()  # idempotent
    before = [layer[[4, 5]].clone() for layer in kv]
    _, report = worker_step(conn, StepPlan(stores=(StoreJob(1, (ChunkMove((2, 3), 0),)),)))
    assert report.host_failed == {1: 1} and report.paused == {0: True}
    conn.restore_kv_caches()
    conn.restore_kv_caches()  # idempotent
    report = store_then_load(conn, 2, 4, job_id=2)
    assert report.host_stored == {2: 1} and report.paused == {0: False}
    assert all(torch.equal(layer[[4, 5]], layer[[2, 3]]) for layer in kv)
    assert not all(torch.equal(layer[[4, 5]], old) for layer, old in zip(kv, before))
    assert "registering it again" not in caplog.text


def test_a_kv_cache_restored_elsewhere_is_registered_again(worker_connector):
    """Should a vLLM restore the KV tensors at other addresses, the views cut at start-up
    would read and write the old memory: the tensors are checked and registered again."""
    conn, kv = worker_connector
    conn.unregister_kv_caches()
    for i, layer in enumerate(kv):  # the same tensor objects, new memory
        fresh = torch.full_like(layer, 100.0 + i)
        layer.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
    conn.restore_kv_caches()
    store_then_load(conn, 2, 4, job_id=1)
    assert all(bool((layer[[4, 5]] == 100.0 + i).all()) for i, layer in enumerate(kv))


def test_a_kv_cache_restored_in_another_shape_is_refused_and_stays_paused(worker_connector):
    conn, kv = worker_connector
    conn.unregister_kv_caches()
    wrong = torch.zeros(64, 2, BLOCK, 4)  # another head count: not the namespace's layout
    kv[0].set_(wrong.untyped_storage(), 0, wrong.shape, wrong.stride())
    with pytest.raises(UnsupportedEngineError):
        conn.restore_kv_caches()
    _, report = worker_step(conn, StepPlan(stores=(StoreJob(1, (ChunkMove((2, 3), 0),)),)))
    assert report.host_failed == {1: 1}


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_stores_are_issued_at_finish_forward_on_v2_and_at_wait_for_save_on_v1(
        worker_connector, runner):
    """Issue 32 §3: Model Runner V2 calls ``finish_forward`` right after the forward, before
    sampling, drafting and ``wait_for_save``; the store copies start there, once. The V1
    runner never calls it: they start in ``wait_for_save``. Either way the chunk holds the
    bytes the forward wrote, even when the blocks change after the issue point (on V2,
    after finish_forward: nothing may write them then, and the copy must not see it)."""
    conn, kv = worker_connector
    issued: list[str] = []
    run_stores = conn._worker.run_stores
    hook = ["forward"]

    def spy(jobs):
        issued.append(hook[0])
        run_stores(jobs)

    conn._worker.run_stores = spy
    real_finish, real_wait = conn.finish_forward, conn.wait_for_save
    conn.finish_forward = lambda: (hook.__setitem__(0, "finish_forward"), real_finish())[1]
    conn.wait_for_save = lambda: (hook.__setitem__(0, "wait_for_save"), real_wait())[1]
    forward_wrote = [layer[[2, 3]].clone() for layer in kv]

    def overwrite():  # past the issue point on V2, before it on V1
        for layer in kv:
            layer[[2, 3]] = -1.0

    store = StoreJob(1, (ChunkMove((2, 3), 0),))
    _, report = worker_step(conn, StepPlan(stores=(store,)), runner=runner,
                            after_forward=overwrite if runner == "v2" else lambda: None)
    assert issued == ["finish_forward" if runner == "v2" else "wait_for_save"]
    assert report.host_stored == {1: 1}
    load = LoadJob(2, "r", (ChunkMove((4, 5), 0),))
    loaded, _ = worker_step(conn, StepPlan(loads=(load,)), runner=runner)
    assert loaded == {"r"} and issued == issued[:1]  # a plan without stores issues none
    assert all(torch.equal(layer[[4, 5]], want) for layer, want in zip(kv, forward_wrote))


def test_each_attention_layers_wait_reaches_the_workers_per_layer_waits(worker_connector):
    """Issue 29: the worker knows the engine's planes per attention layer, named as vLLM
    names them in ``wait_for_layer_load`` and in the order of its KV cache group (the
    forward's); ``start_load_kv`` tells it whether this forward's layers will wait (the
    forward context), before it issues the step's loads; each layer's wait reaches it."""
    conn, kv = worker_connector
    names = list(conn._kv_cache_config.kv_cache_groups[0].layer_names)
    layers = conn._worker.layer_waits.layers
    assert layers.names == tuple(names) and layers.num_planes == len(names)  # one plane each
    calls = []

    class Recorder:
        def expect(self, forward_context):
            calls.append(("expect", forward_context))

        def wait(self, layer_name):
            calls.append(("wait", layer_name))

    conn._worker.layer_waits = Recorder()
    conn._worker.start_loads = lambda jobs: calls.append(("start_loads", len(jobs))) or True
    conn.bind_connector_metadata(OffloadConnectorMetadata(
        StepPlan(loads=(LoadJob(1, "r", (ChunkMove((4, 5), 0),), same_step=True),))))
    conn.start_load_kv("forward-context")
    for name in names:
        conn.wait_for_layer_load(name)
    conn.clear_connector_metadata()
    assert calls == [("expect", "forward-context"), ("start_loads", 1)] + [
        ("wait", name) for name in names]


@pytest.mark.parametrize("connector", [{"partial_hits": True}], indirect=True)
def test_a_prompts_tail_is_a_store_job_of_its_own_kept_out_of_the_audit(connector):
    """Issue 33: the prompt's tokens past its last whole chunk are copied after the
    forward that computed them, in a CPU-only job the runtime audit does not re-read (the
    request's next steps write its last block past the tail)."""
    conn, manager = connector
    request = new_request(manager, "a", 3 * CHUNK + 5, first_block=10)
    admit(conn, request)
    plan = conn.build_connector_meta(scheduler_output(new=[(request, 3 * CHUNK + 5)])).plan
    chunks, tail = plan.stores
    assert len(chunks.chunks) == 3 and chunks.audited
    (move,) = tail.chunks
    assert not tail.audited and move.sinks == ()
    assert tail.req_ids == ("a",)
