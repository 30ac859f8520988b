"""copy/cuda_runtime.py on any host: where CuPy's kernel cache goes, chosen before CuPy is
imported (CuPy creates ``~/.cupy/kernel_cache`` while it imports, and raised
NotADirectoryError under HOME=/dev/null, which killed the worker)."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys
import tempfile

import pytest

from kv_offload.copy.base import CudaUnavailableError
from kv_offload.copy.cuda_runtime import cupy_cache_dir

HAVE_CUPY = importlib.util.find_spec("cupy") is not None

IMPORT_THROUGH_KV_OFFLOAD = """
import os, sys
from kv_offload.copy import cuda_runtime
try:
    cuda_runtime.cuda_module()
except cuda_runtime.CudaUnavailableError as exc:  # a host without a GPU
    print("unavailable:", exc)
print("imported:", "cupy" in sys.modules)
print("cache:", os.environ.get("CUPY_CACHE_DIR"))
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CUPY_CACHE_DIR"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is ``tmp_path`` (it caches its answer in ``tempdir``)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.skipif(not HAVE_CUPY, reason="needs CuPy installed (no GPU needed)")
def test_cupy_imports_through_kv_offload_with_home_not_a_directory(tmp_path):
    """Issue 27, section 5: with HOME=/dev/null (or any HOME that cannot hold ~/.cupy),
    importing CuPy through kv-offload raised NotADirectoryError and killed the worker.
    Now its cache goes to a private directory under the temporary directory."""
    result = run_python(IMPORT_THROUGH_KV_OFFLOAD, HOME="/dev/null", TMPDIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    private = tmp_path / f"kv-offload-cupy-{os.getuid()}"
    assert "imported: True" in result.stdout
    assert f"cache: {private}" in result.stdout
    assert stat.S_IMODE(private.stat().st_mode) == 0o700


@pytest.mark.skipif(not HAVE_CUPY, reason="needs CuPy installed (no GPU needed)")
def test_an_unusable_cupy_cache_dir_that_the_user_set_is_a_clear_error(tmp_path):
    result = run_python(IMPORT_THROUGH_KV_OFFLOAD, CUPY_CACHE_DIR="/dev/null/cache")
    assert result.returncode == 0, result.stderr
    assert "unavailable: CuPy failed to import" in result.stdout
    assert "set CUPY_CACHE_DIR to a writable directory" in result.stdout


def test_a_cache_dir_set_by_the_user_is_kept(tmp_path, temp_root):
    environ = {"CUPY_CACHE_DIR": str(tmp_path / "mine"), "HOME": "/dev/null"}
    assert cupy_cache_dir(environ) == str(tmp_path / "mine")
    assert environ["CUPY_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_writable_home_holds_the_cache(tmp_path, temp_root, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    environ: dict[str, str] = {}
    chosen = cupy_cache_dir(environ)
    assert chosen == str(tmp_path / "home" / ".cupy" / "kernel_cache")
    assert os.path.isdir(chosen) and environ == {"CUPY_CACHE_DIR": chosen}


def test_without_a_usable_home_the_cache_is_private_under_the_temporary_directory(
        temp_root, monkeypatch):
    monkeypatch.setenv("HOME", "/dev/null")
    environ: dict[str, str] = {}
    chosen = cupy_cache_dir(environ)
    assert chosen == str(temp_root / f"kv-offload-cupy-{os.getuid()}")
    assert stat.S_IMODE(os.stat(chosen).st_mode) == 0o700
    assert cupy_cache_dir({}) == chosen  # found again, and still trusted


def test_a_temporary_cache_dir_others_may_write_is_refused_with_the_fix(temp_root, monkeypatch):
    """Anyone could plant kernels in it that CuPy would load: not used, and the error says
    what was tried and what to set."""
    monkeypatch.setenv("HOME", "/dev/null")
    planted = temp_root / f"kv-offload-cupy-{os.getuid()}"
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(CudaUnavailableError) as info:
        cupy_cache_dir({})
    message = str(info.value)
    assert "/dev/null/.cupy" in message and str(planted) in message
    assert "set CUPY_CACHE_DIR to a writable directory" in message
