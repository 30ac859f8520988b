"""What kv-offload reads from vLLM's configs: the KVLayout of an engine.

One of the few modules that import vLLM; everything downstream receives plain values.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from kv_offload.config import OffloadConfig
from kv_offload.layout import KVLayout


class UnsupportedEngineError(ValueError):
    """The engine's KV cache cannot be offloaded by kv-offload (raised at start-up)."""


def layout_from_vllm(vllm_config: Any, kv_cache_config: Any, config: OffloadConfig) -> KVLayout:
    """Derive this engine's per-rank ``KVLayout``; UnsupportedEngineError explains refusals."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) != 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise UnsupportedEngineError(
            f"kv-offload supports models with one KV cache group (one attention type); "
            f"this model has {len(groups)} groups ({', '.join(kinds)}). Remove the "
            f"--kv-transfer-config for this model."
        )
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if kind not in ("FullAttentionSpec", "MLAAttentionSpec"):
        raise UnsupportedEngineError(
            f"kv-offload stores full-attention and MLA KV caches; this model uses {kind} "
            f"(sliding-window or state caches cannot be restored from a prefix)."
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedEngineError(
            "kv-offload does not support pipeline parallelism yet; use tensor parallelism "
            "(--tensor-parallel-size) or run without the connector."
        )
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    model = str(model_config.model)
    if os.path.isdir(model):  # ./m, /abs/m and a symlink to it are one model
        model = os.path.realpath(model)
    return KVLayout(
        model=model,
        model_fingerprint=_model_fingerprint(model_config),
        dtype=str(model_config.dtype).removeprefix("torch."),
        kv_cache_dtype=str(cache_config.cache_dtype),
        attention="mla_attention" if kind == "MLAAttentionSpec" else "full_attention",
        num_layers=len(groups[0].layer_names),
        page_bytes=int(spec.page_size_bytes),
        block_size=int(spec.block_size),
        tokens_per_hash=int(tokens_per_hash),
        chunk_tokens=config.resolve_chunk_tokens(int(spec.block_size)),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(cache_config.prefix_caching_hash_algo),
        salt=config.namespace_salt,
    )


def layer_names(kv_cache_config: Any) -> list[str]:
    """The layers whose KV is offloaded, in a stable order."""
    return list(kv_cache_config.kv_cache_groups[0].layer_names)


def _model_fingerprint(model_config: Any) -> str:
    hf_config = getattr(model_config, "hf_config", None)
    try:
        text = hf_config.to_json_string(use_diff=False)
    except Exception:
        text = json.dumps(str(hf_config))
    parts = [text, str(getattr(model_config, "revision", None) or ""),
             str(getattr(model_config, "quantization", None) or "")]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
