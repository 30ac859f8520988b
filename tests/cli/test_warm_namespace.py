"""One model, one namespace, however its directory is spelled.

`kv-offload warm --model ./m` must fill the namespace a server started with `/abs/m` (or
with a symlink to it) reads. Regression: the namespace's model fingerprint hashed vLLM's
HF config including `_name_or_path`, the --model string as typed, so `./link`, a symlink
to the model directory, named another namespace than the real path (and warm, matching
`str(model)`, could not find it at all). No engine starts here: real vLLM configs only.
"""

from __future__ import annotations

import pytest

from kv_offload.config import OffloadConfig

BLOCK = 16


def namespace_of(model: str) -> str:
    """The connector's namespace id for an engine of ``model`` (layout_from_vllm)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

    from kv_offload.plugin.engine_info import layout_from_vllm

    vllm_config = EngineArgs(model=model, block_size=BLOCK,
                             max_model_len=512).create_engine_config()
    vllm_config.cache_config.kv_cache_layout = "LBHNC"  # what the CPU backend resolves
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, [KVCacheGroupSpec(names, spec)], 64 * 2 * spec.page_size_bytes)
    return layout_from_vllm(vllm_config, kv_cache_config, OffloadConfig()).fingerprint()


def test_relative_and_symlinked_model_dirs_name_the_real_paths_namespace(tmp_path,
                                                                          monkeypatch):
    pytest.importorskip("vllm")
    from kv_offload.testing.tiny_model import make_tiny_model

    model = make_tiny_model()
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    monkeypatch.chdir(model.parent)
    relative = namespace_of(f"./{model.name}")
    monkeypatch.chdir(tmp_path)
    symlinked = namespace_of("./link")
    assert relative == symlinked == namespace_of(str(model))
