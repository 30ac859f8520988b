"""Runs the CPU benchmark set and writes docs/benchmarks.md with plots (what `make bench` runs).

Each benchmark runs as its own subprocess with ``--json``; the report is then rebuilt
from every JSON file in the data folder, so ``--only NAME`` re-runs one benchmark and
keeps the others' last results.

    .venv/bin/python benchmarks/run_all.py                  # all, ~20 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --quick          # toy sizes, into a temp dir
    .venv/bin/python benchmarks/run_all.py --only ttft      # one benchmark, report rebuilt
    .venv/bin/python benchmarks/run_all.py --report-only    # rebuild the report from JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCHES, DATA_DIR, ROOT, machine_info


def run_bench(name: str, out: Path, *, quick: bool, timeout_s: float) -> dict:
    """Run one benchmark script; returns its run record (command, exit code, seconds)."""
    data = out / DATA_DIR
    data.mkdir(parents=True, exist_ok=True)
    json_path = data / f"{name}.json"
    json_path.unlink(missing_ok=True)
    script = Path("benchmarks") / f"bench_{name}.py"
    argv = [str(script), "--json", str(json_path)] + (["--quick"] if quick else [])
    shown_json = json_path.relative_to(ROOT) if json_path.is_relative_to(ROOT) else json_path
    shown = " ".join([".venv/bin/python" if ".venv" in sys.executable else "python",
                      str(script), "--json", str(shown_json), *argv[3:]])
    print(f"\n=== {name}: {shown}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start = os.getloadavg()[0]
    start = time.perf_counter()
    log = out / DATA_DIR / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for line in proc.stdout:  # echo the tables as they come
                f.write(line)
                sys.stdout.write(line)
            code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = -9
    seconds = time.perf_counter() - start
    ok = code == 0 and json_path.exists()
    print(f"=== {name}: {'ok' if ok else f'FAILED (exit {code})'} in {seconds:.0f} s", flush=True)
    return {"name": name, "command": shown, "exit_code": code, "ok": ok,
            "seconds": round(seconds, 1), "started": started,
            "loadavg_1min": [round(load_start, 1), round(os.getloadavg()[0], 1)],
            "log": str(log.relative_to(out))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="every benchmark in --quick mode; output to a temp dir, not docs/")
    parser.add_argument("--only", action="append", choices=sorted(BENCHES), metavar="NAME",
                        help=f"run only this benchmark (repeatable): {', '.join(BENCHES)}")
    parser.add_argument("--out", type=Path, default=None,
                        help="output root (default: docs/, or a temp dir with --quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing; rebuild the report from the JSON already there")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import _report  # noqa: PLC0415 - the benchmarks' imports stay out of --help

    out = args.out or (Path(tempfile.mkdtemp(prefix="kv-offload-bench-"))
                       if args.quick else ROOT / "docs")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / DATA_DIR / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    started = time.time()
    machine_before = machine_info()
    if not args.report_only:
        for name in args.only or list(BENCHES):
            runs[name] = run_bench(name, out, quick=args.quick, timeout_s=args.timeout)
            runs[name]["machine"] = machine_before
        runs_path.parent.mkdir(parents=True, exist_ok=True)
        runs_path.write_text(json.dumps(runs, indent=2))
    report = _report.write_report(out, runs, quick=args.quick,
                                  total_s=time.time() - started if not args.report_only else None)
    print(f"\nreport: {report}")
    failed = [r["name"] for r in runs.values() if not r.get("ok")]
    if failed:
        print(f"failed benchmarks: {', '.join(failed)} (logs under {out / DATA_DIR / 'logs'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
