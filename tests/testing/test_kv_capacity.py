"""kv_capacity: vLLM's KV cache plan for a model geometry, with its hybrid KV cache manager
on or off, computed without an engine; and, started, the engine reports the same plan.

bench_hybrid prints computed rows for real geometries (Gemma-3-27B-like): the engine
test is what makes them trustworthy, so it compares the computed plan of the tiny
hybrid model with what two started engines (manager off, manager on) report.
"""

from __future__ import annotations

import pytest

from kv_offload.testing.engine import EngineProcess, offload_transfer
from kv_offload.testing.kv_capacity import GEMMA3_27B_LIKE, Geometry, plan_capacity
from kv_offload.testing.tiny_model import make_tiny_hybrid_model

pytest.importorskip("vllm")

TINY = Geometry("tiny hybrid", num_layers=4, sliding_window_pattern=2, sliding_window=64,
                num_kv_heads=2, head_dim=64, dtype="float32")  # make_tiny_hybrid_model()
MAX_MODEL_LEN, BATCHED, KV_BYTES = 8192, 512, 64 * 2**20


@pytest.fixture(scope="module")
def model() -> str:
    return str(make_tiny_hybrid_model())


def plan(model: str, geometry: Geometry = TINY, *, on: bool, **kw) -> object:
    return plan_capacity(geometry, model, hybrid_manager=on, **{
        "kv_cache_bytes": KV_BYTES, "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": BATCHED, "lengths": [1024, MAX_MODEL_LEN],
        "block_size": 32, "kv_cache_layout": "LBHNC", **kw})


def test_the_manager_off_promotes_sliding_layers_to_full_attention(model):
    off, on = plan(model, on=False), plan(model, on=True)
    assert off.groups == ("full(64) x4",)  # every layer keeps the whole context
    assert sorted(on.groups) == ["full x2", "sliding_window(64) x2"]
    # same memory, half the layers keep the whole context: more requests fit
    assert on.concurrency_at[MAX_MODEL_LEN] > 1.5 * off.concurrency_at[MAX_MODEL_LEN]
    assert on.kv_cache_size_tokens > off.kv_cache_size_tokens
    # a shorter request fits more often, in both
    assert off.concurrency_at[1024] > off.concurrency_at[MAX_MODEL_LEN]


def test_a_gemma3_like_geometry_has_one_group_per_kind_and_window(model):
    long_model = str(make_tiny_hybrid_model(max_position=32768 + 64))
    on = plan(long_model, GEMMA3_27B_LIKE, on=True, kv_cache_bytes=64 * 2**30,
              max_model_len=32768, lengths=[32768], block_size=16, kv_cache_layout="LBNHC")
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
    with EngineProcess(model, log_path=tmp_path / "engine.log", engine=engine,
                       transfer=offload_transfer({"cpu_size": "64MiB"}),
                       in_process=True) as eng:
        got = eng.snapshot()["kv_cache"]
        log = eng.log()
    want = plan(model, on=on)
    assert got["hybrid_manager"] is on
    assert ("Turning off hybrid kv cache manager" in log) is False
    assert sorted(got["groups"]) == sorted(want.groups)
    assert got["num_blocks"] == want.num_blocks
    assert got["kv_cache_size_tokens"] == want.kv_cache_size_tokens
    assert got["max_concurrency"] == pytest.approx(want.max_concurrency)
