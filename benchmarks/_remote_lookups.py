"""bench_remote's lookup figures: ``RemoteTier.lookup``'s latency (standalone, cluster)
and the scheduler thread's time per request with ``RemoteLookups`` (templates/remote*.md)."""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import span
from _markdown import fill, fmt, table

from kv_offload.config import OffloadConfig
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.remote.tier import RemoteTarget, RemoteTier
from kv_offload.testing.redis_server import RedisCluster, SlowProxy
from kv_offload.testing.soak import percentile

NAMESPACE = "bench"
BUDGET_S = OffloadConfig.remote_lookup_budget_ms / 1000  # the default budget
SERVERS = {  # scenario -> (label, proxy delay range or None for the server itself)
    "fast": ("loopback, no delay", None),
    "within_budget": (f"replies held 10-15 ms (within the {BUDGET_S * 1e3:.0f} ms budget)",
                      (0.010, 0.015)),
    "slow": ("replies held 50-200 ms (past the budget)", (0.050, 0.200)),
}


def chunk_keys(tag: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(count)]


def _time_lookups(lookup: Callable[[list[bytes]], int], sizes: list[int], calls: int,
                  present: list[bytes], absent: list[bytes]) -> list[dict]:
    """Median and p99 microseconds of ``lookup`` per (keys, all present or none); the
    cases take turns in a new random order each round."""
    cases = [(n, hit) for n in sizes for hit in (True, False)]
    samples: dict[tuple, list[float]] = {case: [] for case in cases}
    for n, hit in cases:  # untimed warm-up of each case
        lookup((present if hit else absent)[:n])
    rng = random.Random(0)
    for _ in range(calls):
        order = cases[:]
        rng.shuffle(order)
        for n, hit in order:
            start = time.perf_counter()
            found = lookup((present if hit else absent)[:n])
            samples[(n, hit)].append(time.perf_counter() - start)
            if found != (n if hit else 0):
                raise RuntimeError(f"lookup of {n} keys found {found}, expected "
                                   f"{n if hit else 0}")
    rows = []
    for (n, hit), times in samples.items():
        us = [t * 1e6 for t in times]
        p99, med = percentile(us, 0.99), statistics.median(us)
        rows.append({"keys": n, "present": hit, "calls": len(us), "median_us": round(med, 1),
                     "p99_us": round(p99, 1), "median_us_per_key": round(med / n, 2),
                     "p99_us_per_key": round(p99 / n, 2)})
    return rows


def lookup_parts(args: argparse.Namespace, server: Any, client: Any, base: Path,
                 result: dict) -> None:
    """The lookup figures, into ``result``: per (keys, all present or none), the latency of
    one ``RemoteTier.lookup`` on ``client`` (``connect_redis``'s: on a standalone server one
    read-only Lua script) and on a 3-node cluster on loopback (one pipeline per node, all
    sent before any reply is read); then the scheduler thread's time per request."""
    tier = RemoteTier(RemoteTarget(server.url), namespace=NAMESPACE, num_ranks=1,
                      payload_bytes=4096, timeout_s=args.timeout_s, connect=lambda _t, _s: client)
    result["lookup"] = _tier_lookups(tier, args, "lookup", args.lookup_calls)
    client.flushall()
    with RedisCluster(base / "cluster") as cluster:
        tier = RemoteTier(RemoteTarget(cluster_nodes=tuple(cluster.seeds)), namespace=NAMESPACE,
                          num_ranks=1, payload_bytes=4096, timeout_s=args.timeout_s)
        result["lookup_cluster"] = _tier_lookups(tier, args, "cluster",
                                                 max(10, args.lookup_calls // 4))
        tier.close()
    print("  lookups done", flush=True)
    result["scheduler_thread"] = bench_scheduler_thread(args, server.port)
    print("  scheduler thread with slow servers done", flush=True)


def _tier_lookups(tier: RemoteTier, args: argparse.Namespace, tag: str, calls: int) -> list[dict]:
    """Write the present keys through ``tier``, then time its lookups (``_time_lookups``)."""
    largest = max(args.lookup_keys)
    present = chunk_keys(f"{tag}-present", largest)
    if not all(tier.write(k, 0, memoryview(bytes(4096))) for k in present):
        raise RuntimeError(f"{tag}: could not write the present keys")
    rows = _time_lookups(tier.lookup, args.lookup_keys, calls, present,
                         chunk_keys(f"{tag}-absent", largest))
    if tier.health.num_failures:  # errors answer 0
        raise RuntimeError(f"{tag}: RemoteTier recorded failures")
    return rows


def _simulate(tier: RemoteTier, keys: list[list[bytes]], step_s: float) -> list[dict]:
    """vLLM's scheduler in miniature: one request arrives per step; every step asks each
    waiting request again (``RemoteLookups.ask``). Per request: seconds spent in the asks
    on this (the scheduler) thread, seconds from arrival to an answer, the answer."""
    out: list[dict] = []
    lookups = RemoteLookups(tier, budget_s=BUDGET_S)
    waiting: dict[str, dict] = {}
    try:
        for i in range(len(keys) + 100_000):
            if i < len(keys):
                waiting[str(i)] = {"i": i, "thread_s": 0.0, "arrived": time.perf_counter()}
            for req_id, state in list(waiting.items()):
                start = time.perf_counter()
                hits = lookups.ask(req_id, keys[state["i"]])
                now = time.perf_counter()
                state["thread_s"] += now - start
                if hits is not None:
                    lookups.forget(req_id)
                    del waiting[req_id]
                    out.append({"thread_s": state["thread_s"], "wait_s": now - state["arrived"],
                                "hits": hits})
            if i >= len(keys) and not waiting:
                break
            time.sleep(step_s)
    finally:
        lookups.close()
    return out


def bench_scheduler_thread(args: argparse.Namespace, server_port: int) -> dict:
    """Scheduler-thread time per request with ``RemoteLookups.ask``, the scheduler's tier
    built as the connector builds it (``remote_timeout_s`` per call, the default budget)."""
    requests = 20 if args.quick else 100
    rows = []
    for scenario, (label, delay) in SERVERS.items():
        proxy = SlowProxy(server_port, delay_s=delay).start() if delay else None
        url = proxy.url if proxy else f"redis://127.0.0.1:{server_port}/0"
        tier = RemoteTier(RemoteTarget(url), namespace=NAMESPACE, num_ranks=1,
                          payload_bytes=4096, timeout_s=args.timeout_s,
                          lookup_budget_s=BUDGET_S)
        half = chunk_keys(f"sched-{scenario}", 8)
        direct = RemoteTier(RemoteTarget(f"redis://127.0.0.1:{server_port}/0"),
                            namespace=NAMESPACE, num_ranks=1, payload_bytes=4096,
                            timeout_s=args.timeout_s)
        if not all(direct.write(k, 0, memoryview(bytes(4096))) for k in half[:4]):
            raise RuntimeError("scheduler thread: could not write the present keys")
        direct.close()
        keys = [half if i % 2 else chunk_keys(f"cold-{scenario}-{i}", 8) for i in range(requests)]
        try:
            got = _simulate(tier, keys, step_s=0.002)
        finally:
            tier.close()
            if proxy:
                proxy.stop()
        thread_us = sorted(r["thread_s"] * 1e6 for r in got)
        wait_ms = sorted(r["wait_s"] * 1e3 for r in got)
        rows.append({
            "server": scenario, "label": label, "method": "RemoteLookups.ask",
            "requests": len(got),
            "thread_us_median": round(statistics.median(thread_us), 1),
            "thread_us_p99": round(percentile(thread_us, 0.99), 1),
            "thread_us_total_per_request": round(sum(thread_us) / len(got), 1),
            "answer_ms_median": round(statistics.median(wait_ms), 2),
            "answer_ms_max": round(wait_ms[-1], 2),
            "hit_requests": sum(r["hits"] > 0 for r in got)})
    return {"budget_ms": BUDGET_S * 1e3, "rows": rows}


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
                 budget_ms=f"{data.get('scheduler_thread', {}).get('budget_ms', 20):.0f}",
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
