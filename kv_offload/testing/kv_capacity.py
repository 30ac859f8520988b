"""How many tokens vLLM's device KV cache holds for a model geometry, with its hybrid KV
cache manager on or off: vLLM's own spec classes and planner, no engine started.

With the manager off (what vLLM does for a connector without ``SupportsHMA``) every
sliding-window layer is promoted to full attention and keeps KV for the whole context;
with it on, each attention kind is a KV cache group and a sliding-window group holds
only its window (plus the tokens in flight). ``plan_capacity`` runs vLLM's
``get_kv_cache_configs`` on the layer specs of a ``Geometry`` and a KV memory budget,
and asks vLLM's ``get_max_concurrency_for_kv_cache_config`` how many requests of each
length fit. The tests check it against what a started engine reports.

Imports of vLLM happen inside the functions: importing this module imports no vLLM.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from kv_offload.testing.tiny_model import hybrid_layer_types


@dataclass(frozen=True, slots=True)
class Geometry:
    """The KV-relevant shape of a model: its attention layers, heads and dtype."""

    name: str
    num_layers: int
    sliding_window_pattern: int  # every Nth layer full attention (Gemma 3 rule), 1: all full
    sliding_window: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def layer_types(self) -> list[str]:
        return hybrid_layer_types(self.num_layers, self.sliding_window_pattern)


# Computed rows of docs/benchmarks.md: public configurations, rounded to their KV shape.
GEMMA3_27B_LIKE = Geometry("Gemma-3-27B-like", num_layers=62, sliding_window_pattern=6,
                           sliding_window=1024, num_kv_heads=16, head_dim=128)
GPT_OSS_120B_LIKE = Geometry("gpt-oss-120b-like", num_layers=36, sliding_window_pattern=2,
                             sliding_window=128, num_kv_heads=8, head_dim=64)


@dataclass(frozen=True, slots=True)
class Capacity:
    """vLLM's answer for one geometry, budget and manager setting."""

    hybrid_manager: bool
    num_blocks: int
    block_size: int
    groups: tuple[str, ...]  # e.g. "sliding_window(1024) x10", one per KV cache group
    kv_cache_size_tokens: int  # what vLLM logs as "KV cache size: N tokens"
    max_model_len: int
    max_concurrency: float  # requests of max_model_len tokens ("Maximum concurrency")
    concurrency_at: dict[int, float]  # prompt length -> requests of that length that fit


def layer_specs(geometry: Geometry, block_size: int) -> dict[str, Any]:
    """vLLM's KV cache spec of each attention layer of ``geometry``, as its attention
    layers would register them (full: FullAttentionSpec; sliding: SlidingWindowSpec)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    dtype = getattr(torch, geometry.dtype)
    common = dict(block_size=block_size, num_kv_heads=geometry.num_kv_heads,
                  head_size=geometry.head_dim, dtype=dtype)
    return {f"model.layers.{i}.self_attn.attn":
            SlidingWindowSpec(**common, sliding_window=geometry.sliding_window)
            if kind == "sliding_attention" else FullAttentionSpec(**common)
            for i, kind in enumerate(geometry.layer_types())}


def engine_config(model: str, *, hybrid_manager: bool, max_model_len: int,
                  max_num_batched_tokens: int, block_size: int) -> Any:
    """vLLM's config of an engine on ``model`` (a directory; its weights are not read)."""
    from vllm.engine.arg_utils import EngineArgs

    from kv_offload.testing.vllm_compat import create_engine_config

    return create_engine_config(EngineArgs(
        model=model, max_model_len=max_model_len, block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens, enforce_eager=True,
        disable_hybrid_kv_cache_manager=not hybrid_manager))


def plan_capacity(geometry: Geometry, model: str, *, hybrid_manager: bool,
                  kv_cache_bytes: int, max_model_len: int, max_num_batched_tokens: int,
                  lengths: list[int], block_size: int = 16,
                  kv_cache_layout: str = "LBNHC") -> Capacity:
    """vLLM's KV cache plan for ``geometry`` in ``kv_cache_bytes`` of device memory, and
    how many requests of each of ``lengths`` tokens it admits (vLLM's figure: a
    sliding-window group reserves window + max_num_batched_tokens per request).
    ``model`` is any model directory whose max_model_len allows ``max_model_len``;
    ``kv_cache_layout`` is the one the engine's attention backend resolves (FlashAttention:
    LBNHC; vLLM's CPU backend: LBHNC)."""
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    config = engine_config(model, hybrid_manager=hybrid_manager, max_model_len=max_model_len,
                           max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)
    config.cache_config.kv_cache_layout = kv_cache_layout  # resolved by the engine core
    specs = layer_specs(geometry, config.cache_config.block_size)
    kv_config = generate_scheduler_kv_cache_config(
        get_kv_cache_configs(config, [specs], [kv_cache_bytes]))
    tokens, concurrency = get_kv_cache_capacity(config, kv_config)
    at = {}
    for length in lengths:
        shorter = copy.deepcopy(config)
        shorter.model_config.max_model_len = length
        at[length] = get_max_concurrency_for_kv_cache_config(shorter, kv_config)
    return Capacity(hybrid_manager=hybrid_manager, num_blocks=kv_config.num_blocks,
                    block_size=config.cache_config.block_size,
                    groups=describe_groups(kv_config), kv_cache_size_tokens=tokens,
                    max_model_len=max_model_len, max_concurrency=concurrency,
                    concurrency_at=at)


def describe_groups(kv_cache_config: Any) -> tuple[str, ...]:
    """'<kind>[(window)] x<layers>' per KV cache group of a vLLM ``KVCacheConfig``."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = "sliding_window" if type(spec).__name__ == "SlidingWindowSpec" else "full"
        out.append(f"{kind}{f'({window})' if window else ''} x{len(group.layer_names)}")
    return tuple(out)
