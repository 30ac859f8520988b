"""A chunk is only ever loaded into an engine whose block bytes mean the same thing.

vLLM 0.32 lays KV blocks out per attention backend (``KVCacheLayout``): heads outside
tokens (LBHNC, BLHNC: the CPU backend, FlashInfer) or tokens outside heads (LBNHC, BLNHC:
FlashAttention), and may split a block into kernel blocks. The KV tensors here are built
by vLLM's own allocator (``allocate_kv_cache``) on the CPU in each of those layouts, and
filled with the same logical KV, so the tests see the bytes a GPU engine would store.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_offload import OffloadConfig
from kv_offload.copy import make_copy_engine, planes_from_kv_tensor
from kv_offload.copy.host_buffer import allocate_host_slots
from kv_offload.layout import page_order
from kv_offload.plugin.engine_info import UnsupportedEngineError, layout_from_vllm
from kv_offload.plugin.worker_setup import check_page_order

BLOCK, HEADS, HEAD_DIM, LAYERS, BLOCKS = 16, 2, 64, 3, 32
LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")


@pytest.fixture(scope="module")
def engine_config():
    """A real vLLM config of the tiny model (no engine start); its layout is set per test."""
    from vllm.engine.arg_utils import EngineArgs

    from kv_offload.testing.tiny_model import make_tiny_model

    return EngineArgs(model=str(make_tiny_model()), block_size=BLOCK,
                      max_model_len=512).create_engine_config()


def build_engine(vllm_config, layout_name: str, kernel_block: int | None = None):
    """(kv_cache_config, {layer: tensor}) as vLLM builds them for ``layout_name``."""
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vllm_config.cache_config.kv_cache_layout = layout_name
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM,
                             dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(names, spec)], BLOCKS * LAYERS * spec.page_size_bytes)
    caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout_name],
                               [kernel_block] if kernel_block else None)
    return kv_cache_config, [caches[n] for n in names]


def logical_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[blocks, heads, tokens, content] whatever the kernel-block split."""
    split = t.shape[0] // num_blocks
    return t.unflatten(0, (num_blocks, split)).permute(0, 2, 1, 3, 4).flatten(2, 3)


def fill(tensors, num_blocks: int, seed: int) -> None:
    """Write the same logical KV into any layout: a function of (layer, block, head,
    token, channel) and ``seed``."""
    for layer, t in enumerate(tensors):
        view = logical_view(t, num_blocks)
        values = torch.arange(view.numel(), dtype=torch.float32).reshape(view.shape)
        view.copy_(values * 0.001 + layer + seed)


def store_chunk(tensors, num_blocks: int, layout, block_ids) -> bytes:
    """The slot bytes kv-offload stores for one chunk of ``block_ids``."""
    planes = [p for t in tensors for p in planes_from_kv_tensor(t, num_blocks, block_dim=0)]
    host = allocate_host_slots(2, layout.slot_bytes, pinned=False)
    engine = make_copy_engine(planes, host, len(block_ids))
    engine.wait(engine.store(np.array([block_ids]), np.array([0])))
    data = bytes(host.tensor[0].numpy())
    return data, engine, host


def test_layouts_with_other_bytes_get_other_namespaces(engine_config):
    """Regression: LBHNC, LBNHC and BLHNC configs of one model had one fingerprint."""
    prints = {}
    for name in LAYOUTS:
        kv_cache_config, _ = build_engine(engine_config, name)
        prints[name] = layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))
    assert prints["LBHNC"].page_order == f"H{HEADS}.N{BLOCK}.C{2 * HEAD_DIM * 4}"
    assert prints["LBNHC"].page_order == f"N{BLOCK}.H{HEADS}.C{2 * HEAD_DIM * 4}"
    assert prints["LBHNC"].fingerprint() != prints["LBNHC"].fingerprint()
    # Same order inside a layer's page: provably the same stored bytes (next test).
    assert prints["LBHNC"].fingerprint() == prints["BLHNC"].fingerprint()
    assert prints["LBNHC"].fingerprint() == prints["BLNHC"].fingerprint()


@pytest.mark.parametrize(("a", "b", "same"), [
    (("LBHNC", None), ("BLHNC", None), True),
    (("LBNHC", None), ("BLNHC", None), True),
    (("LBNHC", None), ("LBNHC", 8), True),  # tokens-outer: kernel blocks change nothing
    (("LBHNC", None), ("LBNHC", None), False),
    (("LBHNC", None), ("LBHNC", 8), False),  # heads-outer: kernel blocks reorder bytes
])
def test_stored_bytes_match_exactly_when_page_orders_match(engine_config, a, b, same):
    """Two engines share a namespace only if their stored chunks are byte-identical."""
    stored, orders = [], []
    for name, kernel in (a, b):
        kv_cache_config, tensors = build_engine(engine_config, name, kernel)
        layout = layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))
        nb = kv_cache_config.num_blocks
        fill(tensors, nb, seed=1)
        data, engine, _ = store_chunk(tensors, nb, layout, [5, 9])
        engine.close()
        stored.append(data)
        orders.append(planes_page_order(tensors, nb))
    assert (stored[0] == stored[1]) is same
    assert (orders[0] == orders[1]) is same


def planes_page_order(tensors, num_blocks):
    from kv_offload.copy.planes import page_order_of

    return {page_order_of(t, num_blocks) for t in tensors}


def test_a_chunk_moves_between_layouts_of_one_namespace(engine_config):
    """Stored from an LBHNC engine, loaded into a BLHNC engine: the same logical KV."""
    kv_a, src = build_engine(engine_config, "LBHNC")
    layout = layout_from_vllm(engine_config, kv_a, OffloadConfig(chunk_tokens=2 * BLOCK))
    nb = kv_a.num_blocks
    fill(src, nb, seed=3)
    _, engine_a, host = store_chunk(src, nb, layout, [2, 7])
    kv_b, dst = build_engine(engine_config, "BLHNC")
    fill(dst, nb, seed=0)
    planes = [p for t in dst for p in planes_from_kv_tensor(t, nb, block_dim=0)]
    engine_b = make_copy_engine(planes, host, 2)
    engine_b.wait(engine_b.load(np.array([0]), np.array([[11, 4]])))
    for s, d in zip(src, dst):
        assert torch.equal(logical_view(d, nb)[11], logical_view(s, nb)[2])
        assert torch.equal(logical_view(d, nb)[4], logical_view(s, nb)[7])
    engine_a.close()
    engine_b.close()


@pytest.mark.parametrize(("namespace_of", "tensors_of", "fix"), [
    (("LBHNC", None), ("LBNHC", None), "LBNHC"),
    (("LBHNC", None), ("LBHNC", 8), "--block-size"),
])
def test_worker_refuses_tensors_in_another_byte_order(engine_config, namespace_of, tensors_of,
                                                      fix):
    kv_cache_config, _ = build_engine(engine_config, *namespace_of)
    layout = layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))
    _, tensors = build_engine(engine_config, *tensors_of)
    with pytest.raises(UnsupportedEngineError, match="refuses to start") as info:
        check_page_order(tensors, layout, kv_cache_config.num_blocks)
    assert fix in str(info.value) and layout.page_order in str(info.value)


def test_worker_accepts_its_own_layout(engine_config):
    for name in LAYOUTS:
        kv_cache_config, tensors = build_engine(engine_config, name)
        layout = layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))
        check_page_order(tensors, layout, kv_cache_config.num_blocks)


def test_layout_whose_blocks_are_not_contiguous_is_refused(engine_config):
    kv_cache_config, _ = build_engine(engine_config, "LBHNC")
    engine_config.cache_config.kv_cache_layout = "LHBNC"
    kv_cache_config.kv_cache_layout = "LHBNC"
    with pytest.raises(UnsupportedEngineError, match="LHBNC.*not contiguous"):
        layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))


def test_page_order_names_equal_byte_positions_alike():
    assert page_order([("H", 1), ("N", 16), ("C", 64)]) == "N16.C64"  # MLA: one head
    assert page_order([("N", 16), ("H", 1), ("C", 64)]) == "N16.C64"
    assert page_order([("S", 4), ("N", 4), ("H", 8), ("C", 8)]) == "N16.H8.C8"
    assert page_order([("S", 4), ("H", 8), ("N", 4), ("C", 8)]) == "S4.H8.N4.C8"
    with pytest.raises(ValueError, match="bad page dim"):
        page_order([("X", 2)])


def test_namespaces_of_other_byte_orders_never_hit_in_one_store(engine_config, tmp_path):
    """Index level: one store directory shared by an LBHNC and an LBNHC engine."""
    from kv_offload.disk import DiskIndex

    indexes = {}
    for name in ("LBHNC", "LBNHC"):
        kv_cache_config, _ = build_engine(engine_config, name)
        layout = layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))
        indexes[name] = DiskIndex.open(
            str(tmp_path), namespace_id=layout.fingerprint(), descriptor=layout.descriptor(),
            slot_bytes=layout.slot_bytes, num_ranks=1, capacity_bytes=64 * layout.slot_bytes)
    key = b"k" * 32
    (slot,) = indexes["LBHNC"].allocate([key])
    indexes["LBHNC"].commit([(key, slot, (123,))])
    assert len(indexes["LBHNC"].find_prefix([key])) == 1
    assert indexes["LBNHC"].find_prefix([key]) == []
    for index in indexes.values():
        index.close()


def test_cpu_hosts_whose_attention_packs_blocks_differently_get_other_namespaces(
        engine_config, monkeypatch):
    """vLLM's CPU attention packs K and V into a block for the host's instruction set
    (AMX, AVX-512, NEON...): two hosts sharing a remote tier had one namespace for blocks
    of different bytes, and each would load the other's chunks as wrong KV."""
    from vllm.v1.attention.backends import cpu_attn

    kv_cache_config, _ = build_engine(engine_config, "LBHNC")
    config = OffloadConfig(chunk_tokens=2 * BLOCK)
    here = layout_from_vllm(engine_config, kv_cache_config, config)
    isa = cpu_attn._get_attn_isa(torch.float32, BLOCK, HEAD_DIM, "auto")
    assert f"isa={isa}" in here.kernel_format
    prints = set()
    for other in ("amx", "vec", "neon"):
        monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *args, isa=other: isa)
        prints.add(layout_from_vllm(engine_config, kv_cache_config, config).fingerprint())
    assert len(prints) == 3


def test_a_prefix_lm_model_is_refused(engine_config):
    """Its prompt tokens' KV depends on the whole prompt: a stored prefix would be wrong
    for any other prompt (vLLM turns its own prefix caching off for such models)."""
    import dataclasses

    kv_cache_config, _ = build_engine(engine_config, "LBHNC")
    group = kv_cache_config.kv_cache_groups[0]
    group.kv_cache_spec = dataclasses.replace(group.kv_cache_spec, non_causal=True)
    with pytest.raises(UnsupportedEngineError, match="non-causal"):
        layout_from_vllm(engine_config, kv_cache_config, OffloadConfig(chunk_tokens=2 * BLOCK))
