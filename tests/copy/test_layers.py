"""Planes per attention layer, and a copy's byte ranges cut per layer (pure numpy): what
the CuPy engine issues one layer at a time for a same-step load (issue 29)."""

from __future__ import annotations

import numpy as np
import pytest

from kv_offload.copy.layers import PlaneLayers, split_by_layer
from kv_offload.copy.plan import (
    ByteRanges,
    SlotLayout,
    expand_chunks,
    plan_runs,
    runs_to_byte_ranges,
)


def test_layers_name_their_planes_in_order():
    layers = PlaneLayers.from_counts(["a", "b", "c"], [2, 1, 3])
    assert layers.starts == (0, 2, 3) and layers.num_planes == 6 and layers.num_layers == 3
    assert layers.layer_of_plane().tolist() == [0, 0, 1, 2, 2, 2]
    assert (layers.index("b"), layers.index("nope")) == (1, None)


@pytest.mark.parametrize("names, counts", [(["a"], [1, 1]), (["a", "b"], [1, 0]),
                                           (["a", "a"], [1, 1]), ([], [])])
def test_bad_layers_are_refused(names, counts):
    with pytest.raises(ValueError):
        PlaneLayers.from_counts(names, counts)


def test_ranges_are_cut_per_layer_keeping_their_order_and_every_range():
    """Two layers of K and V planes: each layer gets exactly the ranges of its planes,
    in the order the plan made them; together they are the plan."""
    layout = SlotLayout.packed((64, 64, 64, 64), 2)
    bm = expand_chunks(np.array([[3, 4], [9, 1]]), np.array([1, 0]), blocks_per_chunk=2)
    runs = plan_runs(bm, blocks_per_chunk=2, merge_across_slots=False)
    ranges = runs_to_byte_ranges(runs, layout, (64, 64, 64, 64))
    layers = PlaneLayers.from_counts(["l0", "l1"], [2, 2])
    parts = split_by_layer(ranges, layers)
    assert [set(p.plane.tolist()) for p in parts] == [{0, 1}, {2, 3}]
    assert sum(p.num_ranges for p in parts) == ranges.num_ranges
    for part, planes in zip(parts, ((0, 1), (2, 3))):
        keep = np.isin(ranges.plane, planes)
        for got, want in zip(part, ranges):
            assert np.array_equal(got, want[keep])


def test_a_layer_without_ranges_gets_an_empty_part_and_a_bad_plane_raises():
    layers = PlaneLayers.from_counts(["l0", "l1", "l2"], [1, 1, 1])
    ranges = ByteRanges(*(np.array(v, dtype=np.int64) for v in ([2, 0], [0, 8], [0, 8],
                                                                  [4, 4])))
    parts = split_by_layer(ranges, layers)
    assert [p.num_ranges for p in parts] == [1, 0, 1]
    assert parts[0].engine_offset.tolist() == [8] and parts[2].engine_offset.tolist() == [0]
    with pytest.raises(ValueError, match="out of range"):
        split_by_layer(ranges._replace(plane=np.array([3, 0])), layers)
