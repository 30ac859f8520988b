"""The vLLM types and calls the testing package uses, on every vLLM it runs on.

vLLM 0.34 changed some of them (issue 32 §5). This module is the one place that knows
the differences; it finds them by what the installed vLLM has (a dataclass field, a
module, a hook), never by its version number, so 0.33 and later releases land on the
right side without edits:

- ``ModelRunnerOutput`` lost ``req_id_to_index`` (``model_runner_output``).
- ``CachedRequestData`` lost ``resumed_req_ids`` and ``all_token_ids``: a request resumed
  after preemption arrives in ``scheduled_new_reqs``, re-sent in full, its tokens so far
  in ``NewRequestData.prefill_token_ids`` (``new_requests``, ``cached_requests``).
- ``Request`` holds its tokens in a ``TokenBuffer`` (an int32 ``array``, not a list) and
  takes precomputed ``block_hashes=``; its positional arguments and ``block_hasher=``
  are unchanged, so ``Request(...)`` calls stay as they are and token sequences are read
  with ``list(...)``.
- ``get_kv_cache_config_from_groups`` moved from ``vllm.v1.core.kv_cache_utils`` to
  ``vllm.v1.core.kv_cache_planning`` (``get_kv_cache_config_from_groups``).
- The V1 model runner (``vllm/v1/worker/gpu_model_runner.py``) is gone: V2, with its
  hook order, is the only one (``default_model_runner``); V2 calls ``finish_forward``
  right after the forward where the connector base class has it (``finish_forward``).
- The scheduler keeps requests in more collections (``async_kv_waiting``,
  ``deferred_loads``, ``_aborted_kv_loads``), and the block reservation of a parked
  asynchronous load moved from ``_inflight_prefills`` to ``_parked_reservations``
  (``scheduler_request_collections``, ``requests_with_reserved_blocks``).
- The CPU platform refuses x86 without triton-cpu while it checks a config
  (``create_engine_config``).
- ``--max-num-inflight-kv-loads`` lets loads start while the batch is full, for requests
  the connector's ``may_load_async`` answers yes to (``loads_while_batch_full``,
  ``set_max_num_inflight_kv_loads``).

Imports of vLLM happen inside the functions: importing this module imports no vLLM.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any
from unittest import mock

MODEL_RUNNERS = ("v1", "v2")  # vLLM's model runners, by the hook order they call


_RUNNER_MODULES = {"v1": "vllm.v1.worker.gpu_model_runner", "v2": "vllm.v1.worker.gpu.model_runner"}


def installed_model_runners() -> tuple[str, ...]:
    """The model runners the installed vLLM has: ("v1", "v2") on 0.32 and 0.33 (V1 on the
    CPU backend and CUDA without Triton, V2 on CUDA with Triton), ("v2",) on 0.34."""
    return tuple(r for r in MODEL_RUNNERS if importlib.util.find_spec(_RUNNER_MODULES[r]))


def default_model_runner() -> str:
    """The model runner the installed vLLM's CPU backend runs: "v1" while vLLM has it
    (0.32 and 0.33: ``CPUModelRunner`` subclasses it), else "v2" (0.34: the only one)."""
    return "v1" if "v1" in installed_model_runners() else "v2"


@dataclass(frozen=True, slots=True)
class NewRequest:
    """A request the worker has no state for: new, or (vLLM 0.34) resumed and re-sent."""

    req_id: str
    prompt: list[int]
    output: list[int]  # tokens it generated before (a resumed request on vLLM 0.34)
    block_ids: list[list[int]]  # one table per KV cache group
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class CachedRequest:
    """A request the worker has state for, in one step."""

    req_id: str
    num_computed_tokens: int
    num_output_tokens: int
    new_block_ids: tuple[list[int], ...] | None  # appended, or the tables when resumed
    resumed: bool  # vLLM 0.32-0.33: back from preemption; new_block_ids replace the tables
    all_token_ids: list[int] | None  # vLLM 0.32-0.33, resumed: its tokens, when vLLM sent them


def new_requests(scheduler_output: Any) -> list[NewRequest]:
    """``scheduled_new_reqs`` of a ``SchedulerOutput``, in order."""
    out = []
    for new in scheduler_output.scheduled_new_reqs:
        prompt = list(new.prompt_token_ids)
        tokens = getattr(new, "prefill_token_ids", None)  # vLLM 0.34: prompt + output
        output = list(tokens[len(prompt):]) if tokens is not None else []
        out.append(NewRequest(new.req_id, prompt, output, [list(t) for t in new.block_ids],
                              new.num_computed_tokens))
    return out


def cached_requests(scheduler_output: Any) -> list[CachedRequest]:
    """``scheduled_cached_reqs`` of a ``SchedulerOutput``, in order."""
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", ())  # gone in vLLM 0.34
    all_tokens = getattr(cached, "all_token_ids", {})
    return [CachedRequest(req_id, cached.num_computed_tokens[i], cached.num_output_tokens[i],
                          cached.new_block_ids[i], req_id in resumed,
                          list(all_tokens[req_id]) if req_id in all_tokens else None)
            for i, req_id in enumerate(cached.req_ids)]


def model_runner_output(req_ids: list[str], sampled_token_ids: list[list[int]],
                        kv_connector_output: Any = None) -> Any:
    """A ``ModelRunnerOutput`` of these requests (with ``req_id_to_index`` where vLLM still
    has the field: 0.32 and 0.33)."""
    from vllm.v1.outputs import ModelRunnerOutput

    extra: dict[str, Any] = {}
    if "req_id_to_index" in {f.name for f in fields(ModelRunnerOutput)}:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=sampled_token_ids,
                             kv_connector_output=kv_connector_output, **extra)


# vLLM scheduler attributes that hold requests (or their ids), empty once none is left;
# each vLLM has some of them (the last four: 0.34).
_REQUEST_COLLECTIONS = ("waiting", "kv_holding_waiting", "running", "deferred_waiting",
                        "_inflight_prefills", "finished_recving_kv_req_ids",
                        "failed_recving_kv_req_ids", "async_kv_waiting", "deferred_loads",
                        "_parked_reservations", "_aborted_kv_loads")


def scheduler_request_collections(scheduler: Any) -> dict[str, Any]:
    """The collections of requests of vLLM's ``scheduler`` that the installed vLLM has,
    by attribute name: every one is empty when no request is left (read-only)."""
    return {name: getattr(scheduler, name) for name in _REQUEST_COLLECTIONS
            if hasattr(scheduler, name)}


def requests_with_reserved_blocks(scheduler: Any) -> set[Any]:
    """The requests whose remaining blocks vLLM's ``scheduler`` holds back for an
    in-flight prefill or a parked asynchronous load (0.32: ``_inflight_prefills``; 0.34:
    also ``_parked_reservations``)."""
    return set(scheduler._inflight_prefills) | set(getattr(scheduler, "_parked_reservations", ()))


def finish_forward(connector: Any) -> None:
    """V2's ``finish_forward`` hook, right after the forward, where the installed vLLM's
    connector base class has it (0.32 on); nothing elsewhere."""
    hook = getattr(connector, "finish_forward", None)
    if hook is not None:
        hook()


def loads_while_batch_full() -> bool:
    """Whether the installed vLLM can start a connector's load while the batch is full
    (``KVConnectorBase_V1.may_load_async`` and ``--max-num-inflight-kv-loads``: 0.34)."""
    from vllm.config import SchedulerConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return (hasattr(KVConnectorBase_V1, "may_load_async")
            and "max_num_inflight_kv_loads" in {f.name for f in fields(SchedulerConfig)})


def set_max_num_inflight_kv_loads(scheduler_config: Any, limit: int) -> None:
    """Set ``--max-num-inflight-kv-loads`` on a scheduler config (before the scheduler is
    built); ValueError on a vLLM without it."""
    if not loads_while_batch_full():
        raise ValueError("this vLLM has no --max-num-inflight-kv-loads (vLLM 0.34 on); "
                         "leave max_num_inflight_kv_loads at None")
    scheduler_config.max_num_inflight_kv_loads = limit


def get_kv_cache_config_from_groups(vllm_config: Any, kv_cache_groups: Iterable[Any],
                                    available_memory: int) -> Any:
    """vLLM's ``get_kv_cache_config_from_groups``, from wherever the installed vLLM has it."""
    try:
        from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]
            get_kv_cache_config_from_groups as build,
        )
    except ImportError:  # vLLM 0.32-0.33
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups as build
    return build(vllm_config, list(kv_cache_groups), available_memory)


def create_engine_config(engine_args: Any) -> Any:
    """``engine_args.create_engine_config()`` for a config that no model runs on (the
    scheduler harness, scheduler-level tests).

    vLLM 0.34's CPU platform raises "vLLM on x86 CPUs requires Triton (triton-cpu)" while
    it checks a config (``CpuPlatform.check_and_update_config``), because its V2 runner's
    kernels need triton-cpu; the check changes nothing else. Nothing here runs a kernel,
    so on that refusal, and only then, the config is built again with the check told that
    Triton is there. Everywhere else the call is vLLM's, unchanged.
    """
    try:
        return engine_args.create_engine_config()
    except RuntimeError as e:
        if "requires Triton" not in str(e):
            raise
    import vllm.triton_utils as triton_utils

    with mock.patch.object(triton_utils, "HAS_TRITON", True):
        return engine_args.create_engine_config()
