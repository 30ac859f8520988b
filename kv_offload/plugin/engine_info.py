"""What kv-offload reads from vLLM's configs: the KVLayout of an engine.

One of the few modules that import vLLM; everything downstream receives plain values.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from kv_offload.config import OffloadConfig
from kv_offload.groups import KVGroup
from kv_offload.layout import KVLayout, page_order

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.kv_cache_layout import KVCacheLayout

SPEC_METHODS_WITHOUT_DRAFT_KV = frozenset({"ngram", "ngram_gpu", "suffix"})
"""Speculative decoding methods that propose tokens without a draft model, so the only KV
is the target model's (the one kv-offload stores)."""


SPEC_KINDS = {"FullAttentionSpec": "full_attention", "MLAAttentionSpec": "mla_attention",
              "SlidingWindowSpec": "sliding_window", "SlidingWindowMLASpec": "sliding_window"}
"""vLLM KV cache specs kv-offload stores, by exact class name, and their ``KVGroup`` kind."""


class UnsupportedEngineError(ValueError):
    """The engine's KV cache cannot be offloaded by kv-offload (raised at start-up)."""


def layout_from_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig) -> KVLayout:
    """Derive this engine's per-rank ``KVLayout``; UnsupportedEngineError explains refusals."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise UnsupportedEngineError("kv-offload: this model keeps no KV cache (attention-"
                                     "free); remove the --kv-transfer-config for it.")
    kinds = [group_kind(g.kv_cache_spec) for g in groups]
    spec = groups[0].kv_cache_spec
    if getattr(spec, "non_causal", False):
        raise UnsupportedEngineError(
            "kv-offload cannot serve a prefix-LM (non-causal) model: the KV of its prompt "
            "tokens depends on the whole prompt, so a prefix's KV stored for one prompt is "
            "wrong for another (vLLM turns its own prefix caching off for such models). "
            "Remove the --kv-transfer-config for this model.")
    _refuse_unsupported_features(vllm_config)
    if "mamba" in kinds:
        refuse_mamba_hybrids(vllm_config)
    # Mamba alone makes vLLM zero attention blocks: safe on V1's hook order (docs/
    # architecture.md, "Mamba state entries"), and refuse_mamba_hybrids covers V2.
    mamba_only = "mamba" in kinds and not getattr(kv_cache_config,
                                                  "has_mixed_precision_kv_cache", True)
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False) and not mamba_only:
        raise UnsupportedEngineError(
            "kv-offload cannot serve a KV cache whose new blocks vLLM zeroes (mamba layers "
            "or KV cache groups of mixed precisions): Model Runner V2 zeroes a reused block "
            "before the connector can order it after a store copy still reading it, which "
            "would store zeros. Remove the --kv-transfer-config for this model (README, "
            "Limits).")
    hybrid = len(groups) > 1 or kinds[0] in ("sliding_window", "mamba")
    if hybrid:
        _check_groups_share_pages(vllm_config, kv_cache_config)
    parallel = vllm_config.parallel_config
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
        attention="mla_attention" if "mla" in type(spec).__name__.lower() else "full_attention",
        num_layers=len(layer_names(kv_cache_config)),
        page_bytes=int(spec.page_size_bytes),
        block_size=int(spec.block_size),
        tokens_per_hash=int(tokens_per_hash),
        chunk_tokens=config.resolve_chunk_tokens(int(spec.block_size),
                                                 max_model_len=int(model_config.max_model_len)),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        hash_algo=str(cache_config.prefix_caching_hash_algo),
        salt=config.namespace_salt,
        page_order=_expected_page_order(vllm_config, kv_cache_config, spec),
        kernel_format=_kernel_format(vllm_config, spec),
        groups=tuple(KVGroup(kind, len(g.layer_names), int(g.kv_cache_spec.block_size),
                             int(getattr(g.kv_cache_spec, "sliding_window", 0) or 0)
                             if kind == "sliding_window" else 0,
                             mamba_state_layout(g.kv_cache_spec) if kind == "mamba" else "")
                     for kind, g in zip(kinds, groups)) if hybrid else (),
    )


def refuse_mamba_hybrids(vllm_config: VllmConfig) -> None:
    """UnsupportedEngineError for every engine with a mamba group: kv-offload's state
    entries (docs/architecture.md, "Mamba state entries") are proven on vLLM's Scheduler
    only (``testing/scheduler_harness.py`` replaces this check to run them there)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        raise UnsupportedEngineError(
            "kv-offload does not serve mamba or linear-attention hybrids on vLLM's CPU "
            "backend: vLLM 0.32's CPU chunk scan ignores return_intermediate_states, so "
            "the CPU backend cannot run these layers with prefix caching (the 'align' "
            "mode whose state hand-offs kv-offload stores). Remove the "
            "--kv-transfer-config for this model (README, Limits).")
    raise UnsupportedEngineError(
        "kv-offload does not yet serve mamba or linear-attention hybrids on GPUs: their "
        "state entries are tested on vLLM's scheduler only, until benchmarks/gpu_check.sh "
        "covers them on a GPU (and vLLM's Model Runner V2 zeroes a reused block before "
        "the connector can fence a store copy still reading it). Remove the "
        "--kv-transfer-config for this model (README, Limits).")


def mamba_state_layout(spec: Any) -> str:
    """A mamba group's state as the namespace names it: vLLM's mamba backend, then each
    state tensor's shape and dtype in vLLM's order, e.g.
    ``MAMBA2:(3,256)bfloat16+(8,64,128)float32``."""
    mamba_type = getattr(spec, "mamba_type", "")
    shapes = tuple(tuple(int(n) for n in shape) for shape in spec.shapes)
    dtypes = tuple(str(d).removeprefix("torch.") for d in spec.dtypes)
    return f"{getattr(mamba_type, 'name', mamba_type)}:" + "+".join(
        f"({','.join(map(str, shape))}){dtype}" for shape, dtype in zip(shapes, dtypes))


def group_kind(spec: Any) -> str:
    """The ``KVGroup`` kind of a vLLM KV cache spec (by its exact class: subclasses such
    as sink or hidden-state caches hold other KV); UnsupportedEngineError for specs whose
    KV a stored prefix cannot restore."""
    name = type(spec).__name__
    kind = SPEC_KINDS.get(name)
    if kind == "sliding_window" and int(getattr(spec, "extra_retained_tokens", 0) or 0):
        raise UnsupportedEngineError(
            "kv-offload cannot serve sliding-window layers that keep extra tokens below "
            "the window (multi-token-prediction speculation); run without speculative "
            "decoding or without the connector.")
    if kind is not None:
        return kind
    if name == "MambaSpec" and getattr(spec, "mamba_cache_mode", None) == "align":
        return "mamba"  # its states at chunk ends; refused for now: refuse_mamba_hybrids
    if "Mamba" in name or "ShortConv" in name or "LinearAttention" in name:
        mode = getattr(spec, "mamba_cache_mode", None)
        raise UnsupportedEngineError(
            f"kv-offload does not serve models with mamba or linear-attention layers "
            f"({name}) outside vLLM's 'align' prefix-caching mode (this engine: "
            f"mamba_cache_mode={mode!r}): only there does vLLM hand a connector the "
            f"state at chunk boundaries, and mamba hybrids are refused in that mode too "
            f"for now. Remove the --kv-transfer-config for this model (README, Limits).")
    raise UnsupportedEngineError(
        f"kv-offload stores full-attention, MLA and sliding-window KV caches; this model "
        f"has a {name} KV cache group (chunked-local, encoder, cross-attention, sink "
        f"and state caches cannot be restored from a stored prefix). Remove the "
        f"--kv-transfer-config for this model (docs/bad-input.md).")


def _check_groups_share_pages(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """UnsupportedEngineError unless every group's blocks have one page size, byte order
    and kernel format: a slot position of any group is then one page of every KV tensor
    (vLLM lays the groups over the same tensors, from byte 0)."""
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    first = specs[0]
    for spec in specs[1:]:
        same = (int(spec.page_size_bytes) == int(first.page_size_bytes)
                and int(spec.block_size) == int(first.block_size))
        if same and type(spec).__name__ != "MambaSpec":  # a state's layout: its KVGroup
            same = (_expected_page_order(vllm_config, kv_cache_config, spec)
                    == _expected_page_order(vllm_config, kv_cache_config, first)
                    and _kernel_format(vllm_config, spec) == _kernel_format(vllm_config, first))
        if not same:
            raise UnsupportedEngineError(
                f"kv-offload serves hybrid models whose KV cache groups share one block "
                f"size and page layout; this one mixes {type(first).__name__} "
                f"({first.block_size} tokens, {first.page_size_bytes} bytes a page) with "
                f"{type(spec).__name__} ({spec.block_size} tokens, {spec.page_size_bytes} "
                f"bytes). Remove the --kv-transfer-config for this model (README, Limits).")


def _kernel_format(vllm_config: VllmConfig, spec: Any) -> str:
    """What else decides the bytes inside a block besides ``page_order``: the platform,
    the attention backend chosen in the config, the platform's fp8 type for an fp8 KV
    cache, and on the CPU backend the instruction set its kernels pack K and V for (AMX
    and AVX-512 hosts lay out the same block differently; vLLM picks it per host)."""
    from vllm.platforms import current_platform

    parts = [str(getattr(current_platform, "device_type", "") or "unknown")]
    attention_config = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention_config, "backend", None)
    if backend is not None:
        parts.append(f"backend={getattr(backend, 'name', backend)}")
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype.startswith("fp8"):
        with contextlib.suppress(Exception):
            parts.append(f"fp8={current_platform.fp8_dtype()}".replace("torch.", ""))
    if current_platform.is_cpu():
        parts.append(f"isa={_cpu_attention_isa(spec, cache_dtype)}")
    return ",".join(parts)


def _cpu_attention_isa(spec: Any, cache_dtype: str) -> str:
    """The instruction set vLLM's CPU attention packs this engine's blocks for."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(spec.dtype, int(spec.block_size), int(spec.head_size),
                                 cache_dtype))
    except Exception as exc:  # a vLLM that moved it: refuse rather than share blindly
        raise UnsupportedEngineError(
            f"kv-offload cannot tell how this vLLM's CPU attention packs a KV block ({exc}); "
            "chunks could be loaded into a host that packs them differently. Use the vLLM "
            "version kv-offload supports or run without the connector.") from exc


def _refuse_unsupported_features(vllm_config: VllmConfig) -> None:
    """UnsupportedEngineError for vLLM features under which stored KV could be wrong."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise UnsupportedEngineError(
            "kv-offload does not support pipeline parallelism yet; use tensor parallelism "
            "(--tensor-parallel-size) or run without the connector."
        )
    for option, flag in (("decode_context_parallel_size", "--decode-context-parallel-size"),
                         ("prefill_context_parallel_size", "--prefill-context-parallel-size")):
        size = int(getattr(parallel, option, 1) or 1)
        if size > 1:
            raise UnsupportedEngineError(
                f"kv-offload does not support context parallelism ({option}={size}): each "
                f"rank then holds an interleaved part of a block's tokens, which kv-offload "
                f"would store as whole blocks. Remove {flag} or run without the connector.")
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "enable_sleep_mode", False):
        raise UnsupportedEngineError(
            "kv-offload does not support sleep mode (--enable-sleep-mode): sleeping releases "
            "the KV cache memory that kv-offload's copy threads read and write, without "
            "telling the connector on vLLM 0.32; the pause vLLM 0.33+ announces "
            "(unregister_kv_caches) is not yet tested with sleep mode on a GPU. Remove "
            "--enable-sleep-mode or run without the connector.")
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None) if spec is not None else None
    if method is not None and method not in SPEC_METHODS_WITHOUT_DRAFT_KV:
        raise UnsupportedEngineError(
            f"kv-offload does not support speculative decoding with method {method!r}: its "
            f"draft layers keep KV of their own, which kv-offload neither stores nor "
            f"restores. Use a draft-free method ({', '.join(sorted(SPEC_METHODS_WITHOUT_DRAFT_KV))}) "
            f"or run without the connector.")


def resolved_kv_cache_layout(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig
                             ) -> KVCacheLayout:
    """vLLM's physical KV cache layout (a ``KVCacheLayout``) for this engine, as the engine
    core resolved it; UnsupportedEngineError when it was not resolved."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None:
        name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    if name is None:
        raise UnsupportedEngineError(
            "kv-offload: vLLM has not resolved its physical KV cache layout "
            "(kv_cache_config.kv_cache_layout and cache_config.kv_cache_layout are unset), "
            "so the byte order of stored blocks is unknown. This happens only outside a "
            "running engine: set cache_config.kv_cache_layout (e.g. 'LBHNC').")
    try:
        return KVCacheLayout[str(name)]
    except KeyError:
        raise UnsupportedEngineError(
            f"kv-offload does not know vLLM's KV cache layout {name!r} (known: "
            f"{', '.join(m.name for m in KVCacheLayout)}); run a vLLM version kv-offload "
            f"supports (see the README) or without the connector.") from None


def _expected_page_order(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, spec: Any) -> str:
    """The page order (``kv_offload.layout.page_order``) of this engine's blocks, from the
    resolved layout and the KV cache spec; kernel-block splitting, which only the worker
    sees, is checked there against it."""
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    layout = resolved_kv_cache_layout(vllm_config, kv_cache_config)
    order = [("B", "H", "N", "C")[axis] for axis in layout.layer_view_order]
    if order[0] != "B":
        raise UnsupportedEngineError(
            f"kv-offload cannot store KV cache layout {layout.name}: the bytes of one block "
            f"of a layer are not contiguous there ({'/'.join(order)} in memory). Set "
            f"VLLM_KV_CACHE_LAYOUT to a layout whose blocks are contiguous per layer (LBHNC, "
            f"LBNHC, BLHNC or BLNHC) that your attention backend supports, or run without "
            f"the connector.")
    _, heads, tokens, content = compute_layer_kv_cache_shape_bytes(spec, 1)
    sizes = {"H": heads, "N": tokens, "C": content}
    return page_order([(dim, sizes[dim]) for dim in order[1:]])


def layer_names(kv_cache_config: KVCacheConfig) -> list[str]:
    """The layers whose KV tensors are offloaded, in a stable order: one per KV tensor.

    vLLM lays every KV cache group over the same tensors from byte 0 (the l-th layer of
    each group is a view of the l-th tensor; a block id belongs to one group at a time),
    so the l-th layer of the first group that has one names tensor l."""
    groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
    return [next(names[i] for names in groups if i < len(names))
            for i in range(max(map(len, groups), default=0))]


def aliased_layers(kv_cache_config: KVCacheConfig) -> list[list[str]]:
    """Per KV tensor of ``layer_names``, every layer that must be a view of it."""
    groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
    return [[names[i] for names in groups if i < len(names)]
            for i in range(max(map(len, groups), default=0))]


def _model_fingerprint(model_config: Any) -> str:
    hf_config: Any = getattr(model_config, "hf_config", None)  # None fails below
    try:
        # Not ``_name_or_path``: it is the --model string as typed, and ./m, /abs/m and a
        # symlink to m are one model (``KVLayout.model`` names a directory by its realpath).
        fields = json.loads(hf_config.to_json_string(use_diff=False))
        fields.pop("_name_or_path", None)
        text = json.dumps(fields, sort_keys=True)
    except Exception:
        text = json.dumps(str(hf_config))
    parts = [text, str(getattr(model_config, "revision", None) or ""),
             str(getattr(model_config, "quantization", None) or "")]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]
