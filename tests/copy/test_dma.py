"""kv_offload.copy.dma without a GPU: what it reads from the CUDA driver, and the batch
copy's descriptor layout (the ABI that ctypes cannot check for us)."""

from __future__ import annotations

import ctypes

import numpy as np

from kv_offload.copy import dma


class FakeDriver:
    """libcuda as ctypes shows it: functions that write through ``byref`` arguments."""

    def __init__(self, version: int, *, with_batch: bool = True) -> None:
        self.version = version
        if with_batch:
            self.cuMemcpyBatchAsync = lambda *args: 0

    def cuDriverGetVersion(self, out):
        out._obj.value = self.version
        return 0

    def cuCtxGetStreamPriorityRange(self, least, greatest):
        least._obj.value, greatest._obj.value = 0, -5
        return 0


def test_the_batch_copy_needs_a_cuda_12_8_driver_that_exports_it():
    info = dma.load_driver(FakeDriver(12080))
    assert info.batch is not None and info.version == 12080
    assert (info.least_priority, info.greatest_priority) == (0, -5)
    old = dma.load_driver(FakeDriver(12040))
    assert old.batch is None and "12.4 < 12.8" in old.why_no_batch
    missing = dma.load_driver(FakeDriver(13000, with_batch=False))
    assert missing.batch is None and "exports no cuMemcpyBatchAsync" in missing.why_no_batch


def test_without_a_driver_nothing_raises():
    info = dma.load_driver() if not _has_libcuda() else dma.load_driver(object())
    assert info.batch is None and info.least_priority == 0


def _has_libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_memcpy_attributes_have_the_cuda_12_8_layout():
    """CUmemcpyAttributes: srcAccessOrder, srcLocHint {type, id}, dstLocHint, flags."""
    attrs = dma.MemcpyAttributes
    assert ctypes.sizeof(attrs) == 24
    assert [getattr(attrs, f).offset for f in ("srcAccessOrder", "srcLocHint", "dstLocHint",
                                               "flags")] == [0, 4, 12, 20]


def test_a_copier_falls_back_once_and_only_down():
    class Runtime:
        calls: list[tuple] = []

        def memcpyAsync(self, *args):
            self.calls.append(("1d", *args))

        def memcpy2DAsync(self, *args):
            self.calls.append(("2d", *args))

    copier = dma.DmaCopier(Runtime(), None)
    assert copier.path == "2d"
    src, dst, n = np.array([0, 100, 200]), np.array([1000, 1050, 1100]), np.full(3, 50)
    assert copier.issue(src, dst, n, 7, host_is_src=False) == 1
    assert Runtime.calls == [("2d", 1000, 50, 0, 100, 50, 3, dma.MEMCPY_DEFAULT, 7)]
    assert copier.fall_back_to_plainest() and not copier.fall_back_to_plainest()
    assert copier.issue(src, dst, n, 7, host_is_src=False) == 3 and copier.path == "ranges"
