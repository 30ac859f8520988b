"""Renders docs/benchmarks.md and the plots under docs/img/ from the benchmarks' JSON.

Every benchmark renders its own section (``render_section``, prose in templates/); this
module assembles the page: machine, notes, targets, commands, then the sections. A
section that fails to render says so in the page instead of failing the whole report.
"""

from __future__ import annotations

import importlib
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from _common import BENCHES, DATA_DIR, machine_info
from _markdown import Targets, fill, fmt, table

SECTIONS: dict[str, Callable[[dict, Path | None, Targets], list[str]]] = {
    name: importlib.import_module(f"bench_{name}").render_section for name in BENCHES}


def _section(name: str, out: Path, runs: dict[str, dict], targets: Targets) -> list[str]:
    """One benchmark's section, or a few lines saying why it is missing."""
    try:
        data = json.loads((out / DATA_DIR / f"{name}.json").read_text())
    except (OSError, ValueError):
        run = runs.get(name)
        why = "not run" if run is None else f"failed (exit {run.get('exit_code')})"
        return [f"## {name}", "", f"No results: {why}.", ""]
    try:
        return SECTIONS[name](data, out / "img", targets)
    except Exception as exc:  # another script's format changed: say so, keep going
        return [f"## {name}", "", f"Could not render ({type(exc).__name__}: {exc}).", "",
                "```", traceback.format_exc(limit=2), "```", ""]


def write_report(out: Path, runs: dict[str, dict], *, quick: bool,
                 total_s: float | None) -> Path:
    """Write ``out/benchmarks.md`` (and ``out/img/*.png``) from ``out/bench-data/*.json``."""
    targets = Targets()
    body = [line for name in SECTIONS for line in _section(name, out, runs, targets)]
    machine = next((r["machine"] for r in runs.values() if "machine" in r), machine_info())
    root = str(Path(__file__).resolve().parents[1]) + os.sep
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
    lines = fill(
        "page", quick="**Quick mode: toy sizes for a smoke test; these numbers mean nothing.**"
                      "\n\n" if quick else "",
        generated=m("time", "?"), rebuilt=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        total=f" Total wall time {total_s / 60:.1f} min." if total_s else "",
        machine="\n".join(table(["", ""], [
            ["CPU", m("cpu_model")], ["cores (nproc)", f"{m('nproc')} usable of {m('cpu_count')}"],
            ["memory", f"{m('memory_gib')} GiB"], ["OS", m("platform")], ["Python", m("python")],
            ["vLLM", m("vllm")], ["torch", m("torch")], ["lmdb", m("lmdb")],
            ["kv-offload", m("kv_offload")],
            ["load average at start", " / ".join(f"{x:.1f}" for x in m("loadavg", []))]])),
        targets="\n".join(table(["target", "measured", "limit", "verdict", "from"],
                                targets.rows)),
        commands="\n".join(table(["command", "exit", "seconds", "started",
                                  "load average (1 min)"], rows)))
    report = out / "benchmarks.md"
    report.write_text("\n".join(lines + body).rstrip() + "\n")
    return report
