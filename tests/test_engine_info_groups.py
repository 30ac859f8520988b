"""``layout_from_vllm`` on hybrid KV cache configs (vLLM's own spec classes, no engine).

The namespace must name the groups (a hybrid-on engine never shares chunks with the same
model's hybrid-off engine), keep single-group namespaces as they were, and refuse groups
whose blocks do not line up page for page.
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from kv_offload.config import OffloadConfig
from kv_offload.groups import KVGroup
from kv_offload.plugin.engine_info import (
    UnsupportedEngineError,
    aliased_layers,
    layer_names,
    layout_from_vllm,
)
from kv_offload.testing.scheduler_harness import build_vllm_config

BLOCK = 16


def _full(block: int = BLOCK, heads: int = 1) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=64,
                             dtype=torch.float32)


def _window(window: int, block: int = BLOCK) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block, num_kv_heads=1, head_size=64,
                             dtype=torch.float32, sliding_window=window)


def _layers(*indexes: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in indexes]


def _config(*groups: KVCacheGroupSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=list(groups))


@pytest.fixture(scope="module")
def vllm_config():
    return build_vllm_config(OffloadConfig(chunk_tokens=64), block_size=BLOCK,
                             max_num_batched_tokens=64, max_num_seqs=4)


def test_a_hybrid_engine_names_its_groups_and_sizes_a_chunk_by_them(vllm_config):
    config = _config(KVCacheGroupSpec(_layers(0, 2, 4), _window(40)),
                     KVCacheGroupSpec(_layers(1, 3), _full()))
    layout = layout_from_vllm(vllm_config, config, OffloadConfig(chunk_tokens=64))
    assert layout.groups == (KVGroup("sliding_window", 3, BLOCK, 40),
                             KVGroup("full_attention", 2, BLOCK))
    assert layout.num_layers == 3, "one per KV tensor: the groups overlay the same ones"
    assert layout.blocks_per_chunk == 3 + 4  # the window's tail, then the whole chunk
    assert layout.slot_bytes == 3 * layout.page_bytes * 7
    assert layer_names(config) == _layers(0, 2, 4)
    assert aliased_layers(config) == [_layers(0, 1), _layers(2, 3), _layers(4)]
    single = layout_from_vllm(vllm_config, _config(KVCacheGroupSpec(_layers(0, 1), _full())),
                              OffloadConfig(chunk_tokens=64))
    assert single.groups == () and "groups" not in single.descriptor()
    other_window = layout_from_vllm(vllm_config, _config(
        KVCacheGroupSpec(_layers(0, 2, 4), _window(48)),
        KVCacheGroupSpec(_layers(1, 3), _full())), OffloadConfig(chunk_tokens=64))
    assert len({layout.fingerprint(), single.fingerprint(), other_window.fingerprint()}) == 3


def test_a_model_with_only_sliding_window_layers_is_served(vllm_config):
    layout = layout_from_vllm(vllm_config, _config(KVCacheGroupSpec(_layers(0, 1), _window(20))),
                              OffloadConfig(chunk_tokens=64))
    assert layout.groups == (KVGroup("sliding_window", 2, BLOCK, 20),)
    assert layout.blocks_per_chunk == 2


@pytest.mark.parametrize("other", [_full(block=32), _full(heads=2)], ids=["block", "page"])
def test_groups_whose_blocks_differ_are_refused(vllm_config, other):
    config = _config(KVCacheGroupSpec(_layers(0), _window(40)), KVCacheGroupSpec(_layers(1), other))
    with pytest.raises(UnsupportedEngineError, match="share one block size and page layout"):
        layout_from_vllm(vllm_config, config, OffloadConfig(chunk_tokens=64))


def test_a_kv_cache_whose_new_blocks_vllm_zeroes_is_refused(vllm_config, monkeypatch):
    """Model Runner V2 zeroes new blocks in update_requests, before handle_preemptions
    can order the reuse after a store copy that still reads them (the step loop's
    ``runner="v2", zero_new_blocks=True`` shows the stored zeros)."""
    config = _config(KVCacheGroupSpec(_layers(0, 1), _full()))
    assert not config.needs_kv_cache_zeroing  # vLLM's property: mamba or mixed precisions
    monkeypatch.setattr(KVCacheConfig, "needs_kv_cache_zeroing", property(lambda self: True))
    with pytest.raises(UnsupportedEngineError, match="zeroes"):
        layout_from_vllm(vllm_config, config, OffloadConfig(chunk_tokens=64))


def _mamba(mode: str = "align", block: int = BLOCK):
    from vllm.v1.kv_cache_interface import MambaSpec

    page = _full(block).page_size_bytes  # vLLM pads the mamba page to the attention page
    return MambaSpec(block_size=block, shapes=((3, 32), (2, 8, 8)),
                     dtypes=(torch.bfloat16, torch.float32), page_size_padded=page,
                     mamba_cache_mode=mode)


def _mamba_hybrid(mode: str = "align") -> KVCacheConfig:
    return _config(KVCacheGroupSpec(_layers(0, 1), _full()),
                   KVCacheGroupSpec([f"model.layers.{i}.mixer" for i in (2, 3)], _mamba(mode)))


def test_a_mamba_hybrid_is_refused_on_the_cpu_backend_naming_vllms_limitation(vllm_config):
    """vLLM's CPU chunk scan ignores return_intermediate_states: no prefix caching for
    mamba layers there, so kv-offload refuses them, saying so (docs/bad-input.md)."""
    with pytest.raises(UnsupportedEngineError, match="CPU chunk scan ignores "
                       "return_intermediate_states"):
        layout_from_vllm(vllm_config, _mamba_hybrid(), OffloadConfig(chunk_tokens=64))


def test_a_mamba_hybrid_is_refused_on_gpus_until_gpu_check_covers_it(vllm_config,
                                                                      monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    with pytest.raises(UnsupportedEngineError, match="until benchmarks/gpu_check.sh covers"):
        layout_from_vllm(vllm_config, _mamba_hybrid(), OffloadConfig(chunk_tokens=64))


def test_mamba_outside_align_mode_is_refused_with_its_mode(vllm_config):
    with pytest.raises(UnsupportedEngineError, match="mamba_cache_mode='none'"):
        layout_from_vllm(vllm_config, _mamba_hybrid("none"), OffloadConfig(chunk_tokens=64))


def test_a_mamba_group_is_named_by_its_state_layout_where_accepted(vllm_config, monkeypatch):
    """What the scheduler harness runs (it replaces refuse_mamba_hybrids): the namespace
    names the mamba group by its state tensors, and vLLM's mamba zeroing alone is not a
    refusal of its own (docs/architecture.md, Mamba state entries)."""
    import kv_offload.plugin.engine_info as engine_info

    monkeypatch.setattr(engine_info, "refuse_mamba_hybrids", lambda config: None)
    config = _mamba_hybrid()
    assert config.needs_kv_cache_zeroing
    layout = layout_from_vllm(vllm_config, config, OffloadConfig(chunk_tokens=64))
    assert layout.groups == (KVGroup("full_attention", 2, BLOCK),
                             KVGroup("mamba", 2, BLOCK,
                                     state="MAMBA2:(3,32)bfloat16+(2,8,8)float32"))
    assert layout.chunk_map.positions == 64 // BLOCK + 1
