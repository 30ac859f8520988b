"""The vllm-next lane's fetcher (kv_offload/testing/vllm_next.py): it keeps vLLM's Python
modules and data and leaves compiled code and the distribution metadata out, and an
offline fetch fails with a message and leaves nothing half-made."""

from __future__ import annotations

import zipfile

import pytest

from kv_offload.testing.vllm_next import FetchError, fetch, is_complete, unpack


def _wheel(path):
    members = {"vllm/__init__.py": "__version__ = '9.9.9'\n",
               "vllm/v1/core/sched/scheduler.py": "class Scheduler: ...\n",
               "vllm/model_executor/configs/moe.json": "{}\n",
               "vllm/_C.abi3.so": "\x7fELF", "vllm/vllm-rs": "\x7fELF",
               "vllm/third_party/kernel.cuh": "", "vllm/csrc/x.h": "",
               "vllm-9.9.9.dist-info/METADATA": "Name: vllm\n"}
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return path


def test_unpack_keeps_python_modules_and_data_only(tmp_path):
    counts = unpack(_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl"), tmp_path / "out")
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in
                  (tmp_path / "out").rglob("*") if p.is_file())
    assert kept == ["vllm/__init__.py", "vllm/model_executor/configs/moe.json",
                    "vllm/v1/core/sched/scheduler.py"]
    assert counts == {"files": 3, "skipped": 5}


def test_an_offline_fetch_fails_with_pips_message_and_leaves_nothing(tmp_path):
    offline_pip = tmp_path / "python"
    offline_pip.write_text("#!/bin/sh\necho 'No matching distribution found' >&2\nexit 1\n")
    offline_pip.chmod(0o755)
    dest = tmp_path / "vllm-next"
    with pytest.raises(FetchError, match="No matching distribution found"):
        fetch("9.9.9", dest, python=str(offline_pip))
    assert not is_complete(dest, "9.9.9")
    assert [p.name for p in dest.iterdir()] == []
