"""What the engine benchmarks add to ``kv_offload.testing.engine``: fair turns between
engines measured side by side, one thread layout for all of them, and the peer connector.

Each engine is an ``EngineProcess`` (a fresh process is what a restart looks like; two
alive at once can be interleaved request by request).
"""

from __future__ import annotations

import os
import time
from typing import Any

from kv_offload.testing.engine import IN_PROCESS_ENV

# The TTFT benchmarks' default model: the test model's geometry with room for 16k positions.
TTFT_MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  max_position=16384)

# After each message, the readers of vLLM's shared-memory queues (the engine core and its
# worker) busy-spin for 1 s before they sleep (SpinCondition.busy_loop_s). An engine used
# right after another one shares the cores with those spinners: measured here, that added
# ~0.4 s to every warm TTFT when requests alternated between engines one by one.
SETTLE_S = 1.2


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


def example_transfer_config(storage_dir: str | os.PathLike) -> dict[str, Any]:
    """vLLM's ExampleConnector (safetensors files per prompt and layer) as the peer."""
    return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}


# vLLM's CPU backend reserves one more core for the scheduler process when *any* KV
# connector is configured ("for nixl_connector under p/d case"). On a 2-core machine that
# leaves no core to reserve, so an engine with a connector runs 2 unbound OpenMP threads
# while one without runs 1 thread bound to core 0. Benchmarks pin every engine to the same
# policy (one reserved core, as vLLM does without a connector) so that they compare the
# connectors, not two thread layouts.
SAME_BINDING_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def benchmark_env(*, in_process: bool, vllm_default_binding: bool) -> dict[str, str]:
    """Environment of every engine of a benchmark (see SAME_BINDING_ENV)."""
    env = {} if vllm_default_binding else dict(SAME_BINDING_ENV)
    if in_process:
        env.update(IN_PROCESS_ENV)
    return env
