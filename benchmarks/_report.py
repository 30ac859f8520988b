"""Renders docs/benchmarks.md and the plots under docs/img/ from the benchmarks' JSON.

Every benchmark but bench_remote renders its own section (``render_section``, prose in
templates/); the remote section is rendered here until it moves into bench_remote. A section that fails to render says so
in the page instead of failing the whole report.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_copy
import bench_lookup
import bench_overhead
import bench_tiers
import bench_ttft
from _common import machine_info
from _markdown import Targets, chunk_axis, fill, fmt, pyplot, table

DATA_DIR = "bench-data"
REMOTE_KINDS = ("remote", "raw", "disk")  # the contenders shown; the rest is history
REMOTE_RATIOS = (  # io_ratios key -> column header
    ("ours_vs_raw_store", "ours/raw store"), ("ours_vs_raw_load", "ours/raw load"),
    ("remote_vs_disk_store", "ours/disk store"), ("remote_vs_disk_load", "ours/disk load (warm)"),
    ("remote_vs_disk_cold_load", "ours/disk load (cold)"),
)


# -- remote tier -----------------------------------------------------------------------------


def _span(values: list[float]) -> str:
    """'a-bx' (or 'ax') of the numbers in ``values``, 2 decimals."""
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}x" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}x"


def remote_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """The remote-tier section: ours against raw SET/GET and the disk tier, lookups, TTFT;
    then what an earlier version measured against redis-py's clients (a fixed template)."""
    server, versions = data["server"], data["versions"]
    io = [r for r in data["io"] if r["kind"] in REMOTE_KINDS]
    load = data.get("machine", {})
    lines = fill("remote", server_version=server.get("version", "?"),
                 maxmemory=server.get("maxmemory", "?"), redis=versions.get("redis", "?"),
                 hiredis=versions.get("hiredis", "?"), io_total_mib=data["io_total_mib"],
                 repeat=data["repeat"], header_bytes=data.get("header_bytes", 40),
                 client_remote=data["clients"]["remote"],
                 load_start=fmt(load.get("loadavg_start", [None])[0], ".1f"),
                 load_end=fmt(load.get("loadavg_end", [None])[0], ".1f"))
    lines += table(["chunk KiB", "threads", "contender", "store GB/s", "load GB/s",
                    "load cold GB/s", "store CPU s/GB", "load CPU s/GB"],
                   [[r["chunk"] // 1024, r["threads"], r["contender"],
                     *[fmt(r.get(k), ".2f") for k in ("store_gbps", "load_gbps", "load_cold_gbps",
                                                      "store_cpu_s_per_gb", "load_cpu_s_per_gb")]]
                    for r in io])

    def col(key: str) -> str:
        return _span([r[key] for r in data["io_ratios"] if isinstance(r.get(key), (int, float))])

    lines += fill("remote_words", raw_store=col("ours_vs_raw_store"),
                  raw_load=col("ours_vs_raw_load"), disk_store=col("remote_vs_disk_store"),
                  disk_load=col("remote_vs_disk_load"), disk_cold=col("remote_vs_disk_cold_load"),
                  table="\n".join(table(
                      ["chunk KiB", "threads", *[name for _, name in REMOTE_RATIOS]],
                      [[r["chunk"] // 1024, r["threads"], *[fmt(r.get(k), ".2f")
                                                            for k, _ in REMOTE_RATIOS]]
                       for r in data["io_ratios"]])))
    if img:
        plot_remote(io, img / "remote_gbps.png")
        lines += ["![Remote vs disk tier GB/s vs chunk size](img/remote_gbps.png)", ""]
    return (lines + _remote_lookup_lines(data) + _remote_ttft_lines(data.get("ttft"))
            + fill("remote_history"))


def _remote_lookup_lines(data: dict) -> list[str]:
    lookup = [r for r in data.get("lookup", []) if r["method"] == "ours"]
    if not lookup:
        return []
    by = {(r["keys"], r["present"]): r for r in lookup}
    sixteen = by.get((16, True), {})
    absent = [r["median_us"] / by[(k, True)]["median_us"]
              for (k, hit), r in by.items() if not hit and (k, True) in by]
    return fill("remote_lookup", calls=lookup[0].get("calls", "?"),
                client_ours=data["lookup_clients"]["ours"],
                median16=fmt(sixteen.get("median_us"), ".0f"),
                p99_16=fmt(sixteen.get("p99_us"), ".0f"), absent=_span(absent),
                table="\n".join(table(
                    ["keys", "present", "median us", "p99 us", "median us/key", "p99 us/key"],
                    [[r["keys"], "all" if r["present"] else "none", fmt(r["median_us"], ".0f"),
                      fmt(r["p99_us"], ".0f"), fmt(r["median_us_per_key"], ".1f"),
                      fmt(r["p99_us_per_key"], ".1f")] for r in lookup])))


def _remote_ttft_lines(ttft: Any) -> list[str]:
    if not isinstance(ttft, dict) or "modes" not in ttft:
        why = ttft.get("error", "no data") if isinstance(ttft, dict) else "no data"
        return [f"**TTFT.** Not measured: {why}.", ""]
    lengths = [str(n) for n in ttft["lengths"]]
    in_process = ttft.get("env", {}).get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"

    def ms(mode: str, n: str) -> float | None:
        value = ttft["modes"].get(mode, {}).get(n, {}).get("median_s")
        return value * 1e3 if isinstance(value, (int, float)) else None

    rows = [[mode, *[fmt(ms(mode, n), ".1f") for n in lengths]] for mode in ("cold", "remote")]
    rows.append(["remote / cold", *[fmt(ttft["ratios"].get(n)) for n in lengths]])
    return fill(
        "remote_ttft", model=ttft.get("model", {}).get("name"), offload=ttft.get("offload"),
        env=ttft.get("env", {}), rounds=ttft.get("rounds", "?"),
        suffix_tokens=ttft.get("suffix_tokens", 16),
        in_process=("**This run used the single-process engine (--quick). There, remote loads "
                    "were several times slower than with vLLM's default engine processes (the "
                    "I/O threads share one interpreter, and its GIL, with the engine loop): "
                    "these figures are not representative.**\n\n") if in_process else "",
        table="\n".join(table(["TTFT", *[f"L={n} (ms)" for n in lengths]], rows)),
        ratios=", ".join(f"{fmt(ttft['ratios'].get(n), '.2f')}x at {n} tokens" for n in lengths),
        hits=fmt(ttft.get("remote_hit_tokens"), ".0f"),
        expected=fmt(ttft.get("expected_hit_tokens"), ".0f"),
        host_hits=fmt(ttft.get("remote_pass_host_hit_tokens"), ".0f"),
        tokens_equal=ttft.get("tokens_equal"), startup=fmt(ttft.get("startup_s"), ".0f"))


def plot_remote(io: list[dict], path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import FormatStrFormatter

    # one colour per contender, one line style per thread count
    colors = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(r["contender"] for r in io))}
    threads = sorted({r["threads"] for r in io})
    styles = {t: ("-", "--", ":", "-.")[i % 4] for i, t in enumerate(threads)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.5))
    for ax, (key, title) in zip(axes, (("store_gbps", "store"), ("load_gbps", "load (disk: warm)"))):
        series: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for r in io:
            series.setdefault((r["contender"], r["threads"]), []).append((r["chunk"] / 1024, r[key]))
        for (contender, thr), pts in series.items():
            ax.plot(*zip(*sorted(pts)), styles[thr], color=colors[contender], marker="o",
                    label=f"{contender}, {thr} thr",
                    linewidth=2.5 if contender.startswith("ours (") else 1.2)
        chunk_axis(ax, [x for pts in series.values() for x, _ in pts])
        ax.set_ylabel("GB/s")
        ax.set_yscale("log")  # disk runs several times faster than every remote contender
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(f"remote tier vs disk tier, {title}")
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(threads), fontsize=7)
    rows_in_legend = -(-len(handles) // max(1, len(threads)))
    fig.tight_layout(rect=(0, min(0.4, 0.035 * rows_in_legend + 0.01), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)  # not _markdown.save: its tight_layout drops the legend's room
    plt.close(fig)


SECTIONS: dict[str, Callable[[dict, Path | None, Targets], list[str]]] = {
    "ttft": bench_ttft.render_section, "overhead": bench_overhead.render_section,
    "copy": bench_copy.render_section, "tiers": bench_tiers.render_section,
    "lookup": bench_lookup.render_section, "remote": remote_section,
}


# -- the report ------------------------------------------------------------------------------


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
    lines = ["# Benchmarks", ""]
    if quick:
        lines += ["**Quick mode: toy sizes for a smoke test; these numbers mean nothing.**", ""]
    lines += [
        f"Generated by `make bench` (`.venv/bin/python benchmarks/run_all.py`) on "
        f"{machine.get('time', '?')}; rebuilt {time.strftime('%Y-%m-%d %H:%M:%S %Z')}."
        + (f" Total wall time {total_s / 60:.1f} min." if total_s else ""), "",
        "Every ratio is measured side by side in one run: contenders take turns in short "
        "blocks of requests (or batch by batch), in rotating order, so that machine noise "
        "hits them alike. These machines are shared and noisy: other engineers' test suites "
        "were running during this run (load averages below), so absolute numbers wander; "
        "trust the ratios more.", "", "## Machine", "",
    ]
    lines += table(["", ""], [
        ["CPU", machine.get("cpu_model")],
        ["cores (nproc)", f"{machine.get('nproc')} usable of {machine.get('cpu_count')}"],
        ["memory", f"{machine.get('memory_gib')} GiB"],
        ["OS", machine.get("platform")], ["Python", machine.get("python")],
        ["vLLM", machine.get("vllm")], ["torch", machine.get("torch")],
        ["lmdb", machine.get("lmdb")], ["kv-offload", machine.get("kv_offload")],
        ["load average at start", " / ".join(f"{x:.1f}" for x in machine.get("loadavg", []))],
    ])
    lines += fill("notes")
    lines += ["## Targets", ""]
    lines += table(["target", "measured", "limit", "verdict", "from"], targets.rows)
    lines += ["## Commands", "", "Run from the repository root:", ""]
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
    lines += table(["command", "exit", "seconds", "started", "load average (1 min)"], rows)
    lines += ["Raw results: `docs/bench-data/*.json` (one per benchmark) and the console "
              "output in `docs/bench-data/logs/`.", ""]
    report = out / "benchmarks.md"
    report.write_text("\n".join(lines + body).rstrip() + "\n")
    return report
