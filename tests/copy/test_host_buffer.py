"""Host slot buffer: sizes, memory checks naming cpu_size, zero-copy slot views."""

from __future__ import annotations

import os

import pytest
import torch

from kv_offload.copy.base import CudaUnavailableError
from kv_offload.copy.cuda_runtime import cuda_available
from kv_offload.copy.host_buffer import (
    HostSlots,
    InsufficientHostMemoryError,
    allocate_host_slots,
    available_host_memory,
    check_local_ranks_fit,
)


def test_allocate_plain_slots():
    host = allocate_host_slots(5, 4096, pinned=False)
    assert host.tensor.shape == (5, 4096) and host.tensor.dtype == torch.uint8
    assert (host.num_slots, host.slot_bytes, host.nbytes, host.pinned) == (5, 4096, 20480, False)
    assert host.tensor.is_contiguous()


def test_slot_view_is_writable_and_zero_copy():
    host = allocate_host_slots(3, 64, pinned=False)
    host.tensor.zero_()
    view = host.slot_view(1)
    assert isinstance(view, memoryview) and not view.readonly
    assert (view.nbytes, view.format) == (64, "B")
    view[:4] = b"\x01\x02\x03\x04"
    assert host.tensor[1, :4].tolist() == [1, 2, 3, 4]
    assert torch.count_nonzero(host.tensor[0]) == 0 and torch.count_nonzero(host.tensor[2]) == 0
    host.tensor[1, 63] = 9
    assert view[63] == 9


def test_slot_view_checks_range_and_outlives_close():
    host = allocate_host_slots(2, 32, pinned=False)
    for bad in (-1, 2):
        with pytest.raises(IndexError):
            host.slot_view(bad)
    view = host.slot_view(0)
    host.close()
    host.close()
    assert host.tensor is None
    view[0] = 7  # the view keeps the memory alive
    assert view[0] == 7
    with pytest.raises(ValueError, match="closed"):
        host.slot_view(0)


def test_slot_views_work_with_preadv_and_pwritev(tmp_path):
    host = allocate_host_slots(2, 8192, pinned=False)
    host.tensor[0] = torch.arange(8192) % 251
    fd = os.open(tmp_path / "slab", os.O_RDWR | os.O_CREAT)
    try:
        assert os.pwritev(fd, [host.slot_view(0)], 4096) == 8192
        assert os.preadv(fd, [host.slot_view(1)], 4096) == 8192
    finally:
        os.close(fd)
    assert torch.equal(host.tensor[0], host.tensor[1])


@pytest.mark.parametrize(("num_slots", "slot_bytes"), [
    (0, 64), (-1, 64), (4, 0), (4, -8), (2.5, 64), (True, 64),
])
def test_bad_sizes_name_cpu_size(num_slots, slot_bytes):
    with pytest.raises(ValueError, match="cpu_size"):
        allocate_host_slots(num_slots, slot_bytes, pinned=False)


def test_larger_than_available_memory_names_cpu_size():
    one_mib = lambda: 1 << 20  # noqa: E731
    with pytest.raises(InsufficientHostMemoryError, match="cpu_size") as info:
        allocate_host_slots(3, 512 << 10, pinned=False, available=one_mib)
    assert "1.5 MiB" in str(info.value) and "1.0 MiB" in str(info.value)
    assert allocate_host_slots(1, 512 << 10, pinned=False, available=one_mib).nbytes == 512 << 10
    assert allocate_host_slots(1, 512 << 10, pinned=False, available=lambda: None).nbytes


def test_real_available_memory_is_checked():
    with pytest.raises(InsufficientHostMemoryError, match="cpu_size"):
        allocate_host_slots(1 << 20, 1 << 30, pinned=False)  # 1 PiB


def test_available_host_memory_is_what_psutil_reports():
    import psutil

    available = available_host_memory()
    assert available is not None and 0 < available <= psutil.virtual_memory().total


@pytest.mark.parametrize("tensor", [
    torch.zeros((4, 8), dtype=torch.float32),
    torch.zeros(32, dtype=torch.uint8),
    torch.zeros((8, 4), dtype=torch.uint8).t(),
    torch.zeros((0, 8), dtype=torch.uint8),
])
def test_host_slots_rejects_bad_tensors(tensor):
    with pytest.raises(ValueError):
        HostSlots(tensor, pinned=False)


@pytest.mark.skipif(cuda_available(), reason="CuPy and a CUDA device are present")
def test_pinned_without_cuda_is_a_clear_error():
    with pytest.raises(CudaUnavailableError, match="CuPy|pinned"):
        allocate_host_slots(2, 4096, pinned=True)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_available(), reason="needs CuPy and a CUDA device")
def test_pinned_slots_have_exactly_the_requested_size():
    import cupy

    num_slots, slot_bytes = 3, 1_000_003  # not a power of two, not page-aligned
    host = allocate_host_slots(num_slots, slot_bytes, pinned=True)
    assert host.pinned and host.tensor.shape == (num_slots, slot_bytes)
    attrs = cupy.cuda.runtime.pointerGetAttributes(host.tensor.data_ptr())
    assert attrs.type == 1  # cudaMemoryTypeHost: page-locked
    assert attrs.devicePointer != 0  # mapped for kernels
    host.slot_view(2)[-1] = 5
    assert int(host.tensor[2, -1]) == 5


def _resident_bytes(address: int) -> int:
    """Rss of the mapping of this process that contains ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("mapping not found")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_populate_maps_every_page_and_keeps_the_bytes():
    """Regression: the plain CPU tier's pages were mapped on first store, which ran at a
    quarter of the copy speed; populate() maps them ahead without changing a byte."""
    slots = allocate_host_slots(64, 1 << 20, pinned=False)
    tensor = slots.as_tensor()
    tensor[3, :4096] = 7  # a slot already in use while pages are mapped
    address = tensor.data_ptr()
    before = _resident_bytes(address)
    assert before < slots.nbytes // 2
    if not slots.populate():
        pytest.skip("this kernel cannot pre-map pages (MADV_POPULATE_WRITE, Linux 5.14+)")
    assert _resident_bytes(address) >= slots.nbytes
    assert int(tensor[3, :4096].min()) == 7 and int(tensor[3, 4096:].max()) == 0
    assert int(tensor[[0, 63]].max()) == 0


def test_populate_is_a_no_op_after_close():
    slots = allocate_host_slots(4, 4096, pinned=False)
    slots.close()
    assert slots.populate() is False


GIB = 1 << 30


def test_the_cpu_tiers_of_all_local_ranks_must_fit_in_the_hosts_ram():
    """Issue 27, section 5: each rank checked only its own CPU tier against the memory
    available, so with TP 8 a cpu_size of 30 GiB passed every check on a 128 GiB host and
    pinned 240 GiB. The error names cpu_size (per rank) and what it may be at most."""
    with pytest.raises(InsufficientHostMemoryError) as info:
        check_local_ranks_fit(30 * GIB, 8, total=lambda: 128 * GIB, available=lambda: 120 * GIB)
    message = str(info.value)
    assert "8 x 30.0 GiB = 240.0 GiB" in message and "128.0 GiB of RAM" in message
    assert "cpu_size is per rank; lower it to at most 16.0 GiB" in message


def test_local_ranks_that_fit_pass_and_more_than_available_now_warns(caplog):
    check_local_ranks_fit(30 * GIB, 1, total=lambda: GIB, available=lambda: GIB)  # alone
    check_local_ranks_fit(15 * GIB, 8, total=lambda: 128 * GIB, available=lambda: 125 * GIB)
    assert not caplog.records
    check_local_ranks_fit(15 * GIB, 8, total=lambda: 128 * GIB, available=lambda: 100 * GIB)
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "lower cpu_size (it is per rank)" in record.message
    check_local_ranks_fit(15 * GIB, 8, total=lambda: None, available=lambda: None)  # unknown
