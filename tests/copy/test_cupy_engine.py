"""CupyCopyEngine: imports without CuPy; on a CUDA device, byte-exact round trips
against a torch reference and ordering against the compute stream."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from kv_offload.copy import SKIP_BLOCK, CudaUnavailableError, cuda_runtime, cupy_engine
from kv_offload.copy.cuda_runtime import cuda_available
from kv_offload.copy.cupy_engine import CupyCopyEngine
from kv_offload.copy.host_buffer import HostSlots
from kv_offload.copy.plan import SlotLayout

HAVE_CUDA = cuda_available()
cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs CuPy and a CUDA device")


# -- without CUDA -------------------------------------------------------------------------


def test_module_imports_and_reports_no_cuda_without_cupy():
    assert isinstance(HAVE_CUDA, bool)
    assert callable(cuda_runtime.alloc_pinned_host)


@pytest.mark.skipif(HAVE_CUDA, reason="CuPy and a CUDA device are present")
def test_construction_without_cuda_raises_cuda_unavailable():
    planes = [torch.zeros((4, 64), dtype=torch.uint8)]
    host = HostSlots(torch.zeros((2, 128), dtype=torch.uint8), pinned=False)
    with pytest.raises(CudaUnavailableError):
        CupyCopyEngine(planes, host, 2, device=0)
    with pytest.raises(CudaUnavailableError):
        cuda_runtime.alloc_pinned_host(4096)


# -- on a CUDA device ---------------------------------------------------------------------

NUM_BLOCKS = 97


def flash_attention_planes(*, num_layers=3, num_blocks=NUM_BLOCKS, block_size=16, heads=2, hd=64):
    """(2, nb, bs, heads, hd) bf16 per layer -> K and V planes per layer, random bytes."""
    from kv_offload.copy import planes_from_kv_tensor

    tensors = [torch.randint(0, 256, (2, num_blocks, block_size, heads, hd * 2),
                             dtype=torch.uint8, device="cuda").view(torch.bfloat16)
               for _ in range(num_layers)]
    return tensors, [p for t in tensors for p in planes_from_kv_tensor(t, num_blocks)]


def pinned_host(num_slots, slot_bytes):
    from kv_offload.copy.host_buffer import allocate_host_slots

    host = allocate_host_slots(num_slots, slot_bytes, pinned=True)
    host.tensor.copy_(torch.randint(0, 256, host.tensor.shape, dtype=torch.uint8))
    return host


def slot_rows(layout, host_tensor, slot, plane, pos):
    pb = layout.plane_bytes[plane]
    off = layout.plane_offsets[plane] + pos * pb
    return host_tensor[slot, off:off + pb]


@pytest.fixture(params=["auto", "dma-2d", "dma-ranges", "kernel"])
def mode(request, monkeypatch):
    """The engine's mode; "dma-2d" and "dma-ranges" are DMA copies without the batch
    copy (a driver before 12.8) and after the audit's fall back (one call per range)."""
    if request.param == "kernel" and cuda_runtime.nvrtc_version() is None:
        pytest.skip("kernel mode needs NVRTC, which CuPy cannot load here")
    if request.param == "dma-2d":
        real = cupy_engine.load_driver
        monkeypatch.setattr(cupy_engine, "load_driver", lambda: dataclasses.replace(
            real(), batch=None, why_no_batch="none, as the test asks"))
    if request.param == "dma-ranges":
        class Plainest(cupy_engine.DmaCopier):
            def __init__(self, *args):
                super().__init__(*args)
                self.fall_back_to_plainest()
        monkeypatch.setattr(cupy_engine, "DmaCopier", Plainest)
    return request.param.split("-")[0]


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("pattern", ["contiguous", "shuffled"])
def test_round_trip_matches_torch_reference(mode, pattern):
    rng = np.random.default_rng(0)
    bpc = 4
    _, planes = flash_attention_planes()
    layout = SlotLayout.packed([p.shape[1] for p in planes], bpc)
    host = pinned_host(12, layout.slot_bytes)
    engine = CupyCopyEngine(planes, host, bpc, device=0, mode=mode)
    try:
        if pattern == "contiguous":
            ids = np.arange(8, 8 + 5 * bpc).reshape(5, bpc)
        else:
            ids = rng.choice(NUM_BLOCKS, 5 * bpc, replace=False).reshape(5, bpc)
        ids[1, 0] = SKIP_BLOCK
        slots = rng.choice(12, 5, replace=False)
        host_before = host.tensor.clone()
        reference = [p.cpu() for p in planes]
        engine.wait(engine.store(ids, slots))
        for c, slot in enumerate(slots):
            for p in range(len(planes)):
                for i in range(bpc):
                    got = slot_rows(layout, host.tensor, slot, p, i)
                    if ids[c, i] == SKIP_BLOCK:  # untouched
                        want = slot_rows(layout, host_before, slot, p, i)
                    else:
                        want = reference[p][ids[c, i]]
                    assert torch.equal(got, want)

        for p in planes:
            p.zero_()
        new_ids = rng.choice(NUM_BLOCKS, ids.size, replace=False).reshape(ids.shape)
        new_ids[ids == SKIP_BLOCK] = SKIP_BLOCK
        handle = engine.load(slots, new_ids)
        engine.wait(handle)
        assert engine.is_done(handle)
        for c in range(len(slots)):
            for i in range(bpc):
                if new_ids[c, i] == SKIP_BLOCK:
                    continue
                for p in range(len(planes)):
                    assert torch.equal(planes[p][new_ids[c, i]].cpu(), reference[p][ids[c, i]])
        written = torch.zeros(NUM_BLOCKS, dtype=torch.bool)
        written[torch.from_numpy(new_ids[new_ids != SKIP_BLOCK])] = True
        for p in planes:
            assert torch.count_nonzero(p[~written.cuda()]) == 0
    finally:
        engine.close()


@pytest.mark.cuda
@cuda
def test_single_plane_with_cross_slot_runs_and_strided_planes(mode):
    """One packed plane (runs merge across slots) and K/V planes with row stride 2x."""
    bpc = 2
    t = torch.randint(0, 256, (NUM_BLOCKS, 4096), dtype=torch.uint8, device="cuda")
    layout = SlotLayout.packed([4096], bpc)
    host = pinned_host(8, layout.slot_bytes)
    engine = CupyCopyEngine([t], host, bpc, device=0, mode=mode)
    engine.wait(engine.store(np.arange(10, 18).reshape(4, bpc), np.array([2, 3, 4, 5])))
    assert torch.equal(host.tensor[2:6].reshape(-1), t[10:18].cpu().reshape(-1))
    engine.close()

    kv = torch.randint(0, 256, (NUM_BLOCKS, 2, 1000), dtype=torch.uint8, device="cuda")
    planes = [kv[:, 0], kv[:, 1]]
    layout = SlotLayout((1000, 1000), bpc, 2 * bpc * 1000 + 7)  # odd sizes: unaligned tiles
    host = pinned_host(5, layout.slot_bytes)
    engine = CupyCopyEngine(planes, host, bpc, device=0, mode=mode)
    engine.wait(engine.store(np.array([[5, 6], [40, 3]]), np.array([4, 1])))
    before = kv.clone()
    engine.wait(engine.load(np.array([4, 1]), np.array([[60, 61], [62, 63]])))
    assert torch.equal(kv[60:62], before[5:7])
    assert torch.equal(kv[62], before[40]) and torch.equal(kv[63], before[3])
    assert torch.equal(kv[:60], before[:60]) and torch.equal(kv[64:], before[64:])
    engine.close()


@pytest.mark.cuda
@cuda
def test_store_sees_work_enqueued_on_the_compute_stream_just_before(mode):
    """Regression scenario: the forward pass writes blocks, and the store is issued right
    after it is *enqueued*. The store must copy the new bytes, not the stale ones."""
    bpc = 4
    _, planes = flash_attention_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], bpc)
    host = pinned_host(4, layout.slot_bytes)
    engine = CupyCopyEngine(planes, host, bpc, device=0, mode=mode)
    ids = np.arange(20, 20 + bpc)[None, :]
    engine.wait(engine.store(ids, np.array([1])))  # warm-up: first-call costs out of the way
    for round_ in range(3):
        torch.cuda._sleep(200_000_000)  # keep the compute stream busy (~0.1 s)
        for p in planes:
            p[20:20 + bpc].fill_(round_ + 1)  # the "forward pass" writing the blocks
        handle = engine.store(ids, np.array([1]))
        assert not engine.is_done(handle)  # still behind the sleeping compute stream
        engine.wait(handle)
        for p in range(len(planes)):
            for i in range(bpc):
                assert bool((slot_rows(layout, host.tensor, 1, p, i) == round_ + 1).all())
    engine.close()


@pytest.mark.cuda
@cuda
def test_copies_follow_the_stream_current_when_issued(mode):
    """Regression: the engine captured the compute stream once, at construction. vLLM
    running a forward on another stream afterwards made stores copy blocks before that
    forward wrote them (corrupt chunks with valid checksums). Built on the default stream,
    then the "forward" and the store run on a side stream; a load handed out on that
    stream and issued from another thread (as the worker's copy thread does) is ordered
    after it too."""
    import threading

    bpc = 4
    _, planes = flash_attention_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], bpc)
    host = pinned_host(4, layout.slot_bytes)
    engine = CupyCopyEngine(planes, host, bpc, device=0, mode=mode)  # default stream now
    ids = np.arange(40, 40 + bpc)[None, :]
    engine.wait(engine.store(ids, np.array([1])))
    side = torch.cuda.Stream()
    for round_ in range(2):
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
            for p in planes:
                p[40:40 + bpc].fill_(round_ + 5)
            handle = engine.store(ids, np.array([1]))
            token = engine.compute_mark()
        engine.wait(handle)
        for p in range(len(planes)):
            for i in range(bpc):
                assert bool((slot_rows(layout, host.tensor, 1, p, i) == round_ + 5).all())
    host.tensor[2].fill_(9)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        for p in planes:
            p[60:60 + bpc].fill_(1)  # the previous owner's last write to the blocks
        token = engine.compute_mark()
    issued = []
    thread = threading.Thread(target=lambda: issued.append(
        engine.load(np.array([2]), np.arange(60, 60 + bpc)[None, :], after=token)))
    thread.start()
    thread.join()
    engine.wait(issued[0])
    side.synchronize()
    assert all(bool((p[60:60 + bpc] == 9).all()) for p in planes)
    engine.close()


@pytest.mark.cuda
@cuda
def test_fence_makes_the_next_forward_see_loaded_blocks(mode):
    bpc = 2
    t = torch.zeros((NUM_BLOCKS, 1 << 20), dtype=torch.uint8, device="cuda")
    layout = SlotLayout.packed([1 << 20], bpc)
    host = pinned_host(3, layout.slot_bytes)
    host.tensor[2].fill_(7)
    engine = CupyCopyEngine([t], host, bpc, device=0, mode=mode)
    handle = engine.load(np.array([2]), np.array([[30, 31]]))
    engine.fence(handle)  # GPU-side: the host does not wait
    total = t[30:32].sum(dtype=torch.int64)  # the next "forward", on the compute stream
    assert int(total) == 7 * 2 * (1 << 20)
    engine.close()


@pytest.mark.cuda
@cuda
def test_construction_validates():
    _, planes = flash_attention_planes(num_layers=1)
    plain = HostSlots(torch.zeros((2, 2 * sum(p.shape[1] for p in planes)), dtype=torch.uint8),
                      pinned=False)
    with pytest.raises(ValueError, match="pinned"):
        CupyCopyEngine(planes, plain, 2, device=0)
    host = pinned_host(2, 2 * sum(p.shape[1] for p in planes))
    with pytest.raises(ValueError, match="mode"):
        CupyCopyEngine(planes, host, 2, device=0, mode="fast")
    with pytest.raises(ValueError):
        CupyCopyEngine([p.cpu() for p in planes], host, 2, device=0)
    engine = CupyCopyEngine(planes, host, 2, device=0)
    with pytest.raises(ValueError):
        engine.store(np.array([[0, NUM_BLOCKS]]), np.array([0]))
    engine.close()
