"""What the engine benchmarks add to ``kv_offload.testing.engine``: fair turns between
engines measured side by side and one thread layout for all of them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from kv_offload.testing.engine import IN_PROCESS_ENV, EngineProcess, start_engines

# The TTFT benchmarks' default model: the test model's geometry with room for 16k positions.
TTFT_MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  max_position=16384)

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
    env = {} if vllm_default_binding else dict(SAME_BINDING_ENV)
    if in_process:
        env.update(IN_PROCESS_ENV)
    return env


@contextlib.contextmanager
def running(engines: list[EngineProcess]) -> Iterator[list[EngineProcess]]:
    """``engines`` (spawned together) once all are ready; all closed on exit."""
    try:
        yield start_engines(engines)
    finally:
        for engine in engines:
            engine.close()
