"""Invariant 8 on a real engine: ``--prefix-caching-hash-algo xxhash`` without
PYTHONHASHSEED gives block hashes that change on every restart, so the disk tier could
never hit. The connector must say so once, with the fix, turn the disk tier off (no slab
written, nothing created in the store directory) and keep the CPU tier working.

The same engine runs with ``"kv_load_failure_policy": "fail"`` (vLLM's default, which
fails a request on a bad chunk instead of recomputing it): a start-up warning must say
how to fix the --kv-transfer-config. The seeded case (disk tier on, hits across a
restart) is in test_engine_faults.py.
"""

from __future__ import annotations

import pytest
from engine_phases import run_phases
from reliability_support import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.engine

WARNING = "without PYTHONHASHSEED"


@pytest.fixture(scope="module")
def unseeded(unseeded_engine, reference) -> dict:
    """The engine of conftest.unseeded_engine: xxhash, no PYTHONHASHSEED, disk_path set,
    kv_load_failure_policy "fail"; phases "cold" and "cpu" (vLLM's cache reset)."""
    engine, store = unseeded_engine
    phases = [{"name": "cold", "prompts": PROMPTS["convoy"], "max_tokens": MAX_TOKENS},
              {"name": "cpu", "prompts": PROMPTS["convoy"], "max_tokens": MAX_TOKENS,
               "reset": "prefix"}]
    out = run_phases(engine, phases)
    out["store"] = store
    return out


def test_disk_tier_is_off_and_writes_nothing(unseeded, reference):
    cold, cpu = unseeded["phases"]
    assert not cold["connector"]["persistent"] and cold["connector"]["disk"] is None
    assert not unseeded["store"].exists() or not any(unseeded["store"].rglob("*")), \
        "the store directory was written to"
    assert cold["tokens"] == cpu["tokens"] == reference.tokens(PROMPTS["convoy"])
    assert cpu["metrics"]["hits_host"] >= 320, "the CPU tier must still serve"


def test_warning_names_the_fix(unseeded):
    lines = [x for x in unseeded["log"].splitlines() if WARNING in x]
    assert lines, "no warning about the unseeded hash"
    assert "PYTHONHASHSEED" in lines[0] and "sha256" in lines[0] and "OFF" in lines[0]


def test_warning_is_logged_once(unseeded):
    """One line for the whole engine, not one per connector instance (scheduler side
    and each worker): an in-process engine holds both in one log."""
    assert sum(WARNING in x for x in unseeded["log"].splitlines()) == 1


def test_fail_policy_warns_with_the_fix(unseeded):
    line = next(x for x in unseeded["log"].splitlines() if "kv_load_failure_policy is" in x)
    assert "'fail'" in line and '"kv_load_failure_policy": "recompute"' in line


def test_start_up_line_tells_the_operator_the_disk_tier_is_off(unseeded):
    line = next((x for x in unseeded["log"].splitlines() if "kv-offload scheduler: chunk" in x),
                "")
    assert "disk tier off" in line and "INFO" in line
