"""TorchCopyEngine: byte-exact round trips between CPU KV planes and host slots.

Every test fills planes and host slots with random bytes and compares against the slot
layout formula, so a wrong offset, a missed block or a stray write fails. Tests taking
``new_engine`` run over every strategy: numpy, compiled on one thread, and compiled with
the thread split and non-temporal stores forced on for every request size."""

from __future__ import annotations

import threading
from concurrent.futures import BrokenExecutor

import numpy as np
import pytest
import torch

from kv_offload.copy import (
    SKIP_BLOCK,
    CopyEngineClosedError,
    TorchCopyEngine,
    cpu_kernel,
    make_copy_engine,
    planes_from_kv_tensor,
    torch_engine,
)
from kv_offload.copy.host_buffer import HostSlots, allocate_host_slots
from kv_offload.copy.plan import SlotLayout

NUM_BLOCKS = 61

VARIANTS = {
    "numpy": {"strategy": "numpy"},
    "compiled-1-thread": {"strategy": "compiled", "num_threads": 1},
    "compiled-3-threads-streamed": {"strategy": "compiled", "num_threads": 3},
}


@pytest.fixture(params=list(VARIANTS))
def new_engine(request, monkeypatch):
    """Builds a TorchCopyEngine of one strategy; the last variant splits every request
    over threads and streams every piece of 1 KiB and more (thresholds forced to 1)."""
    kwargs = VARIANTS[request.param]
    if kwargs["strategy"] == "compiled" and not cpu_kernel.AVAILABLE:
        pytest.skip("numba is not installed")
    if request.param.endswith("streamed"):
        monkeypatch.setattr(torch_engine, "PARALLEL_MIN_BYTES", 1)
        monkeypatch.setattr(torch_engine, "STREAM_MIN_BYTES", 1)
    engines = []

    def build(planes, host, bpc):
        engines.append(TorchCopyEngine(planes, host, bpc, **kwargs))
        return engines[-1]

    yield build
    for engine in engines:
        engine.close()


def cpu_kv_planes(*, num_layers=3, num_blocks=NUM_BLOCKS, heads=2, block_size=4, head=8, seed=0):
    """KV tensors in the vLLM CPU layout, random bytes, one plane per layer."""
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (num_blocks, heads, block_size, 2 * head * 2),
                             dtype=torch.uint8, generator=g).view(torch.bfloat16)
               for _ in range(num_layers)]
    planes = [p for t in tensors for p in planes_from_kv_tensor(t, num_blocks)]
    return tensors, planes


def make_host(num_slots, slot_bytes, seed=1):
    g = torch.Generator().manual_seed(seed)
    return HostSlots(torch.randint(0, 256, (num_slots, slot_bytes), dtype=torch.uint8,
                                   generator=g), pinned=False)


def expected_slot_rows(layout: SlotLayout, slot_row: torch.Tensor, plane: int, pos: int):
    pb = layout.plane_bytes[plane]
    off = layout.plane_offsets[plane] + pos * pb
    return slot_row[off:off + pb]


def request(rng, *, n_chunks, bpc, num_slots, pattern, num_blocks=NUM_BLOCKS):
    slots = rng.choice(num_slots, n_chunks, replace=False)
    if pattern == "contiguous":
        start = int(rng.integers(0, num_blocks - n_chunks * bpc + 1))
        ids = np.arange(start, start + n_chunks * bpc)
    else:
        ids = rng.choice(num_blocks, n_chunks * bpc, replace=False)
    return ids.reshape(n_chunks, bpc).astype(np.int64), slots


@pytest.mark.parametrize("pattern", ["contiguous", "shuffled"])
@pytest.mark.parametrize("bpc", [1, 4])
def test_store_then_load_round_trip(pattern, bpc, new_engine):
    rng = np.random.default_rng(bpc)
    _, planes = cpu_kv_planes()
    layout = SlotLayout.packed([p.shape[1] for p in planes], bpc)
    host = make_host(10, layout.slot_bytes)
    engine = new_engine(planes, host, bpc)
    original = [p.clone() for p in planes]
    host_before = host.tensor.clone()

    ids, slots = request(rng, n_chunks=3, bpc=bpc, num_slots=10, pattern=pattern)
    handle = engine.store(ids, slots)
    assert engine.is_done(handle)
    engine.wait(handle)
    for c, slot in enumerate(slots):
        for p, plane in enumerate(planes):
            for i in range(bpc):
                assert torch.equal(expected_slot_rows(layout, host.tensor[slot], p, i),
                                   plane[ids[c, i]])
    untouched = [s for s in range(10) if s not in set(slots.tolist())]
    assert torch.equal(host.tensor[untouched], host_before[untouched])
    for p, o in zip(planes, original):
        assert torch.equal(p, o)  # a store never writes the engine

    # load the same slots into other blocks (a fresh, fragmented allocation)
    for p in planes:
        p.zero_()
    new_ids = rng.choice(NUM_BLOCKS, ids.size, replace=False).reshape(ids.shape)
    engine.load(slots, new_ids)
    for c in range(len(slots)):
        for i in range(bpc):
            for p, o in zip(planes, original):
                assert torch.equal(p[new_ids[c, i]], o[ids[c, i]])
    mask = np.ones(NUM_BLOCKS, bool)
    mask[new_ids.reshape(-1)] = False
    for p in planes:
        assert torch.count_nonzero(p[torch.from_numpy(mask)]) == 0


def test_store_reaches_the_kv_tensor_bytes_and_slot_views():
    tensors, planes = cpu_kv_planes(num_layers=2)
    host = allocate_host_slots(4, SlotLayout.packed([p.shape[1] for p in planes], 2).slot_bytes,
                               pinned=False)
    engine = make_copy_engine(planes, host, 2)
    assert isinstance(engine, TorchCopyEngine)
    engine.store(np.array([[9, 40]]), np.array([2]))
    want = b"".join(tensors[layer][b].contiguous().view(torch.uint8).numpy().tobytes()
                    for layer in range(2) for b in (9, 40))
    assert bytes(host.slot_view(2)) == want


def test_skip_block_positions_stay_untouched_both_ways(new_engine):
    _, planes = cpu_kv_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], 4)
    host = make_host(3, layout.slot_bytes)
    engine = new_engine(planes, host, 4)
    before = host.tensor.clone()
    engine.store(np.array([[SKIP_BLOCK, SKIP_BLOCK, 5, 6]]), np.array([1]))
    for p in range(2):
        for pos in (0, 1):
            assert torch.equal(expected_slot_rows(layout, host.tensor[1], p, pos),
                               expected_slot_rows(layout, before[1], p, pos))
        assert torch.equal(expected_slot_rows(layout, host.tensor[1], p, 2), planes[p][5])

    engine_before = [p.clone() for p in planes]
    engine.load(np.array([0]), np.array([[SKIP_BLOCK, 30, SKIP_BLOCK, 31]]))
    for p, plane in enumerate(planes):
        assert torch.equal(plane[30], expected_slot_rows(layout, host.tensor[0], p, 1))
        assert torch.equal(plane[31], expected_slot_rows(layout, host.tensor[0], p, 3))
        others = [b for b in range(NUM_BLOCKS) if b not in (30, 31)]
        assert torch.equal(plane[others], engine_before[p][others])


def test_strided_planes_unequal_sizes_and_padded_slots(new_engine):
    """K/V planes that are views into one (nb, 2, X) tensor (row stride 2X) next to a
    smaller packed plane, in slots with padding after the chunk."""
    g = torch.Generator().manual_seed(5)
    kv = torch.randint(0, 256, (NUM_BLOCKS, 2, 96), dtype=torch.uint8, generator=g)
    small = torch.randint(0, 256, (NUM_BLOCKS, 40), dtype=torch.uint8, generator=g)
    planes = [kv[:, 0], kv[:, 1], small]
    bpc = 3
    layout = SlotLayout((96, 96, 40), bpc, bpc * 232 + 24)
    host = make_host(6, layout.slot_bytes)
    engine = new_engine(planes, host, bpc)
    ids = np.array([[7, 8, 9], [50, 3, 22]])
    engine.store(ids, np.array([4, 0]))
    for c, slot in enumerate((4, 0)):
        for p, plane in enumerate(planes):
            for i in range(bpc):
                assert torch.equal(expected_slot_rows(layout, host.tensor[slot], p, i),
                                   plane[ids[c, i]])
    kv_before = kv.clone()
    engine.load(np.array([4]), np.array([[11, 12, 13]]))
    assert torch.equal(kv[11:14], kv_before[7:10])
    assert torch.equal(small[11:14], small[7:10])
    assert torch.equal(kv[:11], kv_before[:11]) and torch.equal(kv[14:], kv_before[14:])


def test_partial_batches_and_many_calls_accumulate(new_engine):
    rng = np.random.default_rng(3)
    _, planes = cpu_kv_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], 2)
    host = make_host(12, layout.slot_bytes)
    engine = new_engine(planes, host, 2)
    ids, slots = request(rng, n_chunks=12, bpc=2, num_slots=12, pattern="shuffled")
    for lo, hi in ((0, 5), (5, 6), (6, 12)):
        engine.store(ids[lo:hi], slots[lo:hi])
    original = [p.clone() for p in planes]
    for p in planes:
        p.fill_(0)
    engine.load(slots[::-1].copy(), ids[::-1].copy())
    stored = torch.from_numpy(ids.reshape(-1))
    for p, o in zip(planes, original):
        assert torch.equal(p[stored], o[stored])
    others = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    others[stored] = False
    for p in planes:
        assert torch.count_nonzero(p[others]) == 0


def test_loading_one_slot_into_two_block_sets(new_engine):
    _, planes = cpu_kv_planes(num_layers=1)
    layout = SlotLayout.packed([planes[0].shape[1]], 2)
    host = make_host(2, layout.slot_bytes)
    engine = new_engine(planes, host, 2)
    engine.load(np.array([1, 1]), np.array([[3, 4], [20, 10]]))
    assert torch.equal(planes[0][3], planes[0][20]) and torch.equal(planes[0][4], planes[0][10])


@pytest.mark.parametrize(("ids", "slots"), [
    (np.array([[0, 1], [2, NUM_BLOCKS]]), np.array([0, 1])),  # block out of range
    (np.array([[0, 1], [2, 3]]), np.array([0, 9])),  # slot out of range
    (np.array([[0, 1], [2, 3]]), np.array([1, 1])),  # same slot twice
    (np.array([[0, 1, 2]]), np.array([0])),  # wrong chunk width
])
def test_invalid_requests_raise_before_copying(ids, slots, new_engine):
    _, planes = cpu_kv_planes(num_layers=1)
    layout = SlotLayout.packed([planes[0].shape[1]], 2)
    host = make_host(4, layout.slot_bytes)
    engine = new_engine(planes, host, 2)
    before = host.tensor.clone()
    with pytest.raises(ValueError):
        engine.store(ids, slots)
    assert torch.equal(host.tensor, before)


def test_load_rejects_duplicate_engine_blocks(new_engine):
    _, planes = cpu_kv_planes(num_layers=1)
    host = make_host(4, 2 * planes[0].shape[1])
    engine = new_engine(planes, host, 2)
    with pytest.raises(ValueError, match="twice"):
        engine.load(np.array([0, 1]), np.array([[5, 6], [6, 7]]))


def test_empty_batches_are_no_ops(new_engine):
    _, planes = cpu_kv_planes(num_layers=1)
    host = make_host(2, 2 * planes[0].shape[1])
    engine = new_engine(planes, host, 2)
    before = host.tensor.clone()
    for ids, slots in (([], []), (np.empty((0, 2), np.int64), np.empty(0, np.int64))):
        assert engine.is_done(engine.store(ids, slots))
        assert engine.is_done(engine.load(slots, ids))
    assert torch.equal(host.tensor, before)


def test_close_refuses_new_copies():
    _, planes = cpu_kv_planes(num_layers=1)
    engine = TorchCopyEngine(planes, make_host(2, 2 * planes[0].shape[1]), 2)
    engine.close()
    engine.close()
    with pytest.raises(CopyEngineClosedError):
        engine.store(np.array([[0, 1]]), np.array([0]))


def test_construction_errors():
    _, planes = cpu_kv_planes(num_layers=2)
    with pytest.raises(ValueError, match="cannot hold"):
        TorchCopyEngine(planes, make_host(2, planes[0].shape[1]), 2)
    with pytest.raises(ValueError):
        TorchCopyEngine([], make_host(2, 64), 1)
    with pytest.raises(ValueError):
        make_copy_engine([], make_host(2, 64), 1)
    meta = [torch.empty((4, 16), dtype=torch.uint8, device="meta")]
    with pytest.raises(ValueError, match="no copy engine"):
        make_copy_engine(meta, make_host(2, 64), 1)


def test_concurrent_store_and_load_from_two_threads(new_engine):
    """The runner stores from vLLM's thread while its copy thread loads; disjoint slots
    and blocks must not disturb each other."""
    rng = np.random.default_rng(9)
    _, planes = cpu_kv_planes(num_layers=4, num_blocks=400, block_size=16)
    bpc = 4
    layout = SlotLayout.packed([p.shape[1] for p in planes], bpc)
    host = make_host(40, layout.slot_bytes)
    engine = new_engine(planes, host, bpc)
    blocks = rng.permutation(400)
    store_ids = blocks[:80].reshape(20, bpc)
    load_ids = blocks[80:160].reshape(20, bpc)
    store_slots, load_slots = np.arange(20), np.arange(20, 40)
    host_before = host.tensor.clone()
    planes_before = [p.clone() for p in planes]
    errors: list[BaseException] = []

    def run(fn):
        try:
            for _ in range(20):
                fn()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(lambda: engine.store(store_ids, store_slots),)),
               threading.Thread(target=run, args=(lambda: engine.load(load_slots, load_ids),))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for c in range(20):
        for p, plane in enumerate(planes):
            for i in range(bpc):
                assert torch.equal(expected_slot_rows(layout, host.tensor[store_slots[c]], p, i),
                                   planes_before[p][store_ids[c, i]])
                assert torch.equal(plane[load_ids[c, i]],
                                   expected_slot_rows(layout, host_before[load_slots[c]], p, i))


def reference_store(planes, host, layout, ids, slots):
    """The slot layout formula, one block row at a time (the spec)."""
    for c, slot in enumerate(slots):
        for i, b in enumerate(ids[c]):
            if b != SKIP_BLOCK:
                for p, plane in enumerate(planes):
                    off = layout.plane_offsets[p] + i * layout.plane_bytes[p]
                    host[slot, off:off + layout.plane_bytes[p]] = plane[b]


def reference_load(planes, host, layout, ids, slots):
    for c, slot in enumerate(slots):
        for i, b in enumerate(ids[c]):
            if b != SKIP_BLOCK:
                for p, plane in enumerate(planes):
                    off = layout.plane_offsets[p] + i * layout.plane_bytes[p]
                    plane[b] = host[slot, off:off + layout.plane_bytes[p]]


def kv_layouts(num_blocks):
    """Planes of three backends' layouts, with pieces of odd sizes (not multiples of 64,
    so streamed copies have heads and tails): FlashAttention's (2, nb, bs, heads, hd)
    split into K and V planes per layer; K/V halves of one (nb, 2, X) tensor, whose rows
    are twice their plane bytes apart; the CPU backend's one packed plane per layer."""
    g = torch.Generator().manual_seed(11)
    fa = [torch.randint(0, 256, (2, num_blocks, 5, 3, 70), dtype=torch.uint8, generator=g)
          for _ in range(2)]
    halves = torch.randint(0, 256, (num_blocks, 2, 1100), dtype=torch.uint8, generator=g)
    cpu = torch.randint(0, 256, (num_blocks, 2, 9, 2 * 33), dtype=torch.uint8, generator=g)
    return {
        "flash_attention_kv_split": [p for t in fa for p in planes_from_kv_tensor(t, num_blocks)],
        "strided_rows": [halves[:, 0], halves[:, 1]],
        "cpu_packed": planes_from_kv_tensor(cpu, num_blocks),
    }


@pytest.mark.parametrize("kind", ["flash_attention_kv_split", "strided_rows", "cpu_packed"])
def test_random_requests_match_the_reference_copy(new_engine, kind):
    """Random chunks (contiguous runs, shuffled ids, SKIP_BLOCK holes, padded slots) in
    both directions, against the per-block reference on copies of the same bytes."""
    rng = np.random.default_rng(7)
    num_blocks, bpc, num_slots = 90, 4, 12
    planes = kv_layouts(num_blocks)[kind]
    layout = SlotLayout(tuple(p.shape[1] for p in planes), bpc,
                        bpc * sum(p.shape[1] for p in planes) + 72)
    host = make_host(num_slots, layout.slot_bytes)
    engine = new_engine(planes, host, bpc)
    for round_ in range(6):
        n = int(rng.integers(1, 6))
        if round_ % 2:
            ids = rng.choice(num_blocks, n * bpc, replace=False).reshape(n, bpc)
        else:
            start = int(rng.integers(0, num_blocks - n * bpc + 1))
            ids = np.arange(start, start + n * bpc).reshape(n, bpc)
        ids = np.where(rng.random(ids.shape) < 0.2, SKIP_BLOCK, ids)
        slots = rng.choice(num_slots, n, replace=False)
        want_host = host.tensor.clone()
        reference_store(planes, want_host, layout, ids, slots)
        engine.store(ids, slots)
        assert torch.equal(host.tensor, want_host)

        targets = np.where(ids == SKIP_BLOCK, SKIP_BLOCK,
                           rng.permutation(num_blocks)[:ids.size].reshape(ids.shape))
        want_planes = [p.clone() for p in planes]
        reference_load(want_planes, host.tensor, layout, targets, slots)
        engine.load(slots, targets)
        for got, want in zip(planes, want_planes):
            assert torch.equal(got, want)


def test_large_request_is_split_over_threads_and_streamed():
    """A request above both thresholds (default values) copies the same bytes."""
    if not cpu_kernel.AVAILABLE:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(2)
    num_blocks, bpc = 64, 8
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randint(0, 256, (num_blocks, 16 << 10), dtype=torch.uint8, generator=g)
               for _ in range(8)]
    planes = [p for t in tensors for p in planes_from_kv_tensor(t, num_blocks)]
    layout = SlotLayout.packed([p.shape[1] for p in planes], bpc)
    host = make_host(6, layout.slot_bytes)
    ids = rng.permutation(num_blocks)[:6 * bpc].reshape(6, bpc)
    slots = rng.permutation(6)
    assert ids.size * sum(layout.plane_bytes) >= max(torch_engine.STREAM_MIN_BYTES,
                                                     2 * torch_engine.PARALLEL_MIN_BYTES)
    engine = TorchCopyEngine(planes, host, bpc, strategy="compiled", num_threads=2)
    want = host.tensor.clone()
    reference_store(planes, want, layout, ids, slots)
    engine.store(ids, slots)
    assert torch.equal(host.tensor, want)
    before = [p.clone() for p in planes]
    for p in planes:
        p.zero_()
    engine.load(slots, ids)
    for got, want_plane in zip(planes, before):
        assert torch.equal(got[torch.from_numpy(ids.reshape(-1))],
                           want_plane[torch.from_numpy(ids.reshape(-1))])
    engine.close()


def test_strategy_and_thread_arguments():
    _, planes = cpu_kv_planes(num_layers=1)
    host = make_host(2, 2 * planes[0].shape[1])
    with pytest.raises(ValueError, match="strategy"):
        TorchCopyEngine(planes, host, 2, strategy="memcpy")
    with pytest.raises(ValueError, match="num_threads"):
        TorchCopyEngine(planes, host, 2, num_threads=0)
    engine = TorchCopyEngine(planes, host, 2, strategy="numpy", num_threads=4)
    assert engine.num_threads == 1  # the numpy loop is single-threaded
    default = TorchCopyEngine(planes, host, 2)
    assert default.strategy == ("compiled" if cpu_kernel.AVAILABLE else "numpy")
    default.close()
    default.close()


def test_validation_is_per_destination_and_ignores_fully_skipped_rows(new_engine):
    """Every strategy applies the same rules: one slot in two rows is fine when their
    positions differ (SKIP_BLOCK elsewhere); a row that copies nothing names no slot;
    a store twice into one position, or an id past the end, raises before copying."""
    _, planes = cpu_kv_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], 2)
    host = make_host(3, layout.slot_bytes)
    engine = new_engine(planes, host, 2)
    engine.store(np.array([[4, SKIP_BLOCK], [SKIP_BLOCK, 9], [SKIP_BLOCK, SKIP_BLOCK]]),
                 np.array([1, 1, 99]))
    for p, plane in enumerate(planes):
        assert torch.equal(expected_slot_rows(layout, host.tensor[1], p, 0), plane[4])
        assert torch.equal(expected_slot_rows(layout, host.tensor[1], p, 1), plane[9])
    before = host.tensor.clone()
    with pytest.raises(ValueError, match="twice"):
        engine.store(np.array([[4, SKIP_BLOCK], [5, 6]]), np.array([2, 2]))
    with pytest.raises(ValueError, match="block ids"):
        engine.store(np.array([[4, 5], [6, NUM_BLOCKS + 3]]), np.array([0, 2]))
    with pytest.raises(ValueError):
        engine.store(np.array([[4, 5]]), np.array([-1]))
    assert torch.equal(host.tensor, before)


def test_default_falls_back_to_numpy_when_the_loop_cannot_build(monkeypatch, caplog):
    """numba installed but compiling fails (an unsupported platform): the default engine
    copies with numpy and says so; asking for "compiled" explicitly raises."""
    def broken():
        raise cpu_kernel.KernelUnavailableError("the compiled copy loop failed to build: boom")

    monkeypatch.setattr(cpu_kernel, "AVAILABLE", True)
    monkeypatch.setattr(cpu_kernel, "ensure_compiled", broken)
    _, planes = cpu_kv_planes(num_layers=1)
    host = make_host(2, 2 * planes[0].shape[1])
    with caplog.at_level("WARNING"):
        engine = TorchCopyEngine(planes, host, 2)
    assert engine.strategy == "numpy" and "falls back to numpy" in caplog.text
    engine.store(np.array([[3, 4]]), np.array([1]))
    assert torch.equal(host.tensor[1, :planes[0].shape[1]], planes[0][3])
    with pytest.raises(cpu_kernel.KernelUnavailableError):
        TorchCopyEngine(planes, host, 2, strategy="compiled")


@pytest.mark.parametrize("pattern", ["contiguous", "shuffled"])
def test_load_by_layer_writes_what_load_writes_each_layer_by_its_mark(pattern, new_engine):
    """A same-step load per layer (issue 29): the same bytes as ``load``, and once a
    layer's mark was waited for (``fence_mark``, what that layer's attention does) its
    planes hold the chunk, whichever strategy copies (numpy copies whole at once)."""
    from kv_offload.copy.layers import PlaneLayers

    rng = np.random.default_rng(7)
    _, planes = cpu_kv_planes(num_layers=4)  # one plane per layer; two layers of two
    layers = PlaneLayers.from_counts(["a", "b"], [2, 2])
    layout = SlotLayout.packed([p.shape[1] for p in planes], 4)
    host = make_host(8, layout.slot_bytes)
    engine = new_engine(planes, host, 4)
    ids, slots = request(rng, n_chunks=3, bpc=4, num_slots=8, pattern=pattern)
    reference = [p.clone() for p in planes]
    engine.load(slots, ids)
    want = [p.clone() for p in planes]
    for p, r in zip(planes, reference):
        p.copy_(r)
    copy = engine.load_by_layer(slots, ids, layers)
    for layer, mark in enumerate(copy.layer_marks):
        engine.fence_mark(mark)
        for p in (2 * layer, 2 * layer + 1):
            assert torch.equal(planes[p], want[p])
    engine.wait(copy.handle)
    assert engine.is_done(copy.handle)
    with pytest.raises(ValueError, match="layers cover"):
        engine.load_by_layer(slots, ids, PlaneLayers.from_counts(["a"], [3]))
    with pytest.raises(ValueError):
        engine.load_by_layer(slots, np.full_like(ids, NUM_BLOCKS), layers)


def test_a_failed_copy_by_layer_releases_every_mark_and_raises_in_wait(monkeypatch):
    """A copy that raises on the layer thread never leaves a layer waiting, and ``wait``
    raises it (the worker then fails the load's chunks)."""
    from kv_offload.copy.layers import PlaneLayers

    if not cpu_kernel.AVAILABLE:
        pytest.skip("numba is not installed")
    _, planes = cpu_kv_planes(num_layers=4)
    layout = SlotLayout.packed([p.shape[1] for p in planes], 2)
    engine = TorchCopyEngine(planes, make_host(4, layout.slot_bytes), 2, strategy="compiled")

    def broken(*args):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(cpu_kernel, "copy_pieces", broken)
    copy = engine.load_by_layer(np.array([1]), np.array([[3, 4]]),
                                PlaneLayers.from_counts(["a", "b"], [2, 2]))
    for mark in copy.layer_marks:
        engine.fence_mark(mark)
    with pytest.raises(RuntimeError, match="copy failed"):
        engine.wait(copy.handle)
    assert engine.took_s(copy.handle) is None
    engine.close()
    with pytest.raises(CopyEngineClosedError):
        engine.load_by_layer(np.array([1]), np.array([[3, 4]]),
                             PlaneLayers.from_counts(["a", "b"], [2, 2]))


def test_load_by_layer_keeps_no_caller_array_its_thread_still_reads(monkeypatch):
    """The copy contract: callers own the arrays, which are not kept. ``load_by_layer``
    returns before its thread copies; a caller reusing its block-id array after the call
    must not move the copy to other blocks (checked ones or not: the loop trusts them)."""
    from kv_offload.copy.layers import PlaneLayers

    if not cpu_kernel.AVAILABLE:
        pytest.skip("numba is not installed")
    _, planes = cpu_kv_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], 2)
    host = make_host(4, layout.slot_bytes)
    engine = TorchCopyEngine(planes, host, 2, strategy="compiled")
    release, real = threading.Event(), cpu_kernel.copy_pieces

    def gated(*args):
        if threading.current_thread().name.startswith("kv-copy-layers"):
            assert release.wait(10)
        return real(*args)

    monkeypatch.setattr(cpu_kernel, "copy_pieces", gated)
    before = [p.clone() for p in planes]
    ids = np.array([[3, 4]], dtype=np.int64)
    copy = engine.load_by_layer(np.array([1]), ids, PlaneLayers.from_counts(["a", "b"], [1, 1]))
    ids[:] = [[5, 6]]  # the caller's array, reused
    release.set()
    engine.wait(copy.handle)
    for p, b in zip(planes, before):
        assert torch.equal(p[[5, 6]], b[[5, 6]])  # untouched
        assert not torch.equal(p[[3, 4]], b[[3, 4]])  # loaded
    engine.close()


def test_a_copy_by_layer_that_never_runs_releases_every_mark(caplog):
    """The layer thread's initializer raising breaks its pool: the copy never runs, so
    ``_copy_layers`` never sets the marks. A layer waiting for one (vLLM's forward) must
    not wait for ever; ``wait`` raises (the worker fails the load's chunks)."""
    from kv_offload.copy.layers import PlaneLayers

    if not cpu_kernel.AVAILABLE:
        pytest.skip("numba is not installed")
    _, planes = cpu_kv_planes(num_layers=2)
    layout = SlotLayout.packed([p.shape[1] for p in planes], 2)

    def broken() -> None:
        raise OSError("no such CPU")

    engine = TorchCopyEngine(planes, make_host(4, layout.slot_bytes), 2, strategy="compiled",
                             layer_thread_initializer=broken)
    copy = engine.load_by_layer(np.array([1]), np.array([[3, 4]]),
                                PlaneLayers.from_counts(["a", "b"], [1, 1]))
    waiter = threading.Thread(target=lambda: [engine.fence_mark(m) for m in copy.layer_marks],
                              daemon=True)
    waiter.start()
    waiter.join(10)
    assert not waiter.is_alive(), "a layer waits for ever"
    with pytest.raises(BrokenExecutor):
        engine.wait(copy.handle)
    engine.close()
