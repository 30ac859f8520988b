"""kv_capacity: vLLM's KV cache plan for a model geometry, with its hybrid KV cache manager
on or off, computed without an engine; and, started, the engine reports the same plan.

bench_hybrid prints computed rows for real geometries (Gemma-3-27B-like): the engine
test is what makes them trustworthy, so it compares the computed plan of the tiny
hybrid model with what two started engines (manager off, manager on) report.
"""

from __future__ import annotations

import pytest

from kv_offload.testing.kv_capacity import (
    GEMMA3_27B_LIKE,
    engine_against_plan,
    geometry_of,
    off_and_on,
    plan_capacity,
)
from kv_offload.testing.tiny_model import make_tiny_hybrid_model

pytest.importorskip("vllm")

MAX_MODEL_LEN, BATCHED, KV_BYTES = 8192, 512, 64 * 2**20


@pytest.fixture(scope="module")
def model() -> str:
    return str(make_tiny_hybrid_model())


def test_the_geometry_of_a_model_directory_is_its_config(model):
    geometry = geometry_of(model)  # make_tiny_hybrid_model(): S F S F, window 64
    assert geometry.layer_types == ("sliding_attention", "full_attention") * 2
    assert (geometry.sliding_window, geometry.num_kv_heads, geometry.head_dim,
            geometry.dtype) == (64, 2, 64, "float32")


def test_the_manager_off_promotes_sliding_layers_to_full_attention(model):
    both = off_and_on(geometry_of(model), model, kv_cache_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN,
                      max_num_batched_tokens=BATCHED, lengths=[1024, MAX_MODEL_LEN],
                      block_size=32, kv_cache_layout="LBHNC")
    off, on = both["off"], both["on"]
    assert off["groups"] == ("full(64) x4",)  # every layer keeps the whole context
    assert sorted(on["groups"]) == ["full x2", "sliding_window(64) x2"]
    # same memory, half the layers keep the whole context: more requests fit
    assert both["ratio"] > 1.5
    assert on["concurrency_at"][MAX_MODEL_LEN] == on["max_concurrency"]
    assert on["kv_cache_size_tokens"] > off["kv_cache_size_tokens"]
    # a shorter request fits more often, in both
    assert off["concurrency_at"][1024] > off["concurrency_at"][MAX_MODEL_LEN]


def test_a_gemma3_like_geometry_has_one_group_per_kind_and_window(model):
    on = plan_capacity(GEMMA3_27B_LIKE, hybrid_manager=True,
                       kv_cache_bytes=64 * 2**30, max_model_len=32768,
                       max_num_batched_tokens=8192, lengths=[32768])
    sliding = [int(g.rsplit("x", 1)[1]) for g in on.groups if g.startswith("sliding_window(1024)")]
    assert sum(sliding) >= 52 and len(sliding) > 1  # padded to groups of equal size
    assert [g for g in on.groups if g.startswith("full")] == ["full x10"]


@pytest.mark.engine
@pytest.mark.parametrize("on", [False, True], ids=["manager-off", "manager-on"])
def test_a_started_engine_reports_the_computed_plan(model, on, tmp_path):
    """With kv-offload configured and vLLM left to decide (manager on), or told to turn
    the manager off, the engine's blocks, tokens and groups are what plan_capacity says."""
    engine = {"max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": BATCHED,
              "kv_cache_memory_bytes": KV_BYTES}
    if not on:
        engine["disable_hybrid_kv_cache_manager"] = True
    row = engine_against_plan(model, engine=engine, log_path=tmp_path / "engine.log",
                              lengths=[1024])
    got, want = row["engine"], row["computed"]
    assert got["hybrid_manager"] is on and not row["turned_off_logged"]
    assert want["hybrid_manager"] is on and got["block_size"] == 32
    assert sorted(got["groups"]) == sorted(want["groups"])
    assert got["num_blocks"] == want["num_blocks"]
    assert got["kv_cache_size_tokens"] == want["kv_cache_size_tokens"]
    assert got["max_concurrency"] == pytest.approx(want["max_concurrency"])
