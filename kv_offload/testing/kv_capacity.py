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
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kv_offload.testing.tiny_model import hybrid_layer_types, make_tiny_hybrid_model


@dataclass(frozen=True, slots=True)
class Geometry:
    """The KV-relevant shape of a model: its attention layers, heads and dtype."""

    name: str
    layer_types: tuple[str, ...]  # "sliding_attention" or "full_attention", per layer
    sliding_window: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"


# Computed rows of docs/benchmarks.md: public configurations, rounded to their KV shape.
GEMMA3_27B_LIKE = Geometry("Gemma-3-27B-like", tuple(hybrid_layer_types(62, 6)),
                           sliding_window=1024, num_kv_heads=16, head_dim=128)
GPT_OSS_120B_LIKE = Geometry("gpt-oss-120b-like", tuple(hybrid_layer_types(36, 2)),
                             sliding_window=128, num_kv_heads=8, head_dim=64)


def geometry_of(model: str | Path) -> Geometry:
    """The Geometry in a Gemma-3-style model directory's config.json (e.g. one made by
    ``tiny_model.make_tiny_hybrid_model``)."""
    c = json.loads((Path(model) / "config.json").read_text())
    return Geometry(Path(model).name, tuple(c["layer_types"]), c["sliding_window"],
                    c["num_key_value_heads"], c["head_dim"], c["torch_dtype"])


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
            for i, kind in enumerate(geometry.layer_types)}


def engine_config(model: str, *, hybrid_manager: bool, max_model_len: int,
                  max_num_batched_tokens: int, block_size: int) -> Any:
    """vLLM's config of an engine on ``model`` (a directory; its weights are not read)."""
    from vllm.engine.arg_utils import EngineArgs

    from kv_offload.testing.vllm_compat import create_engine_config

    return create_engine_config(EngineArgs(
        model=model, max_model_len=max_model_len, block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens, enforce_eager=True,
        disable_hybrid_kv_cache_manager=not hybrid_manager))


def plan_capacity(geometry: Geometry, model: str | None = None, *, hybrid_manager: bool,
                  kv_cache_bytes: int, max_model_len: int, max_num_batched_tokens: int,
                  lengths: list[int], block_size: int = 16,
                  kv_cache_layout: str = "LBNHC") -> Capacity:
    """vLLM's KV cache plan for ``geometry`` in ``kv_cache_bytes`` of device memory, and
    how many requests of each of ``lengths`` tokens it admits (vLLM's figure: a
    sliding-window group reserves window + max_num_batched_tokens per request).
    ``model`` is a model directory whose config allows ``max_model_len`` (None: a tiny
    one made for it; no weights are read);
    ``kv_cache_layout`` is the one the engine's attention backend resolves (FlashAttention:
    LBNHC; vLLM's CPU backend: LBHNC)."""
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
        get_max_concurrency_for_kv_cache_config,
    )

    model = model or str(make_tiny_hybrid_model(max_position=max_model_len))
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


def off_and_on(geometry: Geometry, model: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """``plan_capacity`` with the manager off and on (same ``kwargs``), as dicts, and
    ``ratio``: requests of max_model_len that fit with it on over off."""
    off, on = (asdict(plan_capacity(geometry, model, hybrid_manager=hybrid, **kwargs))
               for hybrid in (False, True))
    return {"off": off, "on": on, "ratio": on["max_concurrency"] / off["max_concurrency"]}


def engine_against_plan(model: str | Path, *, engine: dict[str, Any], log_path: Path,
                        lengths: list[int]) -> dict[str, Any]:
    """Start an in-process kv-offload engine on ``model`` (a Gemma-3-style directory) with
    the LLM kwargs ``engine``; returns what it reports (``engine``: snapshot's kv_cache),
    whether vLLM logged turning its hybrid manager off, and (``computed``)
    ``plan_capacity`` of its geometry for the same settings and vLLM's CPU layout."""
    from kv_offload.testing.engine import EngineProcess, offload_transfer

    with EngineProcess(model, log_path=log_path, engine=engine, in_process=True,
                       transfer=offload_transfer({"cpu_size": "64MiB"})) as eng:
        got, log, kv_bytes = eng.snapshot()["kv_cache"], eng.log(), eng.engine[
            "kv_cache_memory_bytes"]
    want = plan_capacity(geometry_of(model), str(model), hybrid_manager=got["hybrid_manager"],
                         kv_cache_bytes=kv_bytes, max_model_len=got["max_model_len"],
                         max_num_batched_tokens=got["max_num_batched_tokens"],
                         lengths=lengths, block_size=got["block_size"], kv_cache_layout="LBHNC")
    return {"engine": got, "turned_off_logged": "Turning off hybrid kv cache manager" in log,
            "computed": asdict(want)}


def describe_groups(kv_cache_config: Any) -> tuple[str, ...]:
    """'<kind>[(window)] x<layers>' per KV cache group of a vLLM ``KVCacheConfig``."""
    out = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = "sliding_window" if type(spec).__name__ == "SlidingWindowSpec" else "full"
        out.append(f"{kind}{f'({window})' if window else ''} x{len(group.layer_names)}")
    return tuple(out)
