"""A same-step load on the CuPy engine, layer by layer (issue 29), over the fake CuPy of
``test_cupy_engine_fake``: the copies of each layer are followed on the load stream by an
event of their own, in layer order, and fencing a layer makes the compute stream wait
for that layer's event only; no host thread waits. The old engine had one event for
the whole load, so the forward's first layer waited for the last layer's copy."""

# ruff: noqa: F811 (the fixture ``fake``, imported, is the tests' argument)
from __future__ import annotations

import ctypes
import itertools
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_cupy_engine_fake import COMPUTE_STREAM, ENGINE_DEVICE, fake  # noqa: F401

from kv_offload.copy.cupy_engine import CupyCopyEngine
from kv_offload.copy.host_buffer import HostSlots
from kv_offload.copy.layers import PlaneLayers
from kv_offload.copy.plan import SlotLayout

NUM_BLOCKS, PLANE_BYTES, BPC, LAYERS = 16, 4_099, 2, 3


def layer_planes():
    """K and V planes of ``LAYERS`` layers (one tensor each), random bytes."""
    rng = np.random.default_rng(5)
    tensors = [torch.from_numpy(rng.integers(0, 256, (2, NUM_BLOCKS, PLANE_BYTES),
                                             dtype=np.uint8)) for _ in range(LAYERS)]
    return tensors, [t[k] for t in tensors for k in (0, 1)]


def traced(fake):
    """Record, in issue order, each copy's destination, each event recorded (with its
    stream) and each stream made to wait on an event, on top of the fake's behaviour."""
    trace: list[tuple] = []
    runtime = fake.cuda.runtime
    memcpy, record = runtime.memcpyAsync, runtime.eventRecord
    batch = fake.batch

    def memcpy_async(dst, src, size, kind, stream):
        trace.append(("copy", dst, size))
        return memcpy(dst, src, size, kind, stream)

    def batch_async(dsts, srcs, sizes, count, *rest):
        for d, n in zip((ctypes.c_uint64 * count).from_address(dsts),
                        (ctypes.c_uint64 * count).from_address(sizes)):
            trace.append(("copy", d, n))
        return batch(dsts, srcs, sizes, count, *rest)

    def event_record(event, stream):
        trace.append(("record", event, stream))
        return record(event, stream)

    def stream_wait_event(stream, event, flags=0):
        trace.append(("wait", stream, event))

    runtime.memcpyAsync, runtime.eventRecord = memcpy_async, event_record
    runtime.streamWaitEvent, fake.batch = stream_wait_event, batch_async
    return trace


@pytest.mark.parametrize("path", ["batch", "ranges"])
def test_each_layer_is_copied_then_marked_and_a_wait_waits_for_its_layer_only(fake, path):
    trace = traced(fake)
    tensors, planes = layer_planes()
    layout = SlotLayout.packed([PLANE_BYTES] * len(planes), BPC)
    host = HostSlots(torch.from_numpy(np.random.default_rng(6).integers(
        0, 256, (4, layout.slot_bytes), dtype=np.uint8)), pinned=True)
    engine = CupyCopyEngine(planes, host, BPC, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode="dma")
    if path == "ranges":
        engine.fall_back_to_plainest()
    layers = PlaneLayers.from_counts([f"l{i}" for i in range(LAYERS)], [2] * LAYERS)
    slots, ids = np.array([2, 0]), np.array([[5, 6], [11, 3]])
    copy = engine.load_by_layer(slots, ids, layers)

    # The bytes: each block of each plane holds its position of its slot.
    for c, slot in enumerate(slots):
        for i, block in enumerate(ids[c]):
            for p, plane in enumerate(planes):
                start = layout.plane_offsets[p] + i * PLANE_BYTES
                assert torch.equal(plane[block], host.tensor[slot, start:start + PLANE_BYTES])
    # The order on the load stream: layer 0's copies, its event, layer 1's copies, ...
    marks = [m.event.ptr for m in copy.layer_marks]
    assert len(set(marks)) == LAYERS
    layer_of = {}
    for layer, t in enumerate(tensors):
        for k in (0, 1):
            base = t[k].data_ptr()
            layer_of.update({(base, b): layer for b in range(NUM_BLOCKS)})
    seen = []
    for entry in trace:
        if entry[0] == "copy":
            plane_base = next(b for (b, _) in layer_of
                              if b <= entry[1] < b + NUM_BLOCKS * PLANE_BYTES)
            seen.append(("copy", layer_of[(plane_base, 0)]))
        elif entry[0] == "record" and entry[1] in marks:
            assert entry[2] != COMPUTE_STREAM  # recorded on the copy stream
            seen.append(("mark", marks.index(entry[1])))
    expected = []
    for layer in range(LAYERS):
        copies = [e for e in seen if e == ("copy", layer)]
        assert copies, f"layer {layer} copied nothing"
        expected += copies + [("mark", layer)]
    assert seen == expected
    # Fencing layer 1 makes the compute stream wait on layer 1's event, nothing else.
    del trace[:]
    engine.fence_mark(copy.layer_marks[1])
    assert trace == [("wait", COMPUTE_STREAM, marks[1])]
    assert "eventSynchronize" not in fake.calls()  # no host thread waited
    for mark in copy.layer_marks:
        engine.release_mark(mark)
    engine.fence_mark(copy.layer_marks[0])  # released: nothing to wait for
    assert trace == [("wait", COMPUTE_STREAM, marks[1])]
    engine.wait(copy.handle)
    engine.close()


def test_kernel_mode_launches_one_kernel_per_layer_and_copies_the_right_bytes(fake):
    _, planes = layer_planes()
    layout = SlotLayout.packed([PLANE_BYTES] * len(planes), BPC)
    host = HostSlots(torch.from_numpy(np.random.default_rng(6).integers(
        0, 256, (4, layout.slot_bytes), dtype=np.uint8)), pinned=True)
    engine = CupyCopyEngine(planes, host, BPC, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode="kernel")
    layers = PlaneLayers.from_counts([f"l{i}" for i in range(LAYERS)], [2] * LAYERS)
    slots, ids = np.array([2, 0]), np.array([[5, 6], [11, 3]])
    copy = engine.load_by_layer(slots, ids, layers)
    assert all(mark is not None for mark in copy.layer_marks)
    assert fake.calls().count("launch") == LAYERS
    for c, slot in enumerate(slots):
        for i, block in enumerate(ids[c]):
            for p, plane in enumerate(planes):
                start = layout.plane_offsets[p] + i * PLANE_BYTES
                assert torch.equal(plane[block], host.tensor[slot, start:start + PLANE_BYTES])
    engine.wait(copy.handle)
    engine.close()


def test_layers_without_copies_get_no_mark_and_a_plain_load_records_none(fake):
    trace = traced(fake)
    _, planes = layer_planes()
    layout = SlotLayout.packed([PLANE_BYTES] * len(planes), BPC)
    host = HostSlots(torch.zeros((2, layout.slot_bytes), dtype=torch.uint8), pinned=True)
    engine = CupyCopyEngine(planes, host, BPC, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    layers = PlaneLayers.from_counts([f"l{i}" for i in range(LAYERS)], [2] * LAYERS)
    copy = engine.load_by_layer(np.zeros(0, dtype=np.int64),
                                np.zeros((0, BPC), dtype=np.int64), layers)
    assert copy.layer_marks == (None,) * LAYERS
    engine.fence_mark(None)
    assert not [e for e in trace if e[0] == "wait" and e[1] == COMPUTE_STREAM]
    records = len([e for e in trace if e[0] == "record"])
    engine.wait(engine.load(np.array([1]), np.array([[4, 5]])))
    # a plain load: one event on the compute stream to order after, none per layer
    assert len([e for e in trace if e[0] == "record"]) == records + 1
    engine.close()


# -- through the worker: LayerWaits (kv_offload/worker/layer_loads.py) ----------------------

def piecewise_forward():
    """A forward context as vLLM's runners pass it to ``start_load_kv`` before an eager or
    piecewise-graph forward: attention metadata, not a FULL graph, no micro-batches."""
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(attn_metadata={"l0": object()}, ubatch_slices=None,
                           cudagraph_runtime_mode=CUDAGraphMode.PIECEWISE)


def layered_worker(fake):
    """A worker over a CuPy engine of ``LAYERS`` layers whose host slots 1 and 2 hold
    chunks; its ``layer_waits`` know the layers, as ``build_worker`` sets them."""
    from kv_offload.worker import OffloadWorker

    tensors, planes = layer_planes()
    layout = SlotLayout.packed([PLANE_BYTES] * len(planes), BPC)
    host = HostSlots(torch.from_numpy(np.random.default_rng(7).integers(
        0, 256, (4, layout.slot_bytes), dtype=np.uint8)), pinned=True)
    engine = CupyCopyEngine(planes, host, BPC, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    worker = OffloadWorker(rank=0, engine=engine, host=host, io_threads=1)
    worker.layer_waits.layers = PlaneLayers.from_counts([f"l{i}" for i in range(LAYERS)],
                                                        [2] * LAYERS)
    return worker, planes, layout, host


def compute_waits(trace):
    """The events vLLM's compute stream was made to wait on, in order."""
    return [event for what, stream, event in (e for e in trace if e[0] == "wait")
            if stream == COMPUTE_STREAM]


def copied(entries, planes):
    """(layer, engine block) of every block the traced copies in ``entries`` wrote."""
    out = set()
    for _, dst, size in (e for e in entries if e[0] == "copy"):
        for p, plane in enumerate(planes):
            offset = dst - plane.data_ptr()
            if 0 <= offset < NUM_BLOCKS * PLANE_BYTES:
                first = offset // PLANE_BYTES
                out |= {(p // 2, b) for b in range(first, first + -(-size // PLANE_BYTES))}
    return out


def first_compute_wait(trace):
    return next(i for i, e in enumerate(trace) if e[0] == "wait" and e[1] == COMPUTE_STREAM)


def test_last_blocks_apart_keeps_each_loads_last_block_for_a_whole_fence():
    from kv_offload.jobs import SKIP_BLOCK as S
    from kv_offload.worker.layer_loads import last_blocks_apart

    ids = np.array([[S, 4], [5, 6], [9, 10], [11, S]])
    last, rest = last_blocks_apart(ids, [2, 0, 2])
    assert last.tolist() == [[S, S], [S, 6], [S, S], [11, S]]
    assert rest.tolist() == [[S, 4], [5, S], [9, 10], [S, S]]


def test_each_attention_layer_waits_only_for_its_own_copies_never_the_whole_load(fake):
    """Issue 29. Regression of the whole-load fence: ``start_load_kv`` made the compute
    stream wait for the end of the whole same-step load, so layer 0's attention waited
    for every layer's copy. Now the forward waits at issue only for the load's last block
    (which this step's new tokens may share: a hit ending inside a block), copied first;
    ``wait_for_layer_load(l1)`` waits on layer 1's event only; the step then ends with no
    load error and the bytes right."""
    from kv_offload.jobs import ChunkMove, LoadJob

    trace = traced(fake)
    worker, planes, layout, host = layered_worker(fake)
    worker.layer_waits.expect(piecewise_forward())
    job = LoadJob(1, "req", (ChunkMove((5, 6), 2), ChunkMove((9, 10), 1)), same_step=True)
    assert worker.start_loads([job])
    marks = [entry[1] for entry in trace if entry[0] == "record" and entry[2] != COMPUTE_STREAM]
    assert len(marks) == LAYERS  # one event per layer on the copy stream
    (fence,) = compute_waits(trace)  # the last block's copy, not the whole load
    assert fence not in marks
    cut = first_compute_wait(trace)
    assert copied(trace[:cut], planes) == {(layer, 10) for layer in range(LAYERS)}
    assert copied(trace[cut:], planes) == {(layer, b) for layer in range(LAYERS)
                                           for b in (5, 6, 9)}
    worker.layer_waits.wait("l1")
    assert compute_waits(trace) == [fence, marks[1]]
    worker.layer_waits.wait("l0")
    worker.layer_waits.wait("l2")
    assert compute_waits(trace) == [fence, marks[1], marks[0], marks[2]]
    result = worker.poll()  # after the forward: nothing failed, the marks are released
    assert result.failed_block_ids == set() and result.finished_req_ids == set()
    worker.layer_waits.wait("l0")  # a later step's layers wait for nothing
    assert compute_waits(trace) == [fence, marks[1], marks[0], marks[2]]
    for blocks, slot in (((5, 6), 2), ((9, 10), 1)):
        for i, block in enumerate(blocks):
            for p, plane in enumerate(planes):
                start = layout.plane_offsets[p] + i * PLANE_BYTES
                assert torch.equal(plane[block], host.tensor[slot, start:start + PLANE_BYTES])
    worker.close()


def test_a_layer_never_waited_for_fails_the_load_in_its_step_and_fences_later_loads(fake):
    """A forward whose attention skipped ``wait_for_layer_load`` for a layer (a FULL CUDA
    graph the runner chose anyway, an attention path without the hook) may have read that
    layer before its copy: the step's load errors name the blocks (vLLM recomputes them),
    its stores are discarded, the missed layers' copies are fenced before later compute,
    and later same-step loads fence the whole forward."""
    from kv_offload.jobs import ChunkMove, LoadJob, StoreJob

    trace = traced(fake)
    worker, _, _, _ = layered_worker(fake)
    worker.layer_waits.expect(piecewise_forward())
    assert worker.start_loads([LoadJob(1, "req", (ChunkMove((5, 6), 2),), same_step=True)])
    marks = [entry[1] for entry in trace if entry[0] == "record" and entry[2] != COMPUTE_STREAM]
    worker.layer_waits.wait("l0")
    worker.run_stores([StoreJob(7, (ChunkMove((12, 13), 3),), ("other",))])
    fence = compute_waits(trace)[0]  # the last block's, at issue
    assert compute_waits(trace) == [fence, marks[0]] + marks  # the rest fenced after it
    assert worker.poll().failed_block_ids == {5, 6}
    assert worker.take_report().host_failed == {7: 1}  # the store: discarded, uncopied
    del trace[:]
    worker.layer_waits.expect(piecewise_forward())
    worker.start_loads([LoadJob(2, "next", (ChunkMove((7, 8), 2),), same_step=True)])
    assert len(compute_waits(trace)) == 1  # fenced whole at issue
    worker.close()


@pytest.mark.parametrize("context", ["full_graph", "no_metadata", "ubatch", "unknown_layer"])
def test_where_layers_do_not_wait_the_forward_is_fenced_after_the_whole_load(fake, context):
    """V1 passes a FULL graph's mode to ``start_load_kv`` (its replay calls no hook); V2
    calls it outside the forward's context before a FULL graph (no attention metadata);
    micro-batches run layers on other streams. There the whole load is fenced at issue,
    as before. A layer name the planes do not hold waits for every layer."""
    from vllm.config import CUDAGraphMode

    from kv_offload.jobs import ChunkMove, LoadJob

    trace = traced(fake)
    worker, _, _, _ = layered_worker(fake)
    forward = piecewise_forward()
    if context == "full_graph":
        forward.cudagraph_runtime_mode = CUDAGraphMode.FULL
    elif context == "no_metadata":
        forward.attn_metadata = None
    elif context == "ubatch":
        forward.ubatch_slices = [object(), object()]
    worker.layer_waits.expect(forward)
    assert worker.start_loads([LoadJob(1, "req", (ChunkMove((5, 6), 2),), same_step=True)])
    if context == "unknown_layer":
        assert len(compute_waits(trace)) == 1  # the last block's, at issue
        worker.layer_waits.wait("model.layers.0.cross_attn")
        assert len(compute_waits(trace)) == 1 + LAYERS
    else:
        assert len(compute_waits(trace)) == 1  # the whole load, at issue
        worker.layer_waits.wait("l0")
        assert len(compute_waits(trace)) == 1
    assert worker.poll().failed_block_ids == set()
    worker.close()


def test_the_same_step_loads_of_one_step_are_issued_as_one_copy_layer_after_layer(fake):
    """Two hits in one step: layer 0 of both is copied first, then its one event, and so
    on; issued one job after the other, layer 0's attention would wait for every layer of
    the first job. Both are reported loaded, with the bytes of their slots."""
    from kv_offload.jobs import ChunkMove, LoadJob

    trace = traced(fake)
    worker, planes, layout, host = layered_worker(fake)
    worker.layer_waits.expect(piecewise_forward())
    assert worker.start_loads([
        LoadJob(1, "a", (ChunkMove((5, 6), 2),), same_step=True),
        LoadJob(2, "b", (ChunkMove((9, 10), 1), ChunkMove((11, 12), None)), same_step=True)])\
        is False  # b's second chunk vanished: a load error of this step
    marks = [e[1] for e in trace if e[0] == "record" and e[2] != COMPUTE_STREAM]
    assert len(marks) == LAYERS
    plane_layer = {p.data_ptr(): i // 2 for i, p in enumerate(planes)}
    order = []
    cut = first_compute_wait(trace)  # the two last blocks (6 and 10), fenced whole first
    assert copied(trace[:cut], planes) == {(layer, b) for layer in range(LAYERS)
                                           for b in (6, 10)}
    for entry in trace[cut:]:
        if entry[0] == "copy":
            base = max(b for b in plane_layer if b <= entry[1])
            order.append(("copy", plane_layer[base]))
        elif entry[0] == "record" and entry[1] in marks:
            order.append(("mark", marks.index(entry[1])))
    assert [key for key, _ in itertools.groupby(order)] == [
        item for i in range(LAYERS) for item in (("copy", i), ("mark", i))]
    assert all(order.count(("copy", i)) >= 4 for i in range(LAYERS))  # K, V of both jobs
    for name in ("l0", "l1", "l2"):
        worker.layer_waits.wait(name)
    assert worker.poll().failed_block_ids == {11, 12}
    for blocks, slot in (((5, 6), 2), ((9, 10), 1)):
        for i, block in enumerate(blocks):
            for p, plane in enumerate(planes):
                start = layout.plane_offsets[p] + i * PLANE_BYTES
                assert torch.equal(plane[block], host.tensor[slot, start:start + PLANE_BYTES])
    worker.close()
