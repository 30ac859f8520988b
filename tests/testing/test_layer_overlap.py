"""gpu_check's ``layer_overlap`` part (issue 29) on the CPU: its summary arithmetic, and
its harness with the torch engine (synchronous: every mode loads whole), whose byte
checks must pass, and fail when a load leaves blocks unwritten. On a GPU it runs the CuPy
engine: benchmarks/gpu_check.sh."""

from __future__ import annotations

from kv_offload.copy.base import LayeredCopy
from kv_offload.testing.layer_overlap import OverlapSetup, layer_overlap, overlap_summary

TINY = OverlapSetup(layers=3, num_blocks=16, block_bytes=256, blocks_per_chunk=2, chunks=3,
                    matmuls=1, dim=32)


def test_the_summary_says_what_per_layer_waits_hide():
    out = overlap_summary({"none": 10.0, "whole": 15.0, "per_layer": 11.0}, 256 << 20)
    assert out["whole_load_adds_ms"] == 5.0 and out["per_layer_adds_ms"] == 1.0
    assert out["hidden_by_per_layer"] == 0.8 and out["per_layer_faster"]
    assert out["load_mib"] == 256.0
    none_measurable = overlap_summary({"none": 10.0, "whole": 9.9, "per_layer": 10.0}, 1)
    assert none_measurable["hidden_by_per_layer"] is None


def test_the_harness_runs_on_the_cpu_and_every_byte_is_right():
    out = layer_overlap(TINY, device="cpu", reps=2)
    assert out["ok"] and out["mismatches"] == {"whole": 0, "per_layer": 0}
    assert set(out["forward_ms"]) == {"none", "whole", "per_layer"}
    assert out["setup"]["layers"] == 3


def test_a_load_that_leaves_a_layer_unwritten_is_a_mismatch(monkeypatch):
    """What a per-layer wait that let a layer read before its copy would look like: the
    layer sums the zeros it was cleared to."""
    import kv_offload.copy as copy

    real = copy.make_copy_engine

    def without_last_layer(planes, host, bpc, **kwargs):
        engine = real(planes, host, bpc, **kwargs)
        inner = engine.load_by_layer

        def load_by_layer(slots, block_ids, layers):
            done = inner(slots, block_ids, layers)
            for mark in done.layer_marks:  # the CPU engine's thread copies after we return
                engine.fence_mark(mark)
            for plane in planes[-2:]:  # the last layer's K and V: "not yet copied"
                plane[block_ids.reshape(-1)] = 0
            return LayeredCopy(done.handle, done.layer_marks)

        engine.load_by_layer = load_by_layer
        return engine

    monkeypatch.setattr(copy, "make_copy_engine", without_last_layer)
    out = layer_overlap(TINY, device="cpu", reps=1)
    assert not out["ok"] and out["mismatches"]["whole"] == 0
    assert out["mismatches"]["per_layer"] == 1 + 2 * TINY.chunks * TINY.blocks_per_chunk

