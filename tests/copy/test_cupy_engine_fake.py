"""CupyCopyEngine without a GPU, over a fake CuPy and a fake CUDA driver: each
cudaMemcpyAsync, cudaMemcpy2DAsync and cuMemcpyBatchAsync is a memmove at issue and the
tile kernel runs its range table on the host, so the engine's own work is checked on the
CPU before a GPU run finds it: the byte addresses of every copy path (planes with a row
stride, odd sizes, tiles, the uint64 kernel table, the batch descriptors), which path each
mode takes and how many calls it makes, the copy streams' priority, the device that every
CUDA call of every thread runs on, and that waits sleep instead of spinning."""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kv_offload.copy import SKIP_BLOCK, cupy_engine
from kv_offload.copy.cupy_engine import KERNEL_TILE_BYTES, CupyCopyEngine
from kv_offload.copy.dma import SRC_ACCESS_ORDER_STREAM, DriverInfo, MemcpyAttributes
from kv_offload.copy.host_buffer import HostSlots
from kv_offload.copy.plan import SlotLayout
from kv_offload.copy.planes import PlaneGeometry, describe_planes
from kv_offload.testing.tiers import tier_ios
from kv_offload.worker.audit import AuditMismatchError, build_audit
from kv_offload.worker.host_copies import HostCopies

ENGINE_DEVICE = 1  # a rank > 0: its threads must never touch device 0
COMPUTE_STREAM = 7  # the raw handle of vLLM's compute stream on its thread


class FakeCupy:
    """The part of CuPy the engine uses, over host memory (device pointer == host pointer,
    as with unified addressing). ``log`` records each call that needs a CUDA context as
    (call, thread name, the thread's current device); ``set_devices`` each cudaSetDevice."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []
        self.set_devices: list[tuple[str, int]] = []
        self.fail_memcpy_after: int | None = None  # memcpyAsync calls that succeed
        self.recorded: list[tuple[int, int]] = []  # runtime.eventRecord: (event, stream)
        self.waited: list[int] = []  # the events copy streams were made to wait on
        self.destroyed: list[tuple[int, str, int]] = []  # cudaEventDestroy: (event, thread, device)
        self.priorities: list[int | None] = []  # of each stream created
        self.batch_attrs: list[tuple[int, int, int]] = []  # (srcAccessOrder, idx, numAttrs)
        self.fail_batch = 0  # CUresult the batch copy returns (0: success)
        self.corrupt_batch = False  # the batch copy flips the first byte it writes
        self._tls = threading.local()
        fake = self

        class Event:
            def __init__(self, block=False, disable_timing=False, interprocess=False):
                fake.call("eventCreate")
                self.block, self.ptr = block, id(self)

            @property
            def done(self):
                fake.call("eventQuery")
                return True

            def synchronize(self):  # without cudaEventBlockingSync the host thread spins
                fake.call("eventSynchronize" if self.block else "eventSynchronize(spinning)")

            def record(self, stream=None):
                fake.call("eventRecord")

            def __del__(self):  # CuPy's __dealloc__: cudaEventDestroy on the current device
                fake.destroyed.append((self.ptr, threading.current_thread().name,
                                       fake.current()))

        class Stream:
            def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
                fake.call("streamCreate")
                fake.priorities.append(priority)
                self.ptr = id(self)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return None

            def wait_event(self, event):
                fake.call("streamWaitEvent")
                fake.waited.append(event.ptr)

            def synchronize(self):
                fake.call("streamSynchronize")

        class Device:
            """As CuPy's: one stack per object; ``__exit__`` sets the previous device."""

            def __init__(self, device=None):
                self.id = fake.current() if device is None else int(device)
                self._device_stack: list[int] = []

            def __enter__(self):
                self._device_stack.append(fake.current())
                if self._device_stack[-1] != self.id:
                    fake.set_device(self.id)
                return self

            def __exit__(self, *exc):
                fake.set_device(self._device_stack.pop())

        class PinnedMemory:
            def __init__(self, size, flags=0):
                fake.call("hostAlloc")
                self._buf = np.zeros(size, np.uint8)
                self.ptr, self.size = self._buf.ctypes.data, size

        class RawKernel:
            def __init__(self, code, name, options=(), **kwargs):
                self.name = name

            def compile(self, log_stream=None):
                fake.call("compile")

            def __call__(self, grid, block, args, **kwargs):
                """Runs kvo_copy_tiles: one (src, dst, nbytes) uint64 row per block."""
                fake.call("launch")
                (num_tiles,), (table_address,) = grid, args
                assert isinstance(table_address, np.uint64)
                rows = (ctypes.c_uint64 * (3 * num_tiles)).from_address(int(table_address))
                for src, dst, nbytes in np.ctypeslib.as_array(rows).reshape(-1, 3).tolist():
                    assert 0 < nbytes <= KERNEL_TILE_BYTES
                    ctypes.memmove(dst, src, nbytes)

        def pointer_attributes(ptr):
            fake.call("pointerGetAttributes")
            return SimpleNamespace(type=1, devicePointer=ptr, hostPointer=ptr, device=-1)

        def memcpy_async(dst, src, size, kind, stream):
            fake.call("memcpyAsync")
            if fake.fail_memcpy_after is not None and fake.calls().count("memcpyAsync") > (
                    fake.fail_memcpy_after):
                raise RuntimeError("cudaErrorInvalidValue")
            ctypes.memmove(dst, src, size)

        def memcpy_2d_async(dst, dpitch, src, spitch, width, height, kind, stream):
            fake.call("memcpy2DAsync")
            assert width <= min(dpitch, spitch) and height >= 1 and kind == 4
            for row in range(height):
                ctypes.memmove(dst + row * dpitch, src + row * spitch, width)

        def batch(dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
            """cuMemcpyBatchAsync (CUDA 12.8 ABI) over host memory."""
            fake.call("memcpyBatchAsync")
            attr = MemcpyAttributes.from_address(attrs)
            fake.batch_attrs.append((attr.srcAccessOrder,
                                     ctypes.c_size_t.from_address(attr_idxs).value, num_attrs))
            if fake.fail_batch:
                return fake.fail_batch
            table = [np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(a))
                     for a in (dsts, srcs, sizes)]
            for d, s_, n in zip(*(t.tolist() for t in table)):
                ctypes.memmove(d, s_, n)
            if fake.corrupt_batch:
                first = ctypes.c_uint8.from_address(int(table[0][0]))
                first.value ^= 0xFF
            return 0

        self.batch = batch
        runtime = SimpleNamespace(
            CUDARuntimeError=RuntimeError, getDeviceCount=lambda: 2,
            getDevice=self.current, setDevice=self.set_device,
            pointerGetAttributes=pointer_attributes, memcpyAsync=memcpy_async,
            memcpy2DAsync=memcpy_2d_async,
            eventRecord=lambda event, stream: (fake.call("eventRecord"),
                                               fake.recorded.append((event, stream))),
            streamWaitEvent=lambda stream, event, flags=0: fake.call("streamWaitEvent"))
        self.cuda = SimpleNamespace(
            runtime=runtime, Event=Event, Stream=Stream, Device=Device, PinnedMemory=PinnedMemory,
            PinnedMemoryPointer=lambda mem, offset: memoryview(mem._buf)[offset:])
        self.RawKernel = RawKernel

    def current(self) -> int:
        """cudaGetDevice: 0 on a thread that never set one."""
        return getattr(self._tls, "device", 0)

    def set_device(self, device: int) -> None:
        self.set_devices.append((threading.current_thread().name, device))
        self._tls.device = device

    def call(self, name: str) -> None:
        self.log.append((name, threading.current_thread().name, self.current()))

    def calls(self) -> list[str]:
        return [name for name, _, _ in self.log]


LEAST_PRIORITY = 3  # not CUDA's default of 0, so that the test tells them apart


@pytest.fixture(params=["batch"])
def fake(monkeypatch, request):
    """A fake CuPy, and a fake driver with cuMemcpyBatchAsync (param "batch") or without
    it (param "no-batch": a driver before CUDA 12.8)."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with_batch = request.param == "batch"
    monkeypatch.setattr(cupy_engine, "load_driver", lambda: DriverInfo(
        12080 if with_batch else 12040, fake.batch if with_batch else None,
        "" if with_batch else "driver 12.4 < 12.8", LEAST_PRIORITY, -2))

    def on_engine_device(planes):  # torch without CUDA has no CUDA tensors: say they are
        g = describe_planes(planes)
        return PlaneGeometry(g.num_blocks, g.plane_bytes, g.row_strides,
                             torch.device("cuda", ENGINE_DEVICE))

    monkeypatch.setattr(cupy_engine, "describe_planes", on_engine_device)
    fake.set_device(ENGINE_DEVICE)  # vLLM's worker thread: torch.cuda.set_device(rank)
    return fake


PLANE_BYTES = 70_001  # odd: unaligned rows; > one tile: kernel mode cuts them
NUM_BLOCKS = 64


def kv_planes(seed: int = 3) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """K and V planes of one layer, interleaved per block (row stride 2 x plane bytes)."""
    rng = np.random.default_rng(seed)
    kv = torch.from_numpy(rng.integers(0, 256, (NUM_BLOCKS, 2, PLANE_BYTES), dtype=np.uint8))
    return kv, [kv[:, 0], kv[:, 1]]


def padded_host(num_slots: int, bpc: int) -> tuple[SlotLayout, HostSlots]:
    layout = SlotLayout((PLANE_BYTES, PLANE_BYTES), bpc, 2 * bpc * PLANE_BYTES + 13)
    host = HostSlots(torch.zeros((num_slots, layout.slot_bytes), dtype=torch.uint8),
                     pinned=True)
    return layout, host


@pytest.mark.parametrize("fake", ["batch", "no-batch"], indirect=True)
@pytest.mark.parametrize("mode", ["auto", "dma", "kernel"])
def test_every_mode_and_path_copies_the_right_bytes(fake, mode):
    kv, planes = kv_planes()
    bpc = 2
    layout, host = padded_host(6, bpc)
    engine = CupyCopyEngine(planes, host, bpc, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode=mode)
    ids = np.array([[5, 6], [40, SKIP_BLOCK], [9, 3]])
    slots = np.array([4, 1, 0])
    engine.wait(engine.store(ids, slots))
    for c, slot in enumerate(slots):
        for i in range(bpc):
            for p, plane in enumerate(planes):
                start = layout.plane_offsets[p] + i * PLANE_BYTES
                got = host.tensor[slot, start:start + PLANE_BYTES]
                if ids[c, i] == SKIP_BLOCK:
                    assert torch.count_nonzero(got) == 0
                else:
                    assert torch.equal(got, plane[ids[c, i]])
    assert torch.count_nonzero(host.tensor[:, 2 * bpc * PLANE_BYTES:]) == 0  # padding
    before = kv.clone()
    engine.wait(engine.load(slots, np.array([[60, 61], [62, SKIP_BLOCK], [63, 0]])))
    want = before.clone()
    for dst, src in ((60, 5), (61, 6), (62, 40), (63, 9), (0, 3)):
        want[dst] = before[src]
    assert torch.equal(kv, want)
    assert ("launch" in fake.calls()) == (mode == "kernel")
    engine.close()


def test_every_cuda_call_runs_on_the_engines_device_whichever_thread_makes_it(fake):
    """Regression: the engine switched devices with ``with cupy.cuda.Device(d)``, whose
    exit sets the thread's previous device again: device 0 on the worker's copy and I/O
    threads, which never choose one. Since CUDA 12 cudaSetDevice creates that device's
    context, so each rank > 0 put a context on GPU 0 (and waited on its events from
    there); and the one Device object, shared by vLLM's thread and the copy thread, keeps
    one stack of previous devices for both, which could leave vLLM's thread on GPU 0."""
    _, planes = kv_planes()
    _, host = padded_host(4, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode="dma")
    ids, slots = np.array([[1, 2], [3, 4]]), np.array([0, 1])
    stored = engine.store(ids, slots)  # vLLM's thread (wait_for_save)

    def io_thread():  # a slab write waits for its store copy
        engine.wait(stored)

    def copy_thread():  # a load, ordered after the stream vLLM's thread handed out
        engine.wait(engine.load(slots, np.array([[10, 11], [12, 13]]), after=COMPUTE_STREAM))

    for target, name in ((io_thread, "kv-offload-io"), (copy_thread, "kv-offload-copy")):
        thread = threading.Thread(target=target, name=name)
        thread.start()
        thread.join()
    engine.fence(engine.store(ids, slots))  # vLLM's thread: a preempted request's copy
    engine.close()
    threads = {thread for _, thread, _ in fake.log}
    assert {"kv-offload-io", "kv-offload-copy"} <= threads
    off_device = [entry for entry in fake.log if entry[2] != ENGINE_DEVICE]
    assert off_device == []
    assert {device for _, device in fake.set_devices} == {ENGINE_DEVICE}
    assert fake.current() == ENGINE_DEVICE  # vLLM's thread is still on its device


def test_a_copy_failing_halfway_lets_the_queued_part_end_before_raising(fake):
    """A store whose third memcpy fails returns no handle, and the caller frees its slot
    (a load's blocks are recomputed): the copies already queued must have ended first."""
    _, planes = kv_planes()
    _, host = padded_host(4, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode="dma")
    assert engine.fall_back_to_plainest() == "ranges"  # one cudaMemcpyAsync per range
    fake.fail_memcpy_after = 2
    with pytest.raises(RuntimeError, match="cudaErrorInvalidValue"):
        engine.store(np.array([[1, 3], [5, 7]]), np.array([0, 2]))
    calls = fake.calls()
    assert calls.count("memcpyAsync") == 3
    assert calls.index("streamSynchronize") > len(calls) - 1 - calls[::-1].index("memcpyAsync")
    fake.fail_memcpy_after = None
    engine.close()


def test_a_load_waits_for_the_compute_before_its_mark_not_for_work_queued_later(fake):
    """The worker marks the compute stream when vLLM hands out a load (``start_loads``);
    the copy thread issues the copy after the disk reads, when more forwards may be
    queued: the copy waits on the mark, not on a new event that would wait for those."""
    _, planes = kv_planes()
    _, host = padded_host(4, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode="dma")
    mark = engine.compute_mark()  # vLLM's thread
    mark_ptr = mark.event.ptr
    assert fake.recorded == [(mark_ptr, COMPUTE_STREAM)]

    def copy_thread():
        engine.wait(engine.load(np.array([0]), np.array([[10, 11]]), after=mark))

    thread = threading.Thread(target=copy_thread, name="kv-offload-copy")
    thread.start()
    thread.join()
    assert fake.recorded == [(mark_ptr, COMPUTE_STREAM)]  # nothing new on the compute stream
    assert fake.waited == [mark_ptr]
    engine.wait(engine.load(np.array([1]), np.array([[12, 13]]), after=COMPUTE_STREAM))
    assert fake.recorded[-1][1] == COMPUTE_STREAM and fake.waited[-1] == fake.recorded[-1][0]
    engine.close()


def test_waits_sleep_instead_of_spinning(fake):
    """Regression: completion events were created without cudaEventBlockingSync, so each
    ``wait`` spun a CPU core until the copy was done: the worker's I/O threads spin
    through the whole forward that a store waits behind, beside vLLM's busy thread."""
    _, planes = kv_planes()
    _, host = padded_host(2, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode="dma")
    engine.wait(engine.store(np.array([[1, 2]]), np.array([0])))
    engine.wait(engine.load(np.array([0]), np.array([[3, 4]])))
    engine.close()
    assert "eventSynchronize" in fake.calls()
    assert "eventSynchronize(spinning)" not in fake.calls()


@pytest.fixture
def no_gc():
    """The garbage collector off: what is freed is freed by reference counting, at once."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_release_mark_destroys_its_event_at_once_on_the_engines_device(fake, no_gc):
    """Issue 27, section 5: compute marks were left to the garbage collector, which
    destroys a CUDA event on whichever thread it runs (a thread that never chose a device
    puts a context on GPU 0 for it). ``release_mark`` destroys it on the calling thread,
    with the engine's device made current first, even where that thread used no CUDA."""
    _, planes = kv_planes()
    _, host = padded_host(2, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE, compute_stream=COMPUTE_STREAM)
    mark = engine.compute_mark()
    ((ptr, _),) = fake.recorded
    thread = threading.Thread(target=engine.release_mark, args=(mark,), name="kv-offload-io")
    thread.start()
    thread.join()
    assert fake.destroyed == [(ptr, "kv-offload-io", ENGINE_DEVICE)]
    engine.release_mark(mark)  # idempotent
    with pytest.raises(ValueError, match="release_mark"):
        engine.load(np.array([0]), np.array([[3, 4]]), after=mark)
    engine.close()


class ReadySlab:
    """A slab whose reads succeed at once."""

    def read(self, slot, buf, expected):
        np.frombuffer(buf, dtype=np.uint8)[:] = 5
        return True

    def close(self):
        pass


def test_a_loads_compute_mark_is_destroyed_on_the_copy_thread_once_its_copy_is_issued(
        fake, no_gc):
    """Issue 27, section 5: the worker's load marks lived in a reference cycle (read
    future -> callback -> partial -> reads -> read future) and, with the read kept for
    later jobs, were destroyed by the garbage collector, on an arbitrary thread and
    device. Now each load's mark is destroyed once its copy is issued, by the copy
    thread, on the engine's device; the garbage collector is off here."""
    from kv_offload.jobs import ChunkMove, LoadJob
    from kv_offload.tier_contract import Place
    from kv_offload.worker import OffloadWorker

    _, planes = kv_planes()
    _, host = padded_host(4, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE, compute_stream=COMPUTE_STREAM)
    worker = OffloadWorker(rank=0, engine=engine, host=host, tiers=tier_ios(ReadySlab(), slot_bytes=host.slot_bytes), io_threads=1)
    worker.start_loads([LoadJob(1, "req", (ChunkMove((10, 11), 0, Place("disk", 3, (0,))),))])
    ((mark, _),) = fake.recorded
    deadline = time.monotonic() + 30  # bounds a hang only
    finished: set[str] = set()
    while "req" not in finished:
        assert time.monotonic() < deadline, "the load never finished"
        finished |= worker.poll().finished_req_ids
        time.sleep(0.01)
    assert bool((planes[0][10] == 5).all())
    assert [d for d in fake.destroyed if d[0] == mark] == [
        (mark, "kv-offload-copy_0", ENGINE_DEVICE)]
    worker.close()


# -- DMA copies: paths, calls, priority ------------------------------------------------------

MANY_BLOCKS = np.array([[9, 3], [40, 7], [22, 50], [13, 31], [2, 60], [18, 44], [5, 27],
                        [36, 11], [58, 20]])  # 9 chunks of shuffled blocks: 36 ranges


def round_trip(engine, planes, host, layout, ids, slots):
    """Store ``ids`` into ``slots`` and check every byte; then load them back elsewhere."""
    engine.wait(engine.store(ids, slots))
    for c, slot in enumerate(slots):
        for i, block in enumerate(ids[c]):
            for p, plane in enumerate(planes):
                start = layout.plane_offsets[p] + i * PLANE_BYTES
                assert torch.equal(host.tensor[slot, start:start + PLANE_BYTES], plane[block])


def test_auto_mode_copies_with_one_dma_batch_call_and_no_kernel(fake):
    """Regression: ``auto`` launched the SM tile-copy kernel for more than 16 ranges under
    2 MiB (every real job), on a default-priority stream, as the next forward started.
    Now it is DMA: one cuMemcpyBatchAsync per copy, sources read in stream order, on copy
    streams of the device's least priority; the kernel is never even compiled."""
    _, planes = kv_planes()
    layout, host = padded_host(12, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    assert engine.mode == "auto" and engine.copy_path == "batch"
    round_trip(engine, planes, host, layout, MANY_BLOCKS, np.arange(9))
    engine.wait(engine.load(np.arange(9), MANY_BLOCKS[::-1].copy()))
    calls = fake.calls()
    assert calls.count("memcpyBatchAsync") == 2
    assert "launch" not in calls and "compile" not in calls and "memcpyAsync" not in calls
    assert fake.batch_attrs == [(SRC_ACCESS_ORDER_STREAM, 0, 1)] * 2
    assert fake.priorities == [LEAST_PRIORITY, LEAST_PRIORITY]
    engine.close()


@pytest.mark.parametrize("fake", ["no-batch"], indirect=True)
def test_without_a_batch_copy_2d_copies_make_far_fewer_calls_than_ranges(fake):
    """A driver before CUDA 12.8: cudaMemcpy2DAsync covers the ranges of a plane's padded
    rows (K and V interleaved per block) in one call per plane and run."""
    _, planes = kv_planes()
    layout, host = padded_host(4, 4)
    engine = CupyCopyEngine(planes, host, 4, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    assert engine.copy_path == "2d"
    ids = np.array([[10, 11, 12, 13], [30, 31, 32, 33]])
    round_trip(engine, planes, host, layout, ids, np.array([1, 3]))
    calls = fake.calls()
    assert calls.count("memcpy2DAsync") == 4 and calls.count("memcpyAsync") == 0  # 16 ranges
    engine.close()


def test_a_failing_batch_copy_falls_back_to_2d_copies_that_copy_it_again(fake, caplog):
    _, planes = kv_planes()
    layout, host = padded_host(12, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    fake.fail_batch = 801  # CUDA_ERROR_NOT_SUPPORTED
    round_trip(engine, planes, host, layout, MANY_BLOCKS, np.arange(9))
    assert engine.copy_path == "2d" and "cuMemcpyBatchAsync failed" in caplog.text
    assert fake.calls().count("memcpyBatchAsync") == 1  # not tried again
    engine.close()


@pytest.mark.parametrize("mode", ["auto", "kernel"])
def test_falling_back_to_the_plainest_path_copies_one_range_per_call(fake, mode):
    """What the runtime audit does to an engine whose copy it found wrong."""
    _, planes = kv_planes()
    layout, host = padded_host(12, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM, mode=mode)
    assert engine.fall_back_to_plainest() == "ranges"
    assert engine.fall_back_to_plainest() is None and engine.copy_path == "ranges"
    before = len(fake.calls())
    round_trip(engine, planes, host, layout, MANY_BLOCKS, np.arange(9))
    calls = fake.calls()[before:]
    assert calls.count("memcpyAsync") == 36 and "launch" not in calls
    assert "memcpyBatchAsync" not in calls
    engine.close()


@pytest.mark.parametrize("fake", ["batch", "no-batch"], indirect=True)
def test_the_engine_describes_its_choice_for_the_start_up_log(fake):
    _, planes = kv_planes()
    _, host = padded_host(2, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    line = engine.describe()
    assert ("mode auto -> cuMemcpyBatchAsync" in line if engine.copy_path == "batch"
            else "mode auto -> cudaMemcpy2DAsync (no batch copy: driver 12.4 < 12.8)" in line)
    assert f"priority {LEAST_PRIORITY}" in line
    engine.close()


def test_an_unordered_mark_orders_a_copy_after_no_compute(fake):
    """The runtime audit re-reads blocks whose copy ended: no event is recorded on the
    compute stream for it, so it never waits for a forward queued meanwhile."""
    _, planes = kv_planes()
    _, host = padded_host(2, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    engine.wait(engine.store(np.array([[1, 2]]), np.array([0]), after=engine.unordered_mark()))
    assert all(stream != COMPUTE_STREAM for _, stream in fake.recorded)
    engine.close()


def test_the_audit_catches_a_wrong_dma_copy_and_the_engine_falls_back(fake):
    """A batch copy that writes a wrong byte (a stream race, a descriptor bug): the
    runtime audit re-reads the blocks, the store fails, and the engine issues one
    cudaMemcpyAsync per range from then on, whose copies pass."""
    _, planes = kv_planes()
    _, host = padded_host(4, 2)
    engine = CupyCopyEngine(planes, host, 2, device=ENGINE_DEVICE,
                            compute_stream=COMPUTE_STREAM)
    audit = build_audit(planes, host, 2, engine=engine, rate=1.0)
    copies = HostCopies(engine, background=False, audit=audit)
    fake.corrupt_batch = True
    wrong = copies.issue(np.array([[5, 6]]), np.array([1]), ["r"])
    with pytest.raises(AuditMismatchError):
        wrong.wait()
    assert wrong.failed() and engine.copy_path == "ranges"
    right = copies.issue(np.array([[5, 6]]), np.array([1]), ["r"])
    right.wait()
    assert not right.failed()
    counts = audit.take_counts()
    assert (counts.audit_chunks, counts.audit_mismatches) == (2, 1)
    copies.close()
    audit.close()
    engine.close()


def test_the_config_offers_the_engines_copy_modes():
    from kv_offload import config

    assert config.COPY_MODES == cupy_engine.COPY_MODES
