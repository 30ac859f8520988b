"""Runs the CPU benchmark set and writes docs/benchmarks.md with plots (what `make bench` runs).

Each benchmark runs as a subprocess with ``--json``; the report is rebuilt from every JSON
file in the data folder (``--only NAME`` keeps the others' last results): each benchmark's
``render_section``, in the page of templates/page.md. A section that fails to render says
so in the page.

    .venv/bin/python benchmarks/run_all.py                  # all, ~25 min on 2 cores
    .venv/bin/python benchmarks/run_all.py --quick          # toy sizes, into a temp dir
    .venv/bin/python benchmarks/run_all.py --only ttft      # one benchmark, report rebuilt
    .venv/bin/python benchmarks/run_all.py --report-only    # rebuild the report from JSON
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from _common import BENCHES, DATA_DIR, ROOT, machine_info
from _markdown import Targets, fill, fmt, table


def run_bench(name: str, out: Path, *, quick: bool, timeout_s: float) -> dict:
    """Run one benchmark script; returns its run record (command, exit code, seconds)."""
    json_path, log = out / DATA_DIR / f"{name}.json", out / DATA_DIR / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    json_path.unlink(missing_ok=True)
    script, *flags = BENCHES[name]
    argv = [f"benchmarks/bench_{script}.py", *flags, "--json", str(json_path)] + ["--quick"] * quick
    shown = " ".join([".venv/bin/python" if ".venv" in sys.executable else "python", *argv]
                     ).replace(f"{ROOT}{os.sep}", "")
    print(f"\n=== {name}: {shown}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    load_start, start = os.getloadavg()[0], time.perf_counter()
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


def _section(name: str, out: Path, runs: dict[str, dict], targets: Targets) -> list[str]:
    """One benchmark's section, or a few lines saying why it is missing."""
    try:
        data = json.loads((out / DATA_DIR / f"{name}.json").read_text())
    except (OSError, ValueError):
        run = runs.get(name)
        why = "not run" if run is None else f"failed (exit {run.get('exit_code')})"
        return [f"## {name}", "", f"No results: {why}.", ""]
    try:
        render = importlib.import_module(f"bench_{BENCHES[name][0]}").render_section
        return render(data, out / "img", targets)
    except Exception as exc:  # another script's format changed: say so, keep going
        return [f"## {name}", "", f"Could not render ({type(exc).__name__}: {exc}).", "",
                "```", traceback.format_exc(limit=2), "```", ""]


def write_report(out: Path, runs: dict[str, dict], *, quick: bool, total_s: float | None) -> Path:
    """Write ``out/benchmarks.md`` (and ``out/img/*.png``) from ``out/bench-data/*.json``."""
    targets = Targets()
    body = [line for name in BENCHES for line in _section(name, out, runs, targets)]
    machine = next((r["machine"] for r in runs.values() if "machine" in r), machine_info())
    root = f"{ROOT}{os.sep}"
    rows = []
    for r in runs.values():
        started = r.get("started") or ("run_all at " + r.get("machine", {}).get("time", "?"))
        load = r.get("loadavg_1min")
        rows.append([f"`{str(r.get('command')).replace(root, '')}`", r.get("exit_code"),
                     fmt(r.get("seconds"), ".0f"), started,
                     f"{load[0]} -> {load[1]}" if load else "-"])
    total = sum(r.get("seconds") or 0 for r in runs.values())
    rows.append(["all of the above", "", f"{total:.0f} ({total / 60:.1f} min)", "", ""])
    m = machine.get
    lines = fill(  # the machine table: machine_info's keys
        "page", machine,
        quick="**Quick mode: toy sizes for a smoke test; these numbers mean nothing.**\n\n"
              if quick else "",
        generated=m("time", "?"), rebuilt=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        total=f" Total wall time {total_s / 60:.1f} min." if total_s else "",
        loadavg=" / ".join(f"{x:.1f}" for x in m("loadavg", [])),
        targets="\n".join(table(["target", "measured", "limit", "verdict", "from"],
                                targets.rows)),
        commands="\n".join(table(["command", "exit", "seconds", "started",
                                  "load average (1 min)"], rows)))
    report = out / "benchmarks.md"
    report.write_text("\n".join(lines + body).rstrip() + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
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
    args = parser.parse_args(argv)
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
    report = write_report(out, runs, quick=args.quick,
                          total_s=time.time() - started if not args.report_only else None)
    print(f"\nreport: {report}")
    failed = [r["name"] for r in runs.values() if not r.get("ok")]
    if failed:
        print(f"failed benchmarks: {', '.join(failed)} (logs under {out / DATA_DIR / 'logs'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
