"""The newest vLLM's pure-Python modules, for the scheduler-level test lane
(``make test-vllm-next``, issue 32 §6).

vLLM's scheduler, KV cache manager, request and connector base classes are pure Python,
so a newer vLLM than the CPU wheel's (0.32) runs them on the same torch when its modules
are put ahead of the installed ``vllm`` on ``PYTHONPATH``. ``fetch`` downloads the CUDA
wheel once (``pip download --no-deps``: the only network access; the tests never reach
the network) and unpacks the Python modules and their data files, without compiled
extensions (``*.so``), the bundled Rust binary, C/C++/CUDA sources and headers, or the
``.dist-info`` (so that nothing sees a second ``vllm`` distribution). The wheel is
deleted once unpacked; pip's cache keeps it for a later fetch.

Layout: ``<dest>/<version>/vllm/...``, complete once ``<dest>/<version>/.complete``
exists (written last; an interrupted fetch leaves a ``.partial`` directory, removed on
the next one).

Usage: ``python -m kv_offload.testing.vllm_next fetch 0.34.0 .venv/vllm-next`` prints the
directory to put on ``PYTHONPATH`` (with ``VLLM_TARGET_DEVICE=cpu``: without its
``.dist-info`` vLLM cannot tell from its version that it runs on the CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# Members of the wheel left out: compiled code, its sources, the distribution metadata.
_SKIPPED_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".cu", ".cpp", ".inl")
_SKIPPED_NAMES = ("vllm/vllm-rs",)  # a 64 MB Rust binary (the frontend)


class FetchError(RuntimeError):
    """The wheel could not be downloaded or unpacked (offline, no such version, ...)."""


def lane_dir(dest: Path, version: str) -> Path:
    """The directory holding ``version``'s modules (on ``PYTHONPATH`` for the lane)."""
    return dest / version


def is_complete(dest: Path, version: str) -> bool:
    return (lane_dir(dest, version) / ".complete").is_file()


def _wanted(name: str) -> bool:
    top = name.split("/", 1)[0]
    return (top == "vllm" and not name.endswith("/") and name not in _SKIPPED_NAMES
            and not name.endswith(_SKIPPED_SUFFIXES))


def unpack(wheel: Path, target: Path) -> dict[str, int]:
    """Unpack ``wheel``'s pure-Python members into ``target`` (which must not exist);
    returns counts of files kept and skipped."""
    kept = skipped = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            if not _wanted(info.filename):
                skipped += 1
                continue
            zf.extract(info, target)
            kept += 1
    return {"files": kept, "skipped": skipped}


def fetch(version: str, dest: Path, *, python: str = sys.executable) -> Path:
    """Download vLLM ``version``'s wheel and unpack its modules under ``dest`` (nothing
    when already complete); returns the directory for ``PYTHONPATH``.

    Raises FetchError when pip cannot download it (offline, unknown version) or the
    wheel holds no ``vllm`` package; ``dest`` is then left as it was.
    """
    target = lane_dir(dest, version)
    if is_complete(dest, version):
        return target
    dest.mkdir(parents=True, exist_ok=True)
    partial = dest / f"{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [python, "-m", "pip", "download", f"vllm=={version}", "--no-deps",
               "--only-binary=:all:", "--dest", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("vllm-*.whl"))
        if done.returncode != 0 or not wheels:
            raise FetchError(f"pip could not download vllm=={version} (offline?):\n"
                             f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
        wheel = wheels[0]
        counts = unpack(wheel, partial)
        if not (partial / "vllm" / "__init__.py").is_file():
            shutil.rmtree(partial, ignore_errors=True)
            raise FetchError(f"{wheel.name} holds no vllm package")
        with wheel.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
        record = {"version": version, "wheel": wheel.name, "sha256": digest,
                  "wheel_bytes": wheel.stat().st_size, **counts}
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    (target / ".complete").write_text(json.dumps(record, indent=1) + "\n")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kv_offload.testing.vllm_next",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    get = sub.add_parser("fetch", help="download and unpack once; print the directory")
    get.add_argument("version")
    get.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    try:
        print(fetch(args.version, args.dest))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
