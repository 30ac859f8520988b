"""The child side of ``EngineProcess``: one ``vllm.LLM`` serving JSON commands, one per line.

    python -m kv_offload.testing.engine_server '{"model": ..., "engine": {LLM kwargs},
                                                "transfer": {kv_transfer_config} | null}'

Commands (stdin) and answers (one JSON line each, ``{"ok": true, ...}`` or
``{"ok": false, "error": ...}``, in command order):

    {"op": "generate", "prompts": [str | {"prompt", "cache_salt"}], "max_tokens": 16,
     "one_by_one": false, "abort": {"after_steps": n, "indexes": [...]} | absent,
     "prompt_logprobs": n | absent}
        -> tokens, texts, seconds, latency_s (per request when one_by_one), ttft_s,
           cached_tokens (per request: vLLM's and the connector's hits),
           num_prompt_tokens, num_output_tokens, metrics and kv_offload (deltas of
           engine_state.metric_totals / kv_offload_samples over this call); with
           prompt_logprobs also prompt_logprobs: per request, the logprob of each prompt
           token after the first
    {"op": "drain", "timeout_s": 60}   step until the connector has no job (in-process)
    {"op": "reset", "connector": bool} reset_prefix_cache -> {"reset": vLLM's answer}
    {"op": "snapshot"}                 -> metrics, kv_offload (totals), connector (or null),
                                          kv_cache (engine_state.kv_cache_state)
    {"op": "kv_events_sent", "timeout_s": 60}
                                       -> {"sent": n}: vLLM's ZMQ KV event batches sent
                                          once none is queued (engine_state.kv_events_sent)
    {"op": "quit"}                     (an in-process engine drains first, as "drain")

The first answer, once the engine has started, is ``{"ok": true, "startup_s": ...}``.
vLLM logs to stdout, so stdout is moved to stderr (the parent's log file) before anything
is imported, and answers go to a private copy of the original stdout. Commands are read
by a thread from the start, so a parent may queue a whole workload while vLLM starts.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any

from kv_offload.testing import engine_state


def _generate_timed(llm: Any, prompts: list, params: Any, one_by_one: bool
                    ) -> tuple[list, list[float]]:
    if not one_by_one:
        return llm.generate(prompts, params, use_tqdm=False), []
    outputs, latencies = [], []
    for prompt in prompts:
        start = time.perf_counter()
        outputs.extend(llm.generate([prompt], params, use_tqdm=False))
        latencies.append(time.perf_counter() - start)
    return outputs, latencies


def _generate_with_abort(llm: Any, prompts: list, params: Any, abort: dict) -> list:
    """Add every prompt, step ``after_steps`` times, abort ``indexes``, finish the rest.
    Returns the outputs of the requests not aborted, in prompt order."""
    engine = llm.llm_engine
    ids = [f"abort-test-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}

    def step() -> None:
        done.update((out.request_id, out) for out in engine.step() if out.finished)

    for _ in range(abort["after_steps"]):
        step()
    doomed = [ids[i] for i in abort["indexes"]]
    engine.abort_request(doomed)
    while engine.has_unfinished_requests():
        step()
    return [done[rid] for rid in ids if rid not in doomed]


def generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=command.get("max_tokens", 16),
                            ignore_eos=True, prompt_logprobs=command.get("prompt_logprobs"))
    prompts = command["prompts"]
    before, ours_before = engine_state.metric_totals(llm), engine_state.kv_offload_samples()
    start = time.perf_counter()
    latencies: list[float] = []
    if command.get("abort"):
        outputs = _generate_with_abort(llm, prompts, params, command["abort"])
    else:
        outputs, latencies = _generate_timed(llm, prompts, params,
                                             bool(command.get("one_by_one")))
    seconds = time.perf_counter() - start
    after, ours_after = engine_state.metric_totals(llm), engine_state.kv_offload_samples()
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    extra = {} if params.prompt_logprobs is None else {
        "prompt_logprobs": [_prompt_token_logprobs(o) for o in outputs]}
    return {
        **extra,
        "tokens": tokens, "texts": [o.outputs[0].text for o in outputs],
        "seconds": seconds, "latency_s": latencies,
        "ttft_s": [o.metrics.first_token_latency for o in outputs
                   if getattr(o, "metrics", None) is not None],
        "cached_tokens": [o.num_cached_tokens or 0 for o in outputs],  # any cache's
        "num_output_tokens": sum(map(len, tokens)),
        "num_prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outputs),
        "metrics": {k: after[k] - before[k] for k in after},
        "kv_offload": {k: v - ours_before.get(k, 0.0) for k, v in ours_after.items()},
    }


def _prompt_token_logprobs(output: Any) -> list[float]:
    """The logprob vLLM gave each prompt token after the first (its ``prompt_logprobs``
    hold the prompt token's own entry besides the top ones)."""
    pairs = zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:])
    return [float(top[token].logprob) for token, top in pairs]


def handle(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    """Run one command (not quit); returns the answer's fields."""
    op = command.get("op")
    if op == "generate":
        return generate(llm, command)
    if op == "drain":
        engine_state.drain(llm, float(command.get("timeout_s", 60.0)))
        return {}
    if op == "reset":
        return {"reset": bool(llm.reset_prefix_cache(
            reset_connector=bool(command.get("connector"))))}
    if op == "snapshot":
        return {"metrics": engine_state.metric_totals(llm),
                "kv_offload": engine_state.kv_offload_samples(),
                "connector": engine_state.connector_state(llm),
                "kv_cache": engine_state.kv_cache_state(llm)}
    if op == "kv_events_sent":
        return {"sent": engine_state.kv_events_sent(llm, float(command.get("timeout_s", 60.0)))}
    raise ValueError(f"unknown op {op!r} (generate, drain, reset, snapshot, kv_events_sent, "
                     "quit)")


def serve(spec: dict[str, Any], commands: queue.Queue, reply: Any) -> None:
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    def send(obj: dict[str, Any]) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    kwargs = dict(spec["engine"])
    if spec.get("transfer"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec["transfer"])
    if kwargs.get("kv_events_config"):  # --kv-events-config, as a dict
        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    send({"ok": True, "startup_s": time.perf_counter() - t0})
    while (line := commands.get()) is not None:
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        try:
            send({"ok": True, **handle(llm, command)})
        except Exception as exc:  # report, keep serving: the parent decides
            traceback.print_exc()  # into the log, which the parent's error message ends with
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    _drain_before_quit(llm)
    del llm


def _drain_before_quit(llm: Any, timeout_s: float = 60.0) -> None:
    """Step an in-process engine until its connector's jobs in flight reported, as a
    served engine's own loop does while it lives: otherwise what the last requests
    stored (disk commits, remote tail records) is lost with the quit, and a host run
    before another in a test would keep less than a server that stays up."""
    try:
        engine_state.drain(llm, timeout_s)
    except engine_state.EngineStateError:
        pass  # multi-process: out of reach (its core steps on while the connector works)
    except Exception:  # into the log; quit anyway
        traceback.print_exc()


def _read_lines(stream: Any, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)
    out.put(None)  # the parent closed our stdin: quit


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    commands: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(sys.stdin, commands), daemon=True).start()
    serve(json.loads(sys.argv[1]), commands, reply)


if __name__ == "__main__":
    main()
