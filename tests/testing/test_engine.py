"""The engine driver itself (kv_offload.testing.engine): one in-process engine with the
CPU tier on, driven command by command; and an engine that cannot start.

The engine tests elsewhere (tests/e2e, tests/reliability, the benchmarks) rely on what is
checked here: answers come back in command order, a failed command is reported and the
engine keeps serving, commands queued during start-up are not lost, and a dead or
stopped engine leaves no process behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kv_offload.testing.engine import EngineError, EngineProcess, offload_transfer
from kv_offload.testing.tiny_model import make_prompt, make_tiny_model

pytestmark = pytest.mark.engine

PREFIX = make_prompt(256, seed=41)
PROMPTS = [PREFIX + make_prompt(20, seed=42), PREFIX + make_prompt(30, seed=43),
           make_prompt(200, seed=44)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Spawned with two commands already queued (answered after start-up, in order)."""
    proc = EngineProcess(make_tiny_model(), log_path=tmp_path_factory.mktemp("drv") / "log.txt",
                         transfer=offload_transfer({"cpu_size": "32MiB", "chunk_tokens": 64}),
                         in_process=True, timeout_s=600)
    proc.submit({"op": "generate", "prompts": PROMPTS, "max_tokens": 6})
    proc.submit({"op": "snapshot"})
    yield proc
    proc.close()


@pytest.fixture(scope="module")
def queued(engine) -> tuple[dict, dict]:
    return engine.answer(), engine.answer()


def test_commands_queued_during_start_up_are_answered_in_order(engine, queued):
    cold, snapshot = queued
    assert engine.startup_s > 0
    assert [len(t) for t in cold["tokens"]] == [6, 6, 6] and len(cold["texts"]) == 3
    assert cold["metrics"]["external_hits"] == 0
    assert snapshot["connector"]["cpu"]["ready"] + snapshot["connector"]["cpu"]["storing"] > 0


def test_reset_then_generate_loads_from_the_cpu_tier_with_equal_tokens(engine, queued):
    cold, _ = queued
    engine.drain()
    assert engine.reset() is True
    warm = engine.generate(PROMPTS, max_tokens=6, one_by_one=True)
    assert warm["tokens"] == cold["tokens"]
    # One by one: the first request loads the shared prefix, the second finds it in vLLM.
    assert warm["metrics"]["hits_host"] >= 256
    assert len(warm["latency_s"]) == 3 and all(t > 0 for t in warm["latency_s"])
    assert warm["kv_offload"]["kv_offload_hit_tokens_total{tier=cpu}"] >= 256


def test_a_failed_command_is_reported_and_the_engine_keeps_serving(engine, queued):
    with pytest.raises(EngineError, match="unknown op 'nope'"):
        engine.call({"op": "nope"})
    assert len(engine.generate(PROMPTS[:1], max_tokens=2)["tokens"]) == 1


def test_an_engine_without_kv_events_has_sent_none(engine, queued):
    """kv_events_sent, the barrier test_kv_events waits on, answers 0 with vLLM's null
    publisher (KV events off)."""
    assert engine.kv_events_sent(timeout_s=5) == 0


def test_abort_drops_the_aborted_requests_only(engine, queued):
    cold, _ = queued
    out = engine.generate(PROMPTS, max_tokens=6, abort={"after_steps": 1, "indexes": [1]})
    assert out["tokens"] == [cold["tokens"][0], cold["tokens"][2]]


def test_kill_leaves_no_process_of_the_group(tmp_path):
    proc = EngineProcess(make_tiny_model(), log_path=tmp_path / "log.txt", in_process=True)
    proc.kill()
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.proc.pid, 0)
    with pytest.raises(EngineError, match="died"):
        proc.wait_ready()


def test_an_engine_that_cannot_start_raises_with_its_log(tmp_path):
    proc = EngineProcess(tmp_path / "no-such-model", log_path=tmp_path / "log.txt",
                         in_process=True, timeout_s=300)
    with pytest.raises(EngineError, match="died") as info:
        proc.wait_ready()
    assert "no-such-model" in str(info.value)
    proc.close()


STUB_SERVER = '''
import json, sys
print("stub engine_server from", __file__, file=sys.stderr, flush=True)
print(json.dumps({"ok": True, "startup_s": 0.0}), flush=True)
for line in sys.stdin:
    if json.loads(line)["op"] == "quit":
        break
'''


def test_the_engine_process_imports_kv_offload_from_its_pythonpath(tmp_path, monkeypatch):
    """``--reference-tree`` measures another checkout: started from a repository root,
    the child must still import the checkout on its PYTHONPATH, not the one in its working
    directory (``python -m`` puts that first unless run with ``-P``)."""
    other = tmp_path / "other-checkout"
    (other / "kv_offload" / "testing").mkdir(parents=True)
    (other / "kv_offload" / "__init__.py").write_text("")
    (other / "kv_offload" / "testing" / "__init__.py").write_text("")
    (other / "kv_offload" / "testing" / "engine_server.py").write_text(STUB_SERVER)
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # this checkout's root
    with EngineProcess("unused", log_path=tmp_path / "log.txt", timeout_s=120,
                       env={"PYTHONPATH": str(other)}) as proc:
        pass
    assert f"stub engine_server from {other}" in proc.log()
