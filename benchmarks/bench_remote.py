"""Remote tier (Redis/Valkey) benchmarks, next to the disk tier, in one run on one machine.

On a throwaway loopback ``redis-server``: I/O against raw SET/GET and the disk slab,
lookups (``_remote_lookups``), TTFT (``_remote_ttft``; --quick runs the engine in one
process: its TTFT means nothing). The method: templates/remote*.md.

    python benchmarks/bench_remote.py --quick --json /tmp/remote.json   # ~1 min
    python benchmarks/bench_remote.py --json remote.json                # ~5 min, 2 cores
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from _buffers import KiB, MiB, chunk_views, fsync_files, prefaulted
from _common import BenchParser, csv, finish, new_result, package_version, rotated, span, workdir
from _markdown import Targets, chunk_axis, fill, fmt, pyplot, save, table
from _remote_lookups import chunk_keys, lookup_lines, lookup_parts
from _remote_ttft import engine_parts, slow_ttft_lines, ttft_lines

from kv_offload.disk import SlabFile
from kv_offload.remote.tier import RemoteTarget, RemoteTier, connect_redis
from kv_offload.remote.values import HEADER_BYTES, ValueCheck
from kv_offload.testing.redis_server import RedisServer, server_binary

NAMESPACE = "bench"
KINDS = {  # I/O contender -> label
    "remote": "ours (hiredis parser + zero-copy packer)",
    "raw": "raw SET/GET (ours' client)",
    "disk": "disk slab",
}
RATIO_COLUMNS = (  # io_ratios key -> column header
    ("ours_vs_raw_store", "ours/raw store"), ("ours_vs_raw_load", "ours/raw load"),
    ("remote_vs_disk_store", "ours/disk store"), ("remote_vs_disk_load", "ours/disk load (warm)"),
    ("remote_vs_disk_cold_load", "ours/disk load (cold)"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = BenchParser(__doc__)
    parser.add_argument("--chunk-kib", type=csv, default=[256, 2048, 8192],
                        help="comma-separated chunk sizes in KiB (default 256,2048,8192)")
    parser.add_argument("--threads", type=csv, default=[1, 4],
                        help="comma-separated I/O thread counts (default 1,4)")
    parser.sized("--total-mib", 256, 16, "bytes moved per chunk size and contender")
    parser.sized("--repeat", 3, 1, "runs per I/O contender, fastest kept")
    parser.add_argument("--lookup-keys", type=csv, default=[16, 64, 256],
                        help="comma-separated keys per lookup (default 16,64,256)")
    parser.sized("--lookup-calls", 1000, 100, "lookups per figure")
    parser.sized("--lengths", "2048,4096", "256,512",
                 "TTFT prefix lengths in tokens, multiples of 256", type=str)
    parser.sized("--rounds", 5, 1, "TTFT rounds (cold pass + remote pass)")
    parser.sized("--maxmemory", "4gb", "512mb", "the Redis server's maxmemory", type=str)
    parser.add_workdir()
    args = parser.parse_args(argv)
    args.timeout_s = 10.0  # RemoteTier's per call: a slow benchmark call must not back it off
    args.chunks = [x * KiB for x in args.chunk_kib]
    args.lengths = sorted(csv(args.lengths))
    args.in_process = args.quick  # the engine in one process: its TTFT means nothing
    if max(args.chunks) > args.total_mib * MiB:
        parser.error("--total-mib must hold at least one chunk of the largest size")
    return args


def timed(fn: Callable[[], object]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, minor page faults) of ``fn()``; CPU and faults of this
    process, all threads. The server is another process: they are the client's cost."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


# -- I/O contenders: each returns {"store": timed(...), "load": ...} (disk adds
# "load_cold") ---------------------------------------------------------------------------------


def run_remote(client: Any, url: str, timeout_s: float, srcs: list[memoryview],
               dsts: list[memoryview], chunk: int, tag: str, pool: ThreadPoolExecutor) -> dict:
    """RemoteTier.write stores, RemoteTier.read_into loads."""
    tier = RemoteTier(RemoteTarget(url), namespace=NAMESPACE, num_ranks=1, payload_bytes=chunk,
                      timeout_s=timeout_s, connect=lambda _target, _timeout: client)
    keys = chunk_keys(tag, len(srcs))

    def store() -> None:
        ok = list(pool.map(lambda i: tier.write(keys[i], 0, srcs[i]), range(len(keys))))
        if not all(ok):
            raise RuntimeError(f"{tag}: {ok.count(False)} of {len(ok)} writes failed "
                               "(see the kv_offload.remote warnings above)")

    def load() -> None:
        got = list(pool.map(lambda i: tier.read_into(keys[i], 0, dsts[i]), range(len(keys))))
        bad = [g for g in got if g is not ValueCheck.OK]
        if bad:
            raise RuntimeError(f"{tag}: {len(bad)} reads failed, first: {bad[0]!r}")

    return {"store": timed(store), "load": timed(load)}


def run_raw(client: Any, srcs: list[memoryview], dsts: list[memoryview], tag: str,
            pool: ThreadPoolExecutor) -> dict:
    names = [b"bench-raw:" + k.hex().encode() for k in chunk_keys(tag, len(srcs))]

    def put(i: int) -> None:
        client.set(names[i], srcs[i])

    def get(i: int) -> None:
        value = client.get(names[i])
        if value is None or len(value) != len(dsts[i]):
            raise RuntimeError(f"{tag}: raw GET returned {None if value is None else len(value)}"
                               " bytes")
        dsts[i][:] = value  # a load ends in the host slot, as read_into does

    return {"store": timed(lambda: list(pool.map(put, range(len(names))))),
            "load": timed(lambda: list(pool.map(get, range(len(names)))))}


def run_disk(root: Path, srcs: list[memoryview], dsts: list[memoryview], chunk: int,
             pool: ThreadPoolExecutor) -> dict:
    slab = SlabFile(root, namespace_id="ab" * 16, rank=0, num_ranks=1, slot_bytes=chunk)
    sums: list[int] = []

    def store() -> None:
        sums[:] = pool.map(lambda i: slab.write(i, srcs[i]), range(len(srcs)))

    def load() -> None:
        ok = list(pool.map(lambda i: bool(slab.read(i, dsts[i], sums[i])), range(len(srcs))))
        if not all(ok):
            raise RuntimeError(f"disk slab: {ok.count(False)} reads failed")

    try:
        out = {"store": timed(store), "load": timed(load)}
        fsync_files([slab.path], evict=True)  # the next load reads the device
        out["load_cold"] = timed(load)
        return out
    finally:
        slab.close()


def bench_io(args: argparse.Namespace, url: str, client: Any, base: Path) -> list[dict]:
    total = args.total_mib * MiB
    src = prefaulted(total)
    src[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = prefaulted(total)
    rows = []
    for chunk in args.chunks:
        count = total // chunk
        srcs, dsts = chunk_views(src, chunk), chunk_views(dst, chunk)
        nbytes = count * chunk
        best: dict[tuple[str, int], dict] = {}
        for rep in range(args.repeat):
            for threads in args.threads:
                with ThreadPoolExecutor(threads) as pool:
                    for kind in rotated(list(KINDS), rep):
                        tag = f"{kind}-{chunk}-{threads}-{rep}"
                        dst[:nbytes] = 0
                        work = Path(tempfile.mkdtemp(dir=base))
                        try:
                            if kind == "disk":
                                times = run_disk(work, srcs, dsts, chunk, pool)
                            elif kind == "raw":
                                times = run_raw(client, srcs, dsts, tag, pool)
                            else:
                                times = run_remote(client, url, args.timeout_s, srcs,
                                                   dsts, chunk, tag, pool)
                        finally:
                            shutil.rmtree(work, ignore_errors=True)
                            if kind != "disk":
                                client.flushall()
                        if not np.array_equal(dst[:nbytes], src[:nbytes]):
                            raise RuntimeError(f"{tag}: loaded bytes differ from stored bytes")
                        old = best.get((kind, threads), times)  # lowest of each figure
                        best[(kind, threads)] = {k: tuple(map(min, v, old[k]))
                                                 for k, v in times.items()}
        for threads in args.threads:
            for kind, label in KINDS.items():
                times = best[(kind, threads)]
                row = {"chunk": chunk, "threads": threads, "kind": kind, "contender": label,
                       "chunks": count, "bytes": nbytes}
                for k, (wall, cpu, faults) in times.items():
                    row[f"{k}_gbps"] = round(nbytes / wall / 1e9, 3)
                    row[f"{k}_cpu_s_per_gb"] = round(cpu / (nbytes / 1e9), 4)
                    row[f"{k}_page_faults_per_mb"] = round(faults / (nbytes / MiB), 2)
                rows.append(row)
        print(f"  I/O with {chunk // KiB} KiB chunks done", flush=True)
    return rows


def io_ratios(rows: list[dict]) -> list[dict]:
    """Per chunk size and thread count: GB/s over GB/s (> 1: the first is faster)."""
    by = {(r["chunk"], r["threads"], r["kind"]): r for r in rows}
    out = []
    for chunk, threads in sorted({(r["chunk"], r["threads"]) for r in rows}):
        def ratio(a: str, b: str, key_a: str, key_b: str | None = None,
                  c: int = chunk, t: int = threads) -> float | None:
            x, y = by.get((c, t, a), {}).get(key_a), by.get((c, t, b), {}).get(key_b or key_a)
            return round(x / y, 3) if x and y else None

        row: dict[str, Any] = {"chunk": chunk, "threads": threads}
        for op in ("store", "load"):
            row[f"ours_vs_raw_{op}"] = ratio("remote", "raw", f"{op}_gbps")
            row[f"remote_vs_disk_{op}"] = ratio("remote", "disk", f"{op}_gbps")
        row["remote_vs_disk_cold_load"] = ratio("remote", "disk", "load_gbps", "load_cold_gbps")
        out.append(row)
    return out


def render_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """The report's remote-tier section: ours against raw SET/GET and the disk tier,
    lookups, TTFT, then what an earlier version measured (templates/remote_history.md)."""
    server, versions, load = data["server"], data["versions"], data["machine"]
    io = [r for r in data["io"] if r["kind"] in KINDS]  # older JSON has more contenders
    lines = fill("remote", data, server_version=server.get("version", "?"),
                 maxmemory=server.get("maxmemory", "?"), redis=versions.get("redis", "?"),
                 hiredis=versions.get("hiredis", "?"), client_remote=data["clients"]["remote"],
                 header_bytes=data.get("header_bytes", HEADER_BYTES),
                 load_start=fmt(load["loadavg_start"][0], ".1f"),
                 load_end=fmt(load["loadavg_end"][0], ".1f"))
    lines += table(["chunk KiB", "threads", "contender", "store GB/s", "load GB/s",
                    "load cold GB/s", "store CPU s/GB", "load CPU s/GB"],
                   [[r["chunk"] // KiB, r["threads"], r["contender"],
                     *[fmt(r.get(k), ".2f") for k in ("store_gbps", "load_gbps", "load_cold_gbps",
                                                      "store_cpu_s_per_gb", "load_cpu_s_per_gb")]]
                    for r in io])

    lines += fill("remote_words", **{k: span([r.get(k) for r in data["io_ratios"]])
                                     for k, _ in RATIO_COLUMNS},
                  table="\n".join(table(
                      ["chunk KiB", "threads", *[name for _, name in RATIO_COLUMNS]],
                      [[r["chunk"] // KiB, r["threads"], *[fmt(r.get(k), ".2f")
                                                           for k, _ in RATIO_COLUMNS]]
                       for r in data["io_ratios"]])))
    if img:
        plot(io, img / "remote_gbps.png")
        lines += ["![Remote vs disk tier GB/s vs chunk size](img/remote_gbps.png)", ""]
    return (lines + lookup_lines(data) + ttft_lines(data.get("ttft"))
            + slow_ttft_lines(data.get("slow_ttft"), targets) + fill("remote_history"))


def plot(io: list[dict], path: Path) -> None:
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
            series.setdefault((r["contender"], r["threads"]), []).append((r["chunk"] / KiB, r[key]))
        for (contender, thr), pts in series.items():
            ax.plot(*zip(*sorted(pts)), styles[thr], color=colors[contender], marker="o",
                    label=f"{contender}, {thr} thr",
                    linewidth=2.5 if contender.startswith("ours (") else 1.2)
        chunk_axis(ax, [x for pts in series.values() for x, _ in pts])
        ax.set(ylabel="GB/s", yscale="log", title=f"remote tier vs disk tier, {title}")
        # log scale: disk runs several times faster than every remote contender
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(threads), fontsize=7)
    rows_in_legend = -(-len(handles) // max(1, len(threads)))
    save(fig, plt, path, rect=(0, min(0.4, 0.035 * rows_in_legend + 0.01), 1, 1))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if server_binary() is None:
        sys.exit("bench_remote: redis-server not found (apt-get install redis-server)")
    base = workdir(args, "remote")
    started = time.perf_counter()
    server = RedisServer(base / "redis", maxmemory=args.maxmemory)
    client: Any = None
    result = new_result("remote", args, io_total_mib=args.total_mib, repeat=args.repeat,
                        timeout_s=args.timeout_s, header_bytes=HEADER_BYTES,
                        versions={d: package_version(d) for d in ("redis", "hiredis")})
    failed: str | None = None
    try:
        server.start()
        client = connect_redis(RemoteTarget(server.url), args.timeout_s)
        info = client.info("server")
        result["server"] = {"version": info.get("redis_version"), "maxmemory": args.maxmemory,
                            "binary": server_binary()}
        conn = client.connection_pool.get_connection()  # its parser and command packer
        result["clients"] = {"remote": f"{type(conn._parser).__name__} (RESP{conn.protocol})"
                                       f" + {type(conn._command_packer).__name__}"}
        client.connection_pool.release(conn)
        if result["versions"]["hiredis"] == "not installed":
            print("WARNING: hiredis is not installed: the client parses with redis-py's "
                  "Python parser", file=sys.stderr, flush=True)
        with ThreadPoolExecutor(max(args.threads)) as pool:  # no timed call pays a connect
            list(pool.map(lambda _: client.ping(), range(max(args.threads) * 4)))
        print(f"redis-server {result['server']['version']} at {server.url}; clients "
              f"{result['clients']}", flush=True)
        result["io"] = bench_io(args, server.url, client, base)
        result["io_ratios"] = io_ratios(result["io"])
        lookup_parts(args, server, client, base, result)
        failed = engine_parts(args, server, base, result)
    finally:
        if client is not None:
            client.close()
        server.stop()
        if failed:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    finish(result, args.json, render_section, started)
    if failed:
        raise SystemExit(f"bench_remote: {failed}")
    return result


if __name__ == "__main__":
    main()
