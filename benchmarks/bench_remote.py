"""Remote tier (Redis/Valkey) benchmarks, next to the disk tier, in one run on one machine.

A throwaway ``redis-server`` is started on loopback (stopped again whatever happens):

1. I/O: store and load N chunks of 256 KiB, 2 MiB and 8 MiB with 1 and 4 threads:
   ``RemoteTier.write`` / ``read_into`` on ``connect_redis``'s client (ours) against raw
   SET/GET of the same bytes and the disk tier's ``SlabFile``; GB/s and the client's CPU
   seconds and page faults per GB, the best of the runs.
2. Lookup of 16, 64 and 256 keys, all present or none (standalone and a 3-node cluster),
   and the scheduler thread's time per request with ``RemoteLookups`` against the
   synchronous lookup, with the server direct and behind a slow proxy.
3. TTFT with a slow server (``_remote_slow``): remote tier behind a proxy holding each
   reply 50-200 ms against no remote tier, side by side.
4. TTFT: one engine with ``remote_url`` and no disk tier, cold against the same prompts
   after ``reset_prefix_cache(reset_connector=True)`` (loaded from Redis); the script
   fails when the tokens differ. --quick runs the engine in one process (faster start,
   not the default topology: its remote TTFT means nothing).

What each figure means is in templates/remote*.md (the report's prose).

    python benchmarks/bench_remote.py --quick --json /tmp/remote.json   # ~1 min
    python benchmarks/bench_remote.py --json remote.json                # ~5 min, 2 cores
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import bench_parser, command_line, finish, span  # noqa: E402
from _engine import benchmark_env, engine_kwargs  # noqa: E402
from _markdown import Targets, chunk_axis, fill, fmt, pyplot, table, verdict  # noqa: E402
from _remote_lookups import (  # noqa: E402
    bench_cluster_lookup,
    bench_lookup,
    bench_scheduler_thread,
    chunk_keys,
)
from _remote_slow import bench_slow_ttft  # noqa: E402

from kv_offload.disk import SlabFile  # noqa: E402
from kv_offload.remote.tier import RemoteTarget, RemoteTier, connect_redis  # noqa: E402
from kv_offload.remote.values import HEADER_BYTES, ValueCheck  # noqa: E402
from kv_offload.testing.redis_server import RedisServer, server_binary  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
NAMESPACE = "bench"
SUFFIX_TOKENS = 16
# Same geometry as bench_ttft's default model (its cached files are reused).
TTFT_MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  max_position=16384)
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
SLOW_TARGET = 1.2  # _remote_slow: TTFT remote / no remote tier, medians


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__)
    parser.add_argument("--chunk-kib", type=str, default="256,2048,8192",
                        help="comma-separated chunk sizes in KiB (default 256,2048,8192)")
    parser.add_argument("--threads", type=str, default="1,4",
                        help="comma-separated I/O thread counts (default 1,4)")
    parser.add_argument("--total-mib", type=int, default=None,
                        help="bytes moved per chunk size and contender (default 256, --quick 16)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs per I/O contender, fastest kept (default 3, --quick 1)")
    parser.add_argument("--lookup-keys", type=str, default="16,64,256",
                        help="comma-separated keys per lookup (default 16,64,256)")
    parser.add_argument("--lookup-calls", type=int, default=None,
                        help="lookups per figure (default 1000, --quick 100)")
    parser.add_argument("--lengths", type=str, default=None,
                        help="TTFT prefix lengths in tokens, multiples of 256 "
                             "(default 2048,4096; --quick 256,512)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="TTFT rounds (cold pass + remote pass; default 5, --quick 1)")
    parser.add_argument("--no-engine", action="store_true", help="skip the TTFT parts")
    parser.add_argument("--no-slow-ttft", action="store_true",
                        help="skip the slow-server TTFT (two more engines)")
    parser.add_argument("--maxmemory", type=str, default=None,
                        help="the Redis server's maxmemory (default 4gb, --quick 512mb)")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="RemoteTier timeout per call (default 10: a slow benchmark "
                             "call must not trip the tier's backoff)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the disk slabs, the server and the engine run go "
                             "(default: a temp dir under $TMPDIR)")
    parser.add_argument("--in-process", action="store_true",
                        help="engine in one process (the default with --quick)")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (engine log)")
    args = parser.parse_args(argv)
    args.chunks = [int(x) * KiB for x in args.chunk_kib.split(",")]
    args.thread_counts = [int(x) for x in args.threads.split(",")]
    args.total_mib = args.total_mib or (16 if args.quick else 256)
    args.repeat = args.repeat or (1 if args.quick else 3)
    args.lookup_sizes = [int(x) for x in args.lookup_keys.split(",")]
    args.lookup_calls = args.lookup_calls or (100 if args.quick else 1000)
    lengths = args.lengths or ("256,512" if args.quick else "2048,4096")
    args.lengths = sorted(int(x) for x in lengths.split(","))
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.maxmemory = args.maxmemory or ("512mb" if args.quick else "4gb")
    args.in_process = args.in_process or args.quick
    if max(args.chunks) > args.total_mib * MiB:
        parser.error("--total-mib must hold at least one chunk of the largest size")
    return args


# -- helpers ----------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, minor page faults) of ``fn()``; CPU and faults of this
    process, all threads. The server is another process: they are the client's cost."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def prefaulted(nbytes: int) -> np.ndarray:
    arr = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)
    arr[:] = 1
    return arr


def views(buf: np.ndarray, chunk: int) -> list[memoryview]:
    view = memoryview(buf)
    return [view[i : i + chunk] for i in range(0, buf.nbytes - chunk + 1, chunk)]


def client_name(client: Any) -> str:
    """'<parser> (RESP<n>) + <command packer>' of ``client``'s connections."""
    conn = client.connection_pool.get_connection()
    try:
        return (f"{type(conn._parser).__name__} (RESP{conn.protocol}) + "
                f"{type(conn._command_packer).__name__}")
    finally:
        client.connection_pool.release(conn)


def warm_connections(client: Any, threads: int) -> None:
    """Open ``threads`` pooled connections now, so no timed call pays a connect."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: client.ping(), range(threads * 4)))


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
        fd = os.open(slab.path, os.O_RDONLY)
        try:  # evict the slab's pages: the next load reads the device
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        out["load_cold"] = timed(load)
        return out
    finally:
        slab.close()


def bench_io(args: argparse.Namespace, url: str, clients: dict[str, Any], base: Path
             ) -> list[dict]:
    total = args.total_mib * MiB
    src = prefaulted(total)
    src[:] = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)
    dst = prefaulted(total)
    flush = clients["remote"].flushall
    rows = []
    for chunk in args.chunks:
        count = total // chunk
        srcs, dsts = views(src, chunk), views(dst, chunk)
        nbytes = count * chunk
        best: dict[tuple[str, int], dict] = {}
        for rep in range(args.repeat):
            for threads in args.thread_counts:
                order = list(KINDS)
                order = order[rep % len(order):] + order[: rep % len(order)]  # rotate
                with ThreadPoolExecutor(threads) as pool:
                    for kind in order:
                        tag = f"{kind}-{chunk}-{threads}-{rep}"
                        dst[:nbytes] = 0
                        work = Path(tempfile.mkdtemp(dir=base))
                        try:
                            if kind == "disk":
                                times = run_disk(work, srcs, dsts, chunk, pool)
                            elif kind == "raw":
                                times = run_raw(clients["remote"], srcs, dsts, tag, pool)
                            else:
                                times = run_remote(clients[kind], url, args.timeout_s, srcs,
                                                   dsts, chunk, tag, pool)
                        finally:
                            shutil.rmtree(work, ignore_errors=True)
                            if kind != "disk":
                                flush()
                        if not np.array_equal(dst[:nbytes], src[:nbytes]):
                            raise RuntimeError(f"{tag}: loaded bytes differ from stored bytes")
                        old = best.get((kind, threads), times)  # lowest of each figure
                        best[(kind, threads)] = {k: tuple(map(min, v, old[k]))
                                                 for k, v in times.items()}
        for threads in args.thread_counts:
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


# -- TTFT ------------------------------------------------------------------------------------


def ttft_prompt(length: int, rnd: int) -> str:
    from kv_offload.testing.tiny_model import make_prompt

    seed = 30_000 + length * 10 + rnd  # distinct per (length, round): no shared prefixes
    return make_prompt(length, seed=seed) + make_prompt(SUFFIX_TOKENS, seed=700_000 + seed)


def bench_ttft(args: argparse.Namespace, url: str, base: Path) -> dict:
    from kv_offload.testing.tiny_model import make_prompt, make_tiny_model
    from kv_offload.testing.workload import run_in_subprocess

    model_kwargs = {} if args.quick else dict(TTFT_MODEL)
    model = make_tiny_model(**model_kwargs)
    max_model_len = max(4096, max(args.lengths) + SUFFIX_TOKENS + 64)
    engine = engine_kwargs(in_process=args.in_process, max_model_len=max_model_len,
                           max_num_batched_tokens=max_model_len)
    env = benchmark_env(in_process=args.in_process, vllm_default_binding=False)
    offload = {"cpu_size": "1GiB", "remote_url": url, "remote_timeout_s": args.timeout_s}
    phases: list[dict] = [{"name": "warm-up", "prompts": [make_prompt(64, seed=7)],
                           "max_tokens": 1}]
    for rnd in range(args.rounds):
        prompts = [ttft_prompt(n, rnd) for n in args.lengths]
        common = {"prompts": prompts, "max_tokens": 1, "one_by_one": True}
        phases.append({"name": f"cold-{rnd}", **common})
        # The stores of a request are reported to the scheduler at a later engine step;
        # until then their CPU-tier entries stay pinned and reset_connector keeps them
        # (the remote pass would then hit the CPU tier). One short request that stores
        # nothing steps the engine.
        phases.append({"name": f"flush-{rnd}", "prompts": [make_prompt(32, seed=8 + rnd)],
                       "max_tokens": 1})
        phases.append({"name": f"remote-{rnd}", **common, "reset_prefix_cache": True,
                       "reset_connector": True})
    spec = {"model": str(model), "offload": offload, "engine": engine, "phases": phases}
    started = time.perf_counter()
    out = run_in_subprocess(spec, base / "engine", env=env, timeout_s=1800)
    by_name = {p["name"]: p for p in out["phases"]}
    samples: dict[str, dict[int, list[float]]] = {"cold": {}, "remote": {}}
    mismatches = []
    for rnd in range(args.rounds):
        cold, remote = by_name[f"cold-{rnd}"], by_name[f"remote-{rnd}"]
        if cold["tokens"] != remote["tokens"]:
            mismatches.append(rnd)
        for i, n in enumerate(args.lengths):
            samples["cold"].setdefault(n, []).append(cold["latency_s"][i])
            samples["remote"].setdefault(n, []).append(remote["latency_s"][i])
    remote_hits = sum(by_name[f"remote-{r}"]["metrics"]["hits_external_unspecified"]
                      for r in range(args.rounds))
    expected_hits = args.rounds * sum(args.lengths)
    result: dict[str, Any] = {
        "model": {"name": "test default" if args.quick else "tiny", **model_kwargs},
        "engine": engine, "env": env, "offload": {k: v for k, v in offload.items()
                                                  if k != "remote_url"},
        "lengths": args.lengths, "suffix_tokens": SUFFIX_TOKENS, "rounds": args.rounds,
        "startup_s": round(out["startup_s"], 1),
        "seconds": round(time.perf_counter() - started, 1),
        "modes": {mode: {str(n): {"median_s": statistics.median(v), "samples_s": v}
                         for n, v in per.items()} for mode, per in samples.items()},
        "remote_hit_tokens": remote_hits, "expected_hit_tokens": expected_hits,
        "remote_pass_host_hit_tokens": sum(by_name[f"remote-{r}"]["metrics"]["hits_host"]
                                           for r in range(args.rounds)),
        "cold_external_hit_tokens": sum(by_name[f"cold-{r}"]["metrics"]["external_hits"]
                                        for r in range(args.rounds)),
        "tokens_equal": not mismatches,
    }
    result["ratios"] = {
        str(n): round(result["modes"]["remote"][str(n)]["median_s"]
                      / result["modes"]["cold"][str(n)]["median_s"], 4)
        for n in args.lengths}
    if mismatches:
        result["error"] = f"tokens differ between the cold and remote passes in rounds {mismatches}"
    return result


def slow_ttft(args: argparse.Namespace, server_port: int, base: Path) -> dict:
    """Slow-server TTFT side by side (``_remote_slow``), same model and engine as above."""
    from kv_offload.testing.tiny_model import make_tiny_model

    model = make_tiny_model(**({} if args.quick else dict(TTFT_MODEL)))
    max_model_len = max(4096, max(args.lengths) + SUFFIX_TOKENS + 64)
    engine = engine_kwargs(in_process=args.in_process, max_model_len=max_model_len,
                           max_num_batched_tokens=max_model_len)
    env = benchmark_env(in_process=args.in_process, vllm_default_binding=False)
    return bench_slow_ttft(args, server_port, base, model, engine, env)


# -- report ----------------------------------------------------------------------------------


def render_section(data: dict, img: Path | None, targets: Targets) -> list[str]:
    """The report's remote-tier section: ours against raw SET/GET and the disk tier,
    lookups, TTFT, then what an earlier version measured (templates/remote_history.md)."""
    server, versions, load = data["server"], data["versions"], data["machine"]
    io = [r for r in data["io"] if r["kind"] in KINDS]  # older JSON has more contenders
    lines = fill("remote", server_version=server.get("version", "?"),
                 maxmemory=server.get("maxmemory", "?"), redis=versions.get("redis", "?"),
                 hiredis=versions.get("hiredis", "?"), io_total_mib=data["io_total_mib"],
                 repeat=data["repeat"], header_bytes=data.get("header_bytes", HEADER_BYTES),
                 client_remote=data["clients"]["remote"],
                 load_start=fmt(load["loadavg_start"][0], ".1f"),
                 load_end=fmt(load["loadavg_end"][0], ".1f"))
    lines += table(["chunk KiB", "threads", "contender", "store GB/s", "load GB/s",
                    "load cold GB/s", "store CPU s/GB", "load CPU s/GB"],
                   [[r["chunk"] // KiB, r["threads"], r["contender"],
                     *[fmt(r.get(k), ".2f") for k in ("store_gbps", "load_gbps", "load_cold_gbps",
                                                      "store_cpu_s_per_gb", "load_cpu_s_per_gb")]]
                    for r in io])

    def col(key: str) -> str:
        return span([r[key] for r in data["io_ratios"] if isinstance(r.get(key), (int, float))])

    lines += fill("remote_words", raw_store=col("ours_vs_raw_store"),
                  raw_load=col("ours_vs_raw_load"), disk_store=col("remote_vs_disk_store"),
                  disk_load=col("remote_vs_disk_load"), disk_cold=col("remote_vs_disk_cold_load"),
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


def lookup_table(rows: list[dict]) -> str:
    return "\n".join(table(
        ["keys", "present", "median us", "p99 us", "median us/key", "p99 us/key"],
        [[r["keys"], "all" if r["present"] else "none", fmt(r["median_us"], ".0f"),
          fmt(r["p99_us"], ".0f"), fmt(r["median_us_per_key"], ".1f"),
          fmt(r["p99_us_per_key"], ".1f")] for r in rows]))


def lookup_lines(data: dict) -> list[str]:
    lookup = [r for r in data["lookup"] if r.get("method", "ours") == "ours"]
    by = {(r["keys"], r["present"]): r for r in lookup}
    sixteen = by.get((16, True), {})
    absent = [r["median_us"] / by[(k, True)]["median_us"]
              for (k, hit), r in by.items() if not hit and (k, True) in by]
    lines = fill("remote_lookup", calls=lookup[0]["calls"], client_ours=data["clients"]["remote"],
                 median16=fmt(sixteen.get("median_us"), ".0f"),
                 p99_16=fmt(sixteen.get("p99_us"), ".0f"), absent=span(absent),
                 table=lookup_table(lookup))
    cluster = [r for r in data.get("lookup_cluster", []) if r.get("method", "ours") == "ours"]
    sched = data.get("scheduler_thread")
    if cluster and sched:
        lines += fill("remote_scheduler", cluster_table=lookup_table(cluster),
                      budget_ms=f"{sched['budget_ms']:.0f}", table="\n".join(table(
                          ["server", "lookup", "requests", "thread us median", "thread us p99",
                           "answer ms median", "answer ms max", "requests with hits"],
                          [[r["label"], r["method"], r["requests"],
                            fmt(r["thread_us_median"], ".1f"), fmt(r["thread_us_p99"], ".1f"),
                            fmt(r["answer_ms_median"], ".2f"), fmt(r["answer_ms_max"], ".2f"),
                            r["hit_requests"]] for r in sched["rows"]])))
    return lines


def ttft_lines(ttft: dict | None) -> list[str]:
    if not ttft or "modes" not in ttft:
        return [f"**TTFT.** Not measured: {(ttft or {}).get('error', 'no data')}.", ""]
    lengths = [str(n) for n in ttft["lengths"]]
    in_process = ttft["env"].get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    rows = [[mode, *[fmt(ttft["modes"][mode][n]["median_s"] * 1e3, ".1f") for n in lengths]]
            for mode in ("cold", "remote")]
    rows.append(["remote / cold", *[fmt(ttft["ratios"][n]) for n in lengths]])
    return fill(
        "remote_ttft", model=ttft["model"]["name"], offload=ttft["offload"], env=ttft["env"],
        rounds=ttft["rounds"], suffix_tokens=ttft["suffix_tokens"],
        in_process="**This run used the single-process engine (--quick). There, remote loads "
                   "were several times slower than with vLLM's default engine processes (the "
                   "I/O threads share one interpreter, and its GIL, with the engine loop): "
                   "these figures are not representative.**\n\n" if in_process else "",
        table="\n".join(table(["TTFT", *[f"L={n} (ms)" for n in lengths]], rows)),
        ratios=", ".join(f"{fmt(ttft['ratios'][n], '.2f')}x at {n} tokens" for n in lengths),
        hits=fmt(ttft["remote_hit_tokens"], ".0f"), expected=fmt(ttft["expected_hit_tokens"], ".0f"),
        host_hits=fmt(ttft["remote_pass_host_hit_tokens"], ".0f"),
        tokens_equal=ttft["tokens_equal"], startup=fmt(ttft["startup_s"], ".0f"))


def slow_ttft_lines(slow: dict | None, targets: Targets) -> list[str]:
    """The slow-server TTFT (``_remote_slow``) and its target row."""
    if not slow:
        return []
    if "error" in slow:
        return [f"**TTFT with a slow server.** Not measured: {slow['error']}.", ""]
    cases = [(kind, str(n)) for kind in ("local", "fresh") for n in slow["lengths"]]
    ratios = [slow["ratios"][kind][n] for kind, n in cases]
    targets.add(f"Remote tier behind a server held {slow['delay_ms'][0]:.0f}-"
                f"{slow['delay_ms'][1]:.0f} ms: TTFT <= {SLOW_TARGET}x without a remote tier "
                f"({sum(r <= SLOW_TARGET for r in ratios)} of {len(ratios)} cases)",
                max(ratios), f"<= {SLOW_TARGET} (worst case shown)",
                all(r <= SLOW_TARGET for r in ratios), "bench_remote")
    return fill("remote_slow", low=f"{slow['delay_ms'][0]:.0f}", high=f"{slow['delay_ms'][1]:.0f}",
                rounds=slow["rounds"], tokens_equal=slow["tokens_equal"],
                local_hits=slow["local_hit_tokens"], table="\n".join(table(
                    ["prompts", "L", "no remote tier (ms)", "remote tier (ms)", "ratio of medians",
                     "median of paired ratios", "verdict"],
                    [[kind, n, fmt(slow["median_s"]["plain"][kind][n] * 1e3, ".1f"),
                      fmt(slow["median_s"]["remote"][kind][n] * 1e3, ".1f"),
                      fmt(slow["ratios"][kind][n]), fmt(slow["paired_ratio_medians"][kind][n]),
                      verdict(slow["ratios"][kind][n] <= SLOW_TARGET)] for kind, n in cases])))


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


# -- main -------------------------------------------------------------------------------------


def warn_hits(ttft: dict) -> None:
    """Say so when the remote pass did not load (all of) its prefixes from Redis."""
    if "remote_hit_tokens" not in ttft:
        return
    if ttft["remote_hit_tokens"] == 0:
        print("WARNING: vLLM counted no tokens loaded from the remote tier "
              "(hits_external_unspecified is 0): the remote TTFT is not a remote hit",
              file=sys.stderr, flush=True)
    elif ttft["remote_hit_tokens"] < ttft["expected_hit_tokens"]:
        print(f"WARNING: the remote pass loaded {ttft['remote_hit_tokens']:.0f} of "
              f"{ttft['expected_hit_tokens']} prefix tokens from the remote tier "
              f"({ttft['remote_pass_host_hit_tokens']:.0f} from the CPU tier)",
              file=sys.stderr, flush=True)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("redis", "hiredis"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if server_binary() is None:
        sys.exit("bench_remote: redis-server not found (apt-get install redis-server)")
    base = Path(tempfile.mkdtemp(prefix="kv-offload-remote-", dir=args.dir))
    started = time.perf_counter()
    server = RedisServer(base / "redis", maxmemory=args.maxmemory)
    clients: dict[str, Any] = {}
    result: dict[str, Any] = {
        "bench": "remote", "command": command_line(),
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_start": os.getloadavg()},
        "io_total_mib": args.total_mib, "repeat": args.repeat, "timeout_s": args.timeout_s,
        "header_bytes": HEADER_BYTES, "versions": versions(),
    }
    failed = False
    try:
        server.start()
        target = RemoteTarget(server.url)
        clients = {"remote": connect_redis(target, args.timeout_s)}
        info = clients["remote"].info("server")
        result["server"] = {"version": info.get("redis_version"), "maxmemory": args.maxmemory,
                            "binary": server_binary()}
        result["clients"] = {kind: client_name(client) for kind, client in clients.items()}
        if result["versions"]["hiredis"] == "not installed":
            print("WARNING: hiredis is not installed: the client parses with redis-py's "
                  "Python parser", file=sys.stderr, flush=True)
        for client in clients.values():
            warm_connections(client, max(args.thread_counts))
        print(f"redis-server {result['server']['version']} at {server.url}; clients "
              f"{result['clients']}", flush=True)
        result["io"] = bench_io(args, server.url, clients, base)
        result["io_ratios"] = io_ratios(result["io"])
        result["lookup"] = bench_lookup(args, server.url, clients["remote"])
        result["lookup_cluster"] = bench_cluster_lookup(args, base / "cluster")
        print("  lookups done", flush=True)
        result["scheduler_thread"] = bench_scheduler_thread(args, server.port)
        print("  scheduler thread with slow servers done", flush=True)
        if args.no_engine:
            result["ttft"] = {"error": "skipped (--no-engine)"}
        else:
            try:
                result["ttft"] = bench_ttft(args, server.url, base)
            except Exception as exc:  # keep the I/O figures; fail at the end
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                result["ttft"] = {"error": f"{type(exc).__name__}: {first}"}
                print(str(exc)[-4000:], file=sys.stderr)
                args.keep = True
            failed = "error" in result["ttft"] and not args.no_engine
            warn_hits(result["ttft"])
            try:
                if not args.no_slow_ttft:
                    result["slow_ttft"] = slow_ttft(args, server.port, base)
            except Exception as exc:  # keep the other figures; fail at the end
                result["slow_ttft"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(str(exc)[-4000:], file=sys.stderr)
                failed = True
    finally:
        for client in clients.values():
            client.close()
        server.stop()
        if args.keep:
            print(f"kept {base}", file=sys.stderr)
        else:
            shutil.rmtree(base, ignore_errors=True)
    result["machine"]["loadavg_end"] = os.getloadavg()
    result["seconds"] = round(time.perf_counter() - started, 1)
    finish(result, args.json, render_section)
    if failed:
        raise SystemExit(f"bench_remote: TTFT part failed: {result['ttft']['error']}")
    return result


if __name__ == "__main__":
    main()
