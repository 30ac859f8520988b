"""Remote tier (Redis/Valkey) benchmarks, next to the disk tier, in one run on one machine.

A throwaway ``redis-server`` is started on loopback (stopped again whatever happens) and
every contender moves the same bytes:

1. I/O: store and load N chunks of 256 KiB, 2 MiB and 8 MiB with 1 and 4 threads (a
   ThreadPoolExecutor, like the worker's I/O pool). Every remote contender stores and
   loads the connector's value format (40-byte header + payload, checksum verified on
   load by ``RemoteTier.read_into``); they differ in the redis-py client:
   - ours: ``RemoteTier.write`` / ``read_into`` on the connector's own client
     (``connect_redis``): hiredis parses replies; kv-offload packs the commands and sends
     a value's header and payload as their own buffers (no copy);
   - ours, Python parser: the same with redis-py's pure-Python reply parser, i.e. what
     ``connect_redis`` gives on a machine without hiredis (only the parser differs);
   - redis-py default (hiredis): ``redis.Redis.from_url`` with hiredis installed (hiredis
     parser and hiredis packer), what the connector used before it had its own packer;
   - redis-py pure Python: redis-py's Python parser and Python packer (no hiredis at all).
     On both redis-py clients a store is ``client.set`` of the value joined into one
     bytearray, so the client's own packer sends it (``client_set_write``: what
     ``RemoteTier.write`` did before kv-offload packed values itself); loads are
     ``RemoteTier.read_into``;
   - raw SET/GET: plain ``SET`` / ``GET`` of the payload with no header and no checksum,
     on ours' client, the GET's bytes copied into the preallocated host slot: the yardstick
     for ``read_into``, which receives the value straight into the slot and verifies its
     checksum there;
   - disk slab: the disk tier's ``SlabFile.write`` / ``read`` with verification, in a
     temp dir on this machine; loads warm (page cache) and cold (evicted with
     POSIX_FADV_DONTNEED after fsync).
   Per contender: GB/s, and the client's CPU seconds (this process, all threads, user +
   system; the server is not counted) and minor page faults per GB / MB moved, each the
   lowest of the runs. The server (single-threaded, on the same cores) limits the GB/s
   too; the CPU figure is what a store or load costs the worker process itself.
   Ratios: ours / redis-py default, ours / pure Python, hiredis / Python parser (ours vs
   ours with the Python parser), ours / raw SET/GET, remote (ours) / disk; GB/s and CPU.
2. Lookup of 16, 64 and 256 keys, every key present or none: ``RemoteTier.lookup`` (on
   a standalone server one read-only Lua script that returns the present prefix's
   length) on ours and on ours with the Python parser, next to a redis-py pipeline
   (``pipeline(transaction=False)``) of the same EXISTS commands on the redis-py default
   client with hiredis, which is how ``lookup`` worked before. Median and p99 per request
   and median microseconds per key. The same against a 3-node cluster on loopback: ours
   (one pipeline per node, sent to every node before any reply is read) against
   redis-py's cluster pipeline (before).
   Scheduler thread: a miniature scheduler (one request arrives per 2 ms step, every
   waiting request is asked again each step) with the server direct, behind a proxy
   holding each reply 10-15 ms (within the 20 ms budget) and 50-200 ms (past it):
   microseconds the scheduler thread spends per request in ``RemoteLookups.ask``
   (asynchronous, now) and in ``RemoteTier.lookup`` (synchronous, before), and how long
   each request waited for its answer.
3. TTFT with a slow server: see ``_remote_slow`` (local hits and fresh prompts, remote
   tier behind a proxy holding each reply 50-200 ms vs no remote tier, side by side).
4. TTFT: one vLLM engine (CPU backend, tiny random-weight model) with ``remote_url`` set
   and no disk tier; per round, a cold pass over prompts of L + 16 tokens (one request
   at a time, max_tokens=1), one short request that lets the engine collect the store
   reports, then the same prompts after ``reset_prefix_cache(reset_connector=True)``, so
   that the KV comes from Redis. Median TTFT of each and their ratio; the script fails
   when the tokens of the two passes differ and warns when vLLM counted no (or not all)
   remote hits. --quick runs the engine in one process (faster start, not the default
   topology: its remote TTFT means nothing, see docs/benchmarks.md).

    python benchmarks/bench_remote.py --quick --json /tmp/remote.json   # ~30 s
    python benchmarks/bench_remote.py --json remote.json                # ~5 min, 2 cores
"""

from __future__ import annotations

import argparse
import json
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
from _engine import benchmark_env, engine_kwargs  # noqa: E402
from _remote_lookups import (  # noqa: E402
    bench_cluster_lookup,
    bench_lookup,
    bench_scheduler_thread,
    chunk_keys,
)
from _remote_slow import bench_slow_ttft  # noqa: E402

from kv_offload.disk import SlabFile  # noqa: E402
from kv_offload.remote.resp import RespPacker  # noqa: E402
from kv_offload.remote.tier import RemoteTarget, RemoteTier, connect_redis  # noqa: E402
from kv_offload.remote.values import HEADER_BYTES, ValueCheck, encode_header  # noqa: E402
from kv_offload.testing.redis_server import RedisServer, server_binary  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
NAMESPACE = "bench"
SUFFIX_TOKENS = 16
# Same geometry as bench_ttft's default model (its cached files are reused).
TTFT_MODEL = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                  max_position=16384)
KINDS = {  # I/O contender -> label; every one but raw and disk runs RemoteTier
    "remote": "ours (hiredis parser + zero-copy packer)",
    "remote_pyparser": "ours, Python parser (no hiredis)",
    "redispy_hiredis": "redis-py default (hiredis)",
    "redispy_python": "redis-py pure Python (no hiredis)",
    "raw": "raw SET/GET (ours' client)",
    "disk": "disk slab",
}
REDISPY = ("redispy_hiredis", "redispy_python")  # stores: client_set_write

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes for a smoke test")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
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


def connect_client(target: RemoteTarget, timeout_s: float, *, python_parser: bool = False,
                   packer: str = "default") -> Any:
    """A standalone redis-py client with ``connect_redis``'s timeouts and no retries.

    ``python_parser``: redis-py's pure-Python reply parser instead of hiredis's.
    ``packer``: "ours" (kv-offload's ``RespPacker``, as ``connect_redis``), "python"
    (redis-py's pure-Python packer) or "default" (what redis-py picks: hiredis's when
    hiredis is installed). The default parser and packer with hiredis installed are
    redis-py's default client; both Python ones are what a machine without hiredis gets.
    """
    import redis
    from redis._parsers.encoders import Encoder
    from redis.backoff import NoBackoff
    from redis.connection import PythonRespSerializer, _RESP2Parser
    from redis.retry import Retry

    extra: dict[str, Any] = {}
    if python_parser:
        # redis-py swaps _RESP2Parser for its RESP3 twin when the protocol is 3 (its
        # default): either way pure Python, on the same protocol as the hiredis client.
        extra["parser_class"] = _RESP2Parser
    if packer == "ours":
        extra["command_packer"] = RespPacker()
    elif packer == "python":  # what redis-py packs commands with when hiredis is missing
        extra["command_packer"] = PythonRespSerializer(6000, Encoder("utf-8", "strict",
                                                                     False).encode)
    elif packer != "default":
        raise ValueError(f"packer: {packer!r}")
    return redis.Redis.from_url(target.url, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                **extra)


def client_set_write(client: Any, tier: RemoteTier, chunk_key: bytes, rank: int,
                     payload: memoryview) -> bool:
    """A store through ``client.set``, hence through the client's own command packer: the
    value (``RemoteTier``'s header + payload) joined into one bytearray first. This is what
    ``RemoteTier.write`` did before kv-offload packed values itself (``RemoteTier.write``
    now packs with ``kv_offload.remote.resp`` whatever the client, so calling it would not
    measure the client's packer). Raises on failure."""
    name = tier.name(chunk_key, rank)
    value = bytearray(HEADER_BYTES + len(payload))
    value[:HEADER_BYTES] = encode_header(name, payload)
    value[HEADER_BYTES:] = payload
    client.set(name, value, ex=tier.ttl_s)
    return True


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
               dsts: list[memoryview], chunk: int, tag: str, pool: ThreadPoolExecutor,
               *, client_set: bool = False) -> dict:
    """RemoteTier.read_into loads; stores by RemoteTier.write, or by ``client_set_write``
    (through the client's own packer) when ``client_set``."""
    tier = RemoteTier(RemoteTarget(url), namespace=NAMESPACE, num_ranks=1, payload_bytes=chunk,
                      timeout_s=timeout_s, connect=lambda _target, _timeout: client)
    keys = chunk_keys(tag, len(srcs))
    if client_set:
        def write(i: int) -> bool:
            return client_set_write(client, tier, keys[i], 0, srcs[i])
    else:
        def write(i: int) -> bool:
            return tier.write(keys[i], 0, srcs[i])

    def store() -> None:
        ok = list(pool.map(write, range(len(keys))))
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
                                                   dsts, chunk, tag, pool,
                                                   client_set=kind in REDISPY)
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
    """Per chunk size and thread count: GB/s over GB/s (> 1: the first is faster) and, in
    the ``*_cpu`` keys, client CPU per GB over client CPU per GB (< 1: the first costs less)."""
    by = {(r["chunk"], r["threads"], r["kind"]): r for r in rows}
    out = []
    for chunk, threads in sorted({(r["chunk"], r["threads"]) for r in rows}):
        def ratio(a: str, b: str, key_a: str, key_b: str | None = None,
                  c: int = chunk, t: int = threads) -> float | None:
            x, y = by.get((c, t, a), {}).get(key_a), by.get((c, t, b), {}).get(key_b or key_a)
            return round(x / y, 3) if x and y else None

        row: dict[str, Any] = {"chunk": chunk, "threads": threads}
        for op in ("store", "load"):
            row[f"ours_vs_redispy_hiredis_{op}"] = ratio("remote", "redispy_hiredis",
                                                         f"{op}_gbps")
            row[f"ours_vs_redispy_python_{op}"] = ratio("remote", "redispy_python", f"{op}_gbps")
            # ours with hiredis's parser over ours with redis-py's Python parser
            row[f"hiredis_vs_python_parser_{op}"] = ratio("remote", "remote_pyparser",
                                                          f"{op}_gbps")
            # redis-py's default client: all hiredis over all Python
            row[f"redispy_hiredis_vs_python_{op}"] = ratio("redispy_hiredis", "redispy_python",
                                                           f"{op}_gbps")
            # client CPU seconds per GB, ours over theirs (< 1: ours costs the client less)
            row[f"ours_vs_redispy_hiredis_{op}_cpu"] = ratio("remote", "redispy_hiredis",
                                                             f"{op}_cpu_s_per_gb")
            row[f"ours_vs_redispy_python_{op}_cpu"] = ratio("remote", "redispy_python",
                                                            f"{op}_cpu_s_per_gb")
            row[f"hiredis_vs_python_parser_{op}_cpu"] = ratio("remote", "remote_pyparser",
                                                              f"{op}_cpu_s_per_gb")
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


# -- main -------------------------------------------------------------------------------------


RATIO_COLUMNS = (  # io_ratios key -> short header
    ("ours_vs_redispy_hiredis_store", "ours/rp-hi st"), ("ours_vs_redispy_hiredis_load", "ld"),
    ("ours_vs_redispy_python_store", "ours/rp-py st"), ("ours_vs_redispy_python_load", "ld"),
    ("hiredis_vs_python_parser_load", "hi/py-parse ld"), ("ours_vs_raw_store", "ours/raw st"),
    ("ours_vs_raw_load", "ld"), ("remote_vs_disk_store", "ours/disk st"),
    ("remote_vs_disk_load", "ld"), ("remote_vs_disk_cold_load", "ld cold"),
    ("ours_vs_redispy_hiredis_store_cpu", "cpu ours/rp-hi st"),
    ("ours_vs_redispy_python_store_cpu", "cpu ours/rp-py st"),
    ("hiredis_vs_python_parser_load_cpu", "cpu hi/py-parse ld"),
)


def print_tables(result: dict) -> None:
    load = result["machine"]["loadavg_start"][0], result["machine"]["loadavg_end"][0]
    print(f"\nRemote tier vs disk tier ({result['io_total_mib']} MiB per chunk size and contender,"
          f" fastest of {result['repeat']}; GB/s; load average {load[0]:.1f} -> {load[1]:.1f})")
    print(f"{'chunk':>8} {'thr':>3} {'contender':<42} {'store':>7} {'load':>7} {'ld cold':>8}"
          f" {'cpu st':>7} {'cpu ld':>7}   (cpu: client CPU s per GB)")
    for r in result["io"]:
        cold = r.get("load_cold_gbps")
        cold_text = "-" if cold is None else f"{cold:.2f}"
        print(f"{r['chunk'] // KiB:>4} KiB {r['threads']:>3} {r['contender']:<42} "
              f"{r['store_gbps']:>7.2f} {r['load_gbps']:>7.2f} {cold_text:>8} "
              f"{r['store_cpu_s_per_gb']:>7.3f} {r['load_cpu_s_per_gb']:>7.3f}")
    print("\nRatios (GB/s over GB/s; cpu: client CPU per GB over client CPU per GB; ours = "
          "RemoteTier on connect_redis; rp-hi / rp-py: redis-py's default client with / without "
          "hiredis; hi/py-parse: ours over ours with the Python parser)")
    print(f"{'chunk':>8} {'thr':>3}" + "".join(f"{name:>19}" for _, name in RATIO_COLUMNS))
    for r in result["io_ratios"]:
        print(f"{r['chunk'] // KiB:>4} KiB {r['threads']:>3}" + "".join(
            f"{'-' if r.get(k) is None else format(r[k], '.2f'):>19}" for k, _ in RATIO_COLUMNS))
    print(f"\nLookup (us per request; clients {result['lookup_clients']})")
    print(f"{'keys':>5} {'present':>8} {'method':<38} {'median':>9} {'p99':>9} {'us/key':>8}")
    for r in result["lookup"]:
        print(f"{r['keys']:>5} {('all' if r['present'] else 'none'):>8} {r['label']:<38} "
              f"{r['median_us']:>9.1f} {r['p99_us']:>9.1f} {r['median_us_per_key']:>8.2f}")
    print(f"{'keys':>5} {'present':>8} {'pipeline / ours':>18} {'Python / hiredis parser':>25}")
    for r in result["lookup_ratios"]:
        print(f"{r['keys']:>5} {('all' if r['present'] else 'none'):>8} "
              f"{r['pipeline_vs_ours']:>18.2f} {r['python_vs_hiredis_parser']:>25.2f}")
    print_lookup_tables(result)
    print_slow_ttft(result.get("slow_ttft"))
    ttft = result.get("ttft")
    if ttft and "modes" in ttft:
        print(f"\nTTFT, median ms (prefix L + {ttft['suffix_tokens']} tokens, {ttft['rounds']} "
              f"rounds; model {ttft['model']['name']}; remote hits {ttft['remote_hit_tokens']:.0f}"
              f" of {ttft['expected_hit_tokens']} tokens; tokens equal: {ttft['tokens_equal']})")
        print(f"{'mode':<8}" + "".join(f"{'L=' + str(n):>10}" for n in ttft["lengths"]))
        for mode in ("cold", "remote"):
            print(f"{mode:<8}" + "".join(
                f"{ttft['modes'][mode][str(n)]['median_s'] * 1e3:>10.1f}" for n in ttft["lengths"]))
        print(f"{'ratio':<8}" + "".join(f"{ttft['ratios'][str(n)]:>10.3f}" for n in ttft["lengths"]))
    elif ttft:
        print(f"\nTTFT: {ttft.get('error', 'skipped')}")


def print_lookup_tables(result: dict) -> None:
    print("\nCluster lookup (3 nodes; us per request)")
    print(f"{'keys':>5} {'present':>8} {'method':<42} {'median':>9} {'p99':>9} {'us/key':>8}")
    for r in result.get("lookup_cluster", []):
        print(f"{r['keys']:>5} {('all' if r['present'] else 'none'):>8} {r['label']:<42} "
              f"{r['median_us']:>9.1f} {r['p99_us']:>9.1f} {r['median_us_per_key']:>8.2f}")
    sched = result.get("scheduler_thread")
    if not sched:
        return
    print(f"\nScheduler thread per request (budget {sched['budget_ms']:.0f} ms; thread: us "
          "spent in lookup calls on the scheduler thread; answer: ms from arrival)")
    print(f"{'server':<14} {'method':<26} {'thread med':>11} {'thread p99':>11} "
          f"{'answer med':>11} {'answer max':>11} {'hits':>5}")
    for r in sched["rows"]:
        print(f"{r['server']:<14} {r['method']:<26} {r['thread_us_median']:>11.1f} "
              f"{r['thread_us_p99']:>11.1f} {r['answer_ms_median']:>11.2f} "
              f"{r['answer_ms_max']:>11.2f} {r['hit_requests']:>5}")


def print_slow_ttft(slow: dict | None) -> None:
    if not slow:
        return
    if "error" in slow:
        print(f"\nSlow-server TTFT: {slow['error']}")
        return
    low, high = slow["delay_ms"]
    print(f"\nTTFT with Redis replies held {low:.0f}-{high:.0f} ms, median ms over "
          f"{slow['rounds']} rounds (remote tier on vs none; tokens equal: "
          f"{slow['tokens_equal']}; local hits: {slow['local_hit_tokens']})")
    print(f"{'kind':<7} {'length':>7} {'no remote':>10} {'remote':>8} {'ratio':>7} "
          f"{'paired':>7}")
    for kind in ("local", "fresh"):
        for n in slow["lengths"]:
            plain = slow["median_s"]["plain"][kind][str(n)] * 1e3
            remote = slow["median_s"]["remote"][kind][str(n)] * 1e3
            print(f"{kind:<7} {n:>7} {plain:>10.1f} {remote:>8.1f} "
                  f"{slow['ratios'][kind][str(n)]:>7.3f} "
                  f"{slow['paired_ratio_medians'][kind][str(n)]:>7.3f}")


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
        "bench": "remote", "command": " ".join([Path(sys.executable).name, *sys.argv]),
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
        clients = {"remote": connect_redis(target, args.timeout_s),
                   "remote_pyparser": connect_client(target, args.timeout_s, python_parser=True,
                                                     packer="ours"),
                   "redispy_hiredis": connect_client(target, args.timeout_s),
                   "redispy_python": connect_client(target, args.timeout_s, python_parser=True,
                                                    packer="python")}
        info = clients["remote"].info("server")
        result["server"] = {"version": info.get("redis_version"), "maxmemory": args.maxmemory,
                            "binary": server_binary()}
        result["clients"] = {kind: client_name(client) for kind, client in clients.items()}
        result["lookup_clients"] = {"ours": result["clients"]["remote"],
                                    "ours_python": result["clients"]["remote_pyparser"],
                                    "redispy_pipeline": result["clients"]["redispy_hiredis"]}
        if result["versions"]["hiredis"] == "not installed":
            print("WARNING: hiredis is not installed: every client parses with redis-py's "
                  "Python parser", file=sys.stderr, flush=True)
        for client in clients.values():
            warm_connections(client, max(args.thread_counts))
        print(f"redis-server {result['server']['version']} at {server.url}; clients "
              f"{result['clients']}", flush=True)
        result["io"] = bench_io(args, server.url, clients, base)
        result["io_ratios"] = io_ratios(result["io"])
        lookup = bench_lookup(args, server.url, clients)
        result["lookup"], result["lookup_ratios"] = lookup["rows"], lookup["ratios"]
        cluster = bench_cluster_lookup(args, base / "cluster")
        result["lookup_cluster"], result["lookup_cluster_ratios"] = (cluster["rows"],
                                                                     cluster["ratios"])
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
    print_tables(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    if failed:
        raise SystemExit(f"bench_remote: TTFT part failed: {result['ttft']['error']}")
    return result


if __name__ == "__main__":
    main()
