"""``python -m kv_offload.testing.soak --quick``: 100 requests against the OpenAI server
with kv-offload.

Proves the soak harness works end to end (server start, Zipf workload, /metrics parsing,
leak checks) and that a short soak passes: no failed request, kv-offload served hits,
``kv_offload_pending_jobs`` back to 0, RSS and open files of the server within bounds.
The full run (2,000 requests) is a benchmark, not a test: see the module's docstring.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from reliability_support import REPO


def test_soak_help_starts_nothing():
    out = subprocess.run([sys.executable, "-m", "kv_offload.testing.soak", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and "--quick" in out.stdout and "--json" in out.stdout


@pytest.mark.engine
def test_quick_soak_passes(quick_soak):
    proc, result_path, log_path = quick_soak
    proc.wait(timeout=900)
    output = (result_path.parent / "soak.out").read_text()
    assert result_path.exists(), output[-3000:]
    result = json.loads(result_path.read_text())
    assert "startup_error" not in result, result.get("startup_error")
    failed = {k: v for k, v in result["checks"].items() if not v}
    assert failed == {}, (output, result.get("error_samples"), log_path.read_text()[-3000:])
    assert result["requests_sent"] == 100 and result["errors"] == 0
    assert proc.returncode == 0
