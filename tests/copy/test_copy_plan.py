"""Copy planning (kv_offload.copy.plan): runs, byte ranges and segments, checked by
replaying them on byte arrays against a per-block reference copy."""

from __future__ import annotations

import numpy as np
import pytest

from kv_offload.copy.plan import (
    SKIP_BLOCK,
    BlockMap,
    ByteRanges,
    Direction,
    SlotLayout,
    check_block_map,
    expand_chunks,
    plan_runs,
    plan_segments,
    runs_to_byte_ranges,
    split_byte_ranges,
    strided_groups,
)

# -- builders and reference ---------------------------------------------------------------


def make_engine(rng, *, num_blocks, plane_bytes, row_strides):
    """One flat byte buffer per plane, random bytes, rows row_strides[p] apart."""
    return [rng.integers(0, 256, num_blocks * s, dtype=np.uint8)
            for pb, s in zip(plane_bytes, row_strides)]


def reference_copy(direction, engine, host, layout, row_strides, block_ids, slots):
    """Per-block, per-plane copy straight from the layout formula (the spec)."""
    bpc = layout.blocks_per_chunk
    for c, slot in enumerate(slots):
        for i in range(bpc):
            b = int(block_ids[c][i])
            if b == SKIP_BLOCK:
                continue
            for p, (pb, stride) in enumerate(zip(layout.plane_bytes, row_strides)):
                h = slot * layout.slot_bytes + layout.plane_offsets[p] + i * pb
                e = b * stride
                if direction is Direction.STORE:
                    host[h:h + pb] = engine[p][e:e + pb]
                else:
                    engine[p][e:e + pb] = host[h:h + pb]


def replay_ranges(direction, engine, host, ranges: ByteRanges):
    for p, e, h, n in zip(ranges.plane, ranges.engine_offset, ranges.host_offset,
                          ranges.nbytes):
        if direction is Direction.STORE:
            host[h:h + n] = engine[p][e:e + n]
        else:
            engine[p][e:e + n] = host[h:h + n]


def naive_runs(bm: BlockMap, bpc, merge_across_slots):
    """Greedy run building over host order, one block at a time."""
    order = sorted(range(bm.num_blocks),
                   key=lambda k: bm.host_slots[k] * bpc + bm.host_positions[k])
    runs = []
    for k in order:
        e, s, pos = int(bm.engine_blocks[k]), int(bm.host_slots[k]), int(bm.host_positions[k])
        if runs:
            e0, s0, p0, n0 = runs[-1]
            host_next = s0 * bpc + p0 + n0 == s * bpc + pos
            same_slot = (p0 + n0 - 1) // bpc + s0 == s or merge_across_slots
            if e0 + n0 == e and host_next and same_slot:
                runs[-1] = (e0, s0, p0, n0 + 1)
                continue
        runs.append((e, s, pos, 1))
    return runs


def random_request(rng, *, num_blocks, num_slots, n_chunks, bpc, pattern, skip_prob=0.0):
    slots = rng.choice(num_slots, n_chunks, replace=False)
    if pattern == "contiguous":
        start = rng.integers(0, num_blocks - n_chunks * bpc + 1)
        ids = np.arange(start, start + n_chunks * bpc).reshape(n_chunks, bpc)
    elif pattern == "reversed":
        ids = rng.choice(num_blocks, n_chunks * bpc, replace=False)
        ids = np.sort(ids)[::-1].reshape(n_chunks, bpc)
    else:
        ids = rng.choice(num_blocks, n_chunks * bpc, replace=False).reshape(n_chunks, bpc)
    ids = ids.astype(np.int64)
    if skip_prob:
        ids[rng.random(ids.shape) < skip_prob] = SKIP_BLOCK
    return ids, slots


# -- SlotLayout ---------------------------------------------------------------------------


def test_layout_offsets_and_sizes():
    layout = SlotLayout.packed([100, 40, 100], 4)
    assert layout.plane_offsets == (0, 400, 560)
    assert layout.chunk_bytes == layout.slot_bytes == 960
    assert not layout.contiguous_across_slots


@pytest.mark.parametrize(("planes", "slot_bytes", "contiguous"), [
    ((64,), 256, True),  # one plane, no padding: slots abut
    ((64,), 512, False),  # padding between slots
    ((64, 64), 512, False),  # plane 1 lies between plane 0 of slot s and s+1
])
def test_contiguous_across_slots_only_for_a_single_unpadded_plane(planes, slot_bytes, contiguous):
    assert SlotLayout(planes, 4, slot_bytes).contiguous_across_slots is contiguous


@pytest.mark.parametrize(("planes", "bpc", "slot_bytes"), [
    ((), 4, 100), ((0,), 4, 100), ((10,), 0, 100), ((10, 10), 4, 79),
])
def test_layout_rejects_bad_geometry(planes, bpc, slot_bytes):
    with pytest.raises(ValueError):
        SlotLayout(planes, bpc, slot_bytes)


# -- expand_chunks / check_block_map ------------------------------------------------------


def test_expand_drops_skipped_positions():
    bm = expand_chunks(np.array([[SKIP_BLOCK, 5, 6], [9, SKIP_BLOCK, 1]]), np.array([7, 2]),
                       blocks_per_chunk=3)
    assert bm.engine_blocks.tolist() == [5, 6, 9, 1]
    assert bm.host_slots.tolist() == [7, 7, 2, 2]
    assert bm.host_positions.tolist() == [1, 2, 0, 2]
    assert bm.rows.tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("ids", [[], np.empty((0, 4), np.int64), np.empty(0)])
def test_expand_accepts_empty_batches(ids):
    bm = expand_chunks(ids, np.empty(0, np.int64), blocks_per_chunk=4)
    assert bm.num_blocks == 0
    assert plan_runs(bm, blocks_per_chunk=4, merge_across_slots=False).num_runs == 0
    assert plan_segments(bm).num_segments == 0


@pytest.mark.parametrize(("ids", "slots"), [
    (np.zeros((2, 3), np.int64), np.array([0, 1])),  # wrong blocks_per_chunk
    (np.zeros((2, 4), np.int64), np.array([0])),  # rows != slots
    (np.zeros(4, np.int64), np.array([0])),  # 1-D block ids
    (np.zeros((1, 4), np.float64), np.array([0])),  # not integers
    (np.array([[0, 1, -2, 3]]), np.array([0])),  # negative other than SKIP_BLOCK
])
def test_expand_rejects_bad_shapes_and_values(ids, slots):
    with pytest.raises(ValueError):
        expand_chunks(ids, slots, blocks_per_chunk=4)


def test_check_block_map_bounds():
    bm = expand_chunks(np.array([[0, 1], [2, 3]]), np.array([0, 1]), blocks_per_chunk=2)
    check_block_map(bm, Direction.STORE, num_engine_blocks=4, num_slots=2)
    with pytest.raises(ValueError, match="block ids"):
        check_block_map(bm, Direction.STORE, num_engine_blocks=3, num_slots=2)
    with pytest.raises(ValueError, match="slots"):
        check_block_map(bm, Direction.LOAD, num_engine_blocks=4, num_slots=1)


def test_check_block_map_duplicate_destinations():
    same_slot = expand_chunks(np.array([[0, 1], [2, 3]]), np.array([5, 5]), blocks_per_chunk=2)
    with pytest.raises(ValueError, match="twice"):
        check_block_map(same_slot, Direction.STORE, num_engine_blocks=8, num_slots=8)
    # loading one slot into two sets of blocks is fine
    check_block_map(same_slot, Direction.LOAD, num_engine_blocks=8, num_slots=8)
    same_block = expand_chunks(np.array([[0, 1], [1, 3]]), np.array([2, 5]), blocks_per_chunk=2)
    with pytest.raises(ValueError, match="twice"):
        check_block_map(same_block, Direction.LOAD, num_engine_blocks=8, num_slots=8)
    # storing one block into two slots is fine
    check_block_map(same_block, Direction.STORE, num_engine_blocks=8, num_slots=8)


# -- plan_runs ----------------------------------------------------------------------------


def test_one_chunk_of_consecutive_blocks_is_one_run():
    bm = expand_chunks(np.arange(10, 18)[None, :], np.array([3]), blocks_per_chunk=8)
    runs = plan_runs(bm, blocks_per_chunk=8, merge_across_slots=False)
    assert runs.engine_start.tolist() == [10]
    assert runs.host_slot.tolist() == [3]
    assert runs.host_offset.tolist() == [0]
    assert runs.num_blocks.tolist() == [8]


def test_reversed_blocks_give_single_block_runs():
    bm = expand_chunks(np.arange(17, 9, -1)[None, :], np.array([0]), blocks_per_chunk=8)
    runs = plan_runs(bm, blocks_per_chunk=8, merge_across_slots=False)
    assert runs.num_blocks.tolist() == [1] * 8
    assert runs.engine_start.tolist() == list(range(17, 9, -1))
    assert runs.host_offset.tolist() == list(range(8))


@pytest.mark.parametrize("slots", [[3, 4], [4, 3]])
def test_adjacent_slots_merge_only_when_host_bytes_are_contiguous(slots):
    # engine blocks 0..15 go to slots 3 and 4 (chunk order must not matter)
    ids = np.arange(16).reshape(2, 8) if slots == [3, 4] else np.arange(16).reshape(2, 8)[::-1]
    bm = expand_chunks(ids, np.array(slots), blocks_per_chunk=8)
    apart = plan_runs(bm, blocks_per_chunk=8, merge_across_slots=False)
    assert sorted(apart.num_blocks.tolist()) == [8, 8]
    merged = plan_runs(bm, blocks_per_chunk=8, merge_across_slots=True)
    assert merged.num_blocks.tolist() == [16]
    assert (merged.engine_start[0], merged.host_slot[0], merged.host_offset[0]) == (0, 3, 0)


def test_skipped_block_splits_a_run():
    bm = expand_chunks(np.array([[4, 5, SKIP_BLOCK, 7]]), np.array([1]), blocks_per_chunk=4)
    runs = plan_runs(bm, blocks_per_chunk=4, merge_across_slots=True)
    assert list(zip(runs.engine_start.tolist(), runs.host_offset.tolist(),
                    runs.num_blocks.tolist())) == [(4, 0, 2), (7, 3, 1)]


@pytest.mark.parametrize("pattern", ["contiguous", "reversed", "shuffled"])
@pytest.mark.parametrize("merge", [False, True])
def test_runs_match_a_naive_greedy_reference(pattern, merge):
    rng = np.random.default_rng(7)
    for _ in range(30):
        bpc = int(rng.integers(1, 6))
        n = int(rng.integers(1, 6))
        ids, slots = random_request(rng, num_blocks=64, num_slots=12, n_chunks=n, bpc=bpc,
                                    pattern=pattern, skip_prob=0.15)
        if pattern == "contiguous":
            slots = np.sort(slots)  # make cross-slot merges possible
        bm = expand_chunks(ids, slots, blocks_per_chunk=bpc)
        runs = plan_runs(bm, blocks_per_chunk=bpc, merge_across_slots=merge)
        got = list(zip(runs.engine_start.tolist(), runs.host_slot.tolist(),
                       runs.host_offset.tolist(), runs.num_blocks.tolist()))
        assert got == naive_runs(bm, bpc, merge)
        assert int(runs.num_blocks.sum()) == bm.num_blocks


# -- byte ranges --------------------------------------------------------------------------


LAYOUT_CASES = [
    # plane_bytes, row_strides, blocks_per_chunk, slot padding
    ((64,), (64,), 4, 0),  # one packed plane: cross-slot merges
    ((64,), (96,), 4, 0),  # one plane with padded rows: ranges per block
    ((64,), (64,), 4, 32),  # padded slots
    ((48, 48), (48, 48), 3, 0),  # K and V planes
    ((32, 80, 16), (32, 96, 16), 2, 8),  # unequal planes, one strided, padded slots
]


@pytest.mark.parametrize(("plane_bytes", "row_strides", "bpc", "pad"), LAYOUT_CASES)
@pytest.mark.parametrize("pattern", ["contiguous", "reversed", "shuffled"])
@pytest.mark.parametrize("direction", list(Direction))
def test_byte_ranges_replay_equals_reference(plane_bytes, row_strides, bpc, pad, pattern,
                                             direction):
    rng = np.random.default_rng(hash((plane_bytes, pattern, direction.value)) % 2**32)
    layout = SlotLayout(plane_bytes, bpc, bpc * sum(plane_bytes) + pad)
    num_blocks, num_slots = 40, 9
    for _ in range(10):
        n = int(rng.integers(1, 5))
        ids, slots = random_request(rng, num_blocks=num_blocks, num_slots=num_slots,
                                    n_chunks=n, bpc=bpc, pattern=pattern, skip_prob=0.1)
        if pattern == "contiguous":
            slots = np.sort(slots)
        engine = make_engine(rng, num_blocks=num_blocks, plane_bytes=plane_bytes,
                             row_strides=row_strides)
        host = rng.integers(0, 256, num_slots * layout.slot_bytes, dtype=np.uint8)
        want_engine, want_host = [e.copy() for e in engine], host.copy()
        reference_copy(direction, want_engine, want_host, layout, row_strides, ids, slots)

        bm = expand_chunks(ids, slots, blocks_per_chunk=bpc)
        runs = plan_runs(bm, blocks_per_chunk=bpc,
                         merge_across_slots=layout.contiguous_across_slots)
        ranges = runs_to_byte_ranges(runs, layout, row_strides)
        assert ranges.total_bytes == sum(
            int((ids != SKIP_BLOCK).sum()) * pb for pb in plane_bytes)
        for got in (ranges, split_byte_ranges(ranges, 40)):
            eng, hst = [e.copy() for e in engine], host.copy()
            replay_ranges(direction, eng, hst, got)
            assert np.array_equal(hst, want_host)
            for a, b in zip(eng, want_engine):
                assert np.array_equal(a, b)


def loop_runs_to_byte_ranges(runs, layout, row_strides):
    """``runs_to_byte_ranges`` as it was before it was vectorised: one pass per plane."""
    parts = []
    for p, (pb, stride) in enumerate(zip(layout.plane_bytes, row_strides)):
        host0 = runs.host_slot * layout.slot_bytes + layout.plane_offsets[p] + runs.host_offset * pb
        if stride == pb:
            eng, host, nbytes = runs.engine_start * stride, host0, runs.num_blocks * pb
        else:
            within = np.concatenate([np.arange(n) for n in runs.num_blocks]).astype(np.int64)
            rep = np.repeat(np.arange(runs.num_runs), runs.num_blocks)
            eng = (runs.engine_start[rep] + within) * stride
            host = host0[rep] + within * pb
            nbytes = np.full(eng.shape[0], pb, np.int64)
        parts.append((np.full(eng.shape[0], p, np.int64), eng, host, nbytes))
    return ByteRanges(*(np.concatenate(cols).astype(np.int64) for cols in zip(*parts)))


@pytest.mark.parametrize("seed", range(40))
def test_byte_ranges_equal_the_per_plane_loop_they_replaced(seed):
    """Regression for the vectorised planner: same ranges, same order, same dtype as the
    per-plane loop, over random layouts (packed, strided and mixed planes, padding) and
    random requests (runs of every length, skipped positions, cross-slot merges)."""
    rng = np.random.default_rng(seed)
    num_planes = int(rng.integers(1, 7))
    plane_bytes = [int(rng.integers(1, 200)) for _ in range(num_planes)]
    row_strides = [pb + (int(rng.integers(1, 50)) if rng.random() < 0.4 else 0)
                   for pb in plane_bytes]
    bpc = int(rng.integers(1, 6))
    pad = int(rng.integers(0, 40)) if rng.random() < 0.5 else 0
    layout = SlotLayout(plane_bytes, bpc, bpc * sum(plane_bytes) + pad)
    num_slots = 12
    n = int(rng.integers(1, num_slots))
    pattern = ("contiguous", "reversed", "shuffled")[seed % 3]
    ids, slots = random_request(rng, num_blocks=80, num_slots=num_slots, n_chunks=n, bpc=bpc,
                                pattern=pattern, skip_prob=0.15 if seed % 2 else 0.0)
    if pattern == "contiguous":
        slots = np.sort(slots)
    bm = expand_chunks(ids, slots, blocks_per_chunk=bpc)
    runs = plan_runs(bm, blocks_per_chunk=bpc, merge_across_slots=layout.contiguous_across_slots)
    if runs.num_runs == 0:
        return
    got = runs_to_byte_ranges(runs, layout, row_strides)
    want = loop_runs_to_byte_ranges(runs, layout, row_strides)
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and np.array_equal(g, w)


def test_cross_slot_run_is_one_range():
    layout = SlotLayout.packed([64], 4)
    bm = expand_chunks(np.arange(8).reshape(2, 4), np.array([5, 6]), blocks_per_chunk=4)
    runs = plan_runs(bm, blocks_per_chunk=4, merge_across_slots=layout.contiguous_across_slots)
    ranges = runs_to_byte_ranges(runs, layout, [64])
    assert ranges.num_ranges == 1
    assert (ranges.engine_offset[0], ranges.host_offset[0], ranges.nbytes[0]) == (0, 5 * 256, 512)


def test_byte_ranges_reject_overlapping_rows_and_wrong_stride_count():
    layout = SlotLayout.packed([64, 64], 2)
    runs = plan_runs(expand_chunks([[0, 1]], [0], blocks_per_chunk=2), blocks_per_chunk=2,
                     merge_across_slots=False)
    with pytest.raises(ValueError):
        runs_to_byte_ranges(runs, layout, [64])
    with pytest.raises(ValueError):
        runs_to_byte_ranges(runs, layout, [64, 32])


def test_split_keeps_bytes_and_alignment():
    ranges = ByteRanges(np.array([0, 1]), np.array([0, 4096]), np.array([1024, 0]),
                        np.array([100, 33]))
    pieces = split_byte_ranges(ranges, 16)
    assert pieces.nbytes.max() <= 16
    assert pieces.total_bytes == 133
    assert pieces.num_ranges == 7 + 3
    assert np.all(pieces.engine_offset[:7] % 16 == 0)
    assert pieces.plane.tolist() == [0] * 7 + [1] * 3
    with pytest.raises(ValueError):
        split_byte_ranges(ranges, 0)


# -- segments -----------------------------------------------------------------------------


def test_segments_describe_runs_and_gathers():
    bm = expand_chunks(np.array([[10, 11, 12, 13], [3, 2, SKIP_BLOCK, 7]]), np.array([3, 4]),
                       blocks_per_chunk=4)
    seg = plan_segments(bm)
    assert seg.host_slot.tolist() == [3, 4, 4]
    assert seg.first_position.tolist() == [0, 0, 3]
    assert seg.length.tolist() == [4, 2, 1]
    assert seg.is_run.tolist() == [True, False, True]
    assert seg.engine_start.tolist() == [10, 3, 7]


@pytest.mark.parametrize("pattern", ["contiguous", "reversed", "shuffled"])
def test_segments_replay_equals_reference(pattern):
    rng = np.random.default_rng(11)
    bpc, num_blocks, num_slots = 5, 60, 7
    layout = SlotLayout.packed([8], bpc)
    for _ in range(20):
        n = int(rng.integers(1, 5))
        ids, slots = random_request(rng, num_blocks=num_blocks, num_slots=num_slots, n_chunks=n,
                                    bpc=bpc, pattern=pattern, skip_prob=0.2)
        bm = expand_chunks(ids, slots, blocks_per_chunk=bpc)
        seg = plan_segments(bm)
        assert int(seg.length.sum()) == bm.num_blocks
        engine = rng.integers(0, 256, (num_blocks, 8), dtype=np.uint8)
        host = np.zeros((num_slots, bpc, 8), np.uint8)
        for g in range(seg.num_segments):
            s, m = seg.start[g], seg.length[g]
            blocks = bm.engine_blocks[s:s + m]
            if seg.is_run[g]:
                assert np.array_equal(blocks, seg.engine_start[g] + np.arange(m))
            host[seg.host_slot[g], seg.first_position[g]:seg.first_position[g] + m] = engine[blocks]
        want = np.zeros(num_slots * layout.slot_bytes, np.uint8)
        reference_copy(Direction.STORE, [engine.reshape(-1)], want, layout, [8], ids, slots)
        assert np.array_equal(host.reshape(-1), want)


@pytest.mark.parametrize("direction", [Direction.STORE, Direction.LOAD])
def test_compiled_request_check_agrees_with_check_block_map(direction):
    """cpu_kernel.check_request (the compiled engine's checks) accepts and refuses exactly
    the requests check_block_map does: random ids with SKIP_BLOCK, repeated slots and
    blocks, and values past either end."""
    from kv_offload.copy import cpu_kernel

    if not cpu_kernel.AVAILABLE:
        pytest.skip("numba is not installed")
    from kv_offload.copy.plan import validated_chunks

    rng = np.random.default_rng(21)
    num_blocks, num_slots, bpc = 12, 5, 3
    outcomes = set()
    for _ in range(400):
        n = int(rng.integers(1, 4))
        ids = rng.integers(-1, num_blocks + 1, (n, bpc))
        slots = rng.integers(-1, num_slots + 1, n)
        ids_ok, slots_ok = validated_chunks(ids, slots, bpc)
        try:
            check_block_map(expand_chunks(ids, slots, blocks_per_chunk=bpc), direction,
                            num_engine_blocks=num_blocks, num_slots=num_slots)
            expected = None
        except ValueError as exc:
            expected = "twice" in str(exc)
        try:
            cpu_kernel.check_request(direction is Direction.STORE, ids_ok, slots_ok,
                                     num_blocks, num_slots)
            got = None
        except ValueError as exc:
            got = "twice" in str(exc)
        assert (expected is None) == (got is None), (ids, slots)
        outcomes.add(expected)
    assert outcomes == {None, True, False}  # accepted, duplicates and ranges all seen


# -- 2-D groups -----------------------------------------------------------------------------


def replay_groups(groups, memory):
    """Each group row by row, as cudaMemcpy2DAsync copies it (one flat address space)."""
    for s, d, w, h, sp, dp in zip(*(a.tolist() for a in groups)):
        assert w > 0 and h > 0 and sp >= w and dp >= w
        for r in range(h):
            memory[d + r * dp:d + r * dp + w] = memory[s + r * sp:s + r * sp + w].copy()


@pytest.mark.parametrize("seed", range(30))
def test_strided_groups_copy_what_the_ranges_copy(seed):
    """The 2-D path of the CuPy engine's DMA copies: replaying the groups moves the same
    bytes as replaying the ranges one by one, for every layout and request."""
    rng = np.random.default_rng(seed)
    num_planes = int(rng.integers(1, 5))
    plane_bytes = [int(rng.choice([8, 16, 24]))] * num_planes
    row_strides = [pb * int(rng.choice([1, 1, 2])) for pb in plane_bytes]
    bpc = int(rng.integers(1, 5))
    layout = SlotLayout(plane_bytes, bpc, bpc * sum(plane_bytes) + int(rng.choice([0, 8])))
    num_blocks, num_slots = 40, 10
    ids, slots = random_request(rng, num_blocks=num_blocks, num_slots=num_slots,
                                n_chunks=int(rng.integers(1, 6)), bpc=bpc,
                                pattern=("contiguous", "shuffled")[seed % 2])
    bm = expand_chunks(ids, np.sort(slots), blocks_per_chunk=bpc)
    runs = plan_runs(bm, blocks_per_chunk=bpc, merge_across_slots=layout.contiguous_across_slots)
    ranges = runs_to_byte_ranges(runs, layout, row_strides)
    # planes at random bases of one address space, the host buffer after them
    bases = np.cumsum([0] + [num_blocks * s + int(rng.integers(0, 64)) for s in row_strides])
    host_base = int(bases[-1]) + 100
    size = host_base + num_slots * layout.slot_bytes
    src = bases[ranges.plane] + ranges.engine_offset
    dst = host_base + ranges.host_offset
    memory = rng.integers(0, 256, size, dtype=np.uint8)
    want = memory.copy()
    replay_groups(strided_groups(src, dst, ranges.nbytes, max_pitch=1 << 20),
                  got := memory.copy())
    for s, d, n in zip(src.tolist(), dst.tolist(), ranges.nbytes.tolist()):
        want[d:d + n] = want[s:s + n]
    assert np.array_equal(got, want)
    groups = strided_groups(src, dst, ranges.nbytes, max_pitch=1 << 20)
    assert groups.height.tolist() == naive_group_heights(src, dst, ranges.nbytes, 1 << 20)


def naive_group_heights(src, dst, nbytes, max_pitch):
    """Greedy grouping, one range at a time (the spec of ``strided_groups``)."""
    heights, pitch = [], None
    for k in range(len(nbytes)):
        if heights and heights[-1] > 0 and k > 0:
            ds, dd, w = src[k] - src[k - 1], dst[k] - dst[k - 1], nbytes[k - 1]
            fits = nbytes[k] == w and w <= ds <= max_pitch and w <= dd <= max_pitch
            if fits and (heights[-1] == 1 or pitch == (ds, dd)):
                heights[-1] += 1
                pitch = (ds, dd)
                continue
        heights.append(1)
        pitch = None
    return heights


def test_strided_groups_make_one_copy_per_plane_and_run_of_padded_rows():
    """K and V planes interleaved per block (row stride 2 x plane bytes): one range per
    block and plane, one 2-D copy per plane and run."""
    layout = SlotLayout.packed([64, 64], 4)
    runs = plan_runs(expand_chunks([[10, 11, 12, 13], [20, 21, 22, 23]], [0, 1],
                                   blocks_per_chunk=4), blocks_per_chunk=4,
                     merge_across_slots=False)
    ranges = runs_to_byte_ranges(runs, layout, [128, 128])
    assert ranges.num_ranges == 16
    src = np.array([0, 64])[ranges.plane] + ranges.engine_offset
    groups = strided_groups(src, (1 << 20) + ranges.host_offset, ranges.nbytes, max_pitch=1 << 30)
    assert groups.num_groups == 4
    assert groups.height.tolist() == [4] * 4 and groups.src_pitch.tolist() == [128] * 4
    assert strided_groups(src, (1 << 20) + ranges.host_offset, ranges.nbytes,
                          max_pitch=100).num_groups == 16  # pitch over the limit: one each


def test_strided_groups_never_overlap_rows_nor_change_pitch_inside_a_group():
    src = np.array([0, 100, 200, 250, 300, 1000])
    dst = np.array([5000, 5100, 5200, 5300, 5400, 5500])
    groups = strided_groups(src, dst, np.full(6, 50), max_pitch=1 << 20)
    assert groups.height.tolist() == [3, 2, 1]
    assert groups.src_pitch.tolist() == [100, 50, 50]
    assert strided_groups(src[:0], dst[:0], src[:0], max_pitch=1).num_groups == 0
