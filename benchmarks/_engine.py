"""What the engine benchmarks add to ``kv_offload.testing.engine``: the TTFT models and
prompt shape, fair turns between engines side by side, one thread layout for all of them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kv_offload.testing.engine import IN_PROCESS_ENV, EngineProcess, engine_kwargs, start_engines
from kv_offload.testing.tiny_model import BENCH_MODEL_KWARGS, make_prompt

# The TTFT benchmarks' default model: the test model's geometry with room for 16k positions.
TTFT_MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  max_position=16384)
MODELS = {  # bench_ttft --model; why the default is tiny: "Model" in templates/page.md
    "tiny": TTFT_MODEL, "bench": dict(BENCH_MODEL_KWARGS),
    "small": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64,
                  intermediate_size=1408, max_position=16384)}
SUFFIX_TOKENS = 16  # a TTFT prompt: a prefix, then this many tokens ("Prompt alignment", page.md)

SETTLE_S = 1.2  # vLLM's queue readers spin 1 s: "Engine switches" in templates/page.md


class Turns:
    """Hands the machine from one engine to the next: ``take(engine)`` waits SETTLE_S
    when the previous call went to another engine, so no engine is measured while an
    idle one still spins. Benchmarks therefore run blocks of requests per engine."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self.settle_s = settle_s
        self.num_switches = 0
        self._last: object | None = None

    def take(self, engine: object) -> None:
        if self._last is not None and self._last is not engine:
            time.sleep(self.settle_s)
            self.num_switches += 1
        self._last = engine


# One thread layout for every engine (connectors, not layouts): "Thread binding", page.md.
SAME_BINDING_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def benchmark_env(*, in_process: bool, vllm_default_binding: bool) -> dict[str, str]:
    """Environment of every engine of a benchmark (see SAME_BINDING_ENV)."""
    return {**({} if vllm_default_binding else SAME_BINDING_ENV),
            **(IN_PROCESS_ENV if in_process else {})}


@contextlib.contextmanager
def running(engines: list[EngineProcess]) -> Iterator[list[EngineProcess]]:
    """``engines`` (spawned together) once all are ready; all closed on exit."""
    try:
        yield start_engines(engines)
    finally:
        for engine in engines:
            engine.close()


def suffixed(length: int, seed: int, suffix_seed: int) -> str:
    """A prefix of ``length`` tokens, then SUFFIX_TOKENS (distinct seeds share nothing)."""
    return make_prompt(length, seed=seed) + make_prompt(SUFFIX_TOKENS, seed=suffix_seed)


def ttft_engine(lengths: list[int], *, in_process: bool, vllm_default_binding: bool = False
                ) -> tuple[dict, dict[str, str]]:
    """(engine kwargs, environment) of a TTFT benchmark's engines: room for the longest
    prompt, taken whole in one step (vLLM's ExampleConnector stores only the first scheduled
    part of a chunked prefill and then crashes its engine loading it: shape mismatch)."""
    max_len = max(4096, max(lengths) + SUFFIX_TOKENS + 64)
    return (engine_kwargs(max_model_len=max_len, in_process=in_process,
                          max_num_batched_tokens=max_len),
            benchmark_env(in_process=in_process, vllm_default_binding=vllm_default_binding))
