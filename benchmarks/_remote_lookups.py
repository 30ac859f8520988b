"""bench_remote's lookup figures: latency per request and per key (standalone and
cluster), and the scheduler thread's time per request with a fast, a slowish and a slow
server (``RemoteLookups`` against the synchronous lookup it replaced).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from kv_offload.remote.lookups import RemoteLookups
from kv_offload.remote.tier import RemoteTarget, RemoteTier
from kv_offload.testing.redis_server import RedisCluster, SlowProxy

NAMESPACE = "bench"
LOOKUPS = {  # lookup method -> label
    "ours": "RemoteTier.lookup (ours)",
    "ours_python": "RemoteTier.lookup, Python parser",
    "redispy_pipeline": "redis-py pipeline (default, hiredis)",
}
CLUSTER_LOOKUPS = {
    "ours": "RemoteTier.lookup (one call per node)",
    "redispy_cluster_pipeline": "redis-py cluster pipeline (before)",
}
BUDGET_S = 0.020  # remote_lookup_budget_ms's default
SERVERS = {  # scenario -> (label, proxy delay range or None for the server itself)
    "fast": ("loopback, no delay", None),
    "within_budget": ("replies held 10-15 ms (within the 20 ms budget)", (0.010, 0.015)),
    "slow": ("replies held 50-200 ms (past the budget)", (0.050, 0.200)),
}


def chunk_keys(tag: str, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(count)]


def pipeline_lookup(client: Any, tier: RemoteTier, keys: list[bytes]) -> int:
    """What ``RemoteTier.lookup`` did before it had its own pipeline: a redis-py pipeline
    (no transaction) of one EXISTS per chunk key on ``client`` (a cluster client routes
    each to its node)."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(*(tier.name(key, r) for r in range(tier.num_ranks)))
    hits = 0
    for count in pipe.execute():
        if count != tier.num_ranks:
            break
        hits += 1
    return hits


def _percentile_rows(samples: dict[tuple, list[float]], labels: dict[str, str]) -> tuple:
    rows, medians = [], {}
    for (n, hit, m), times in samples.items():
        us = sorted(t * 1e6 for t in times)
        p99 = us[min(len(us) - 1, round(0.99 * (len(us) - 1)))]
        med = statistics.median(us)
        medians[(n, hit, m)] = med
        rows.append({"keys": n, "present": hit, "method": m, "label": labels[m],
                     "calls": len(us), "median_us": round(med, 1), "p99_us": round(p99, 1),
                     "median_us_per_key": round(med / n, 2), "p99_us_per_key": round(p99 / n, 2)})
    return rows, medians


def _time_cases(methods: dict[str, Callable[[list[bytes]], int]], sizes: list[int],
                calls: int, present: list[bytes], absent: list[bytes]) -> dict:
    cases = [(n, hit, m) for n in sizes for hit in (True, False) for m in methods]
    samples: dict[tuple, list[float]] = {case: [] for case in cases}
    for n, hit, m in cases:  # untimed warm-up of each case
        methods[m]((present if hit else absent)[:n])
    rng = random.Random(0)
    for _ in range(calls):  # every case once per round, in a new order each time
        order = cases[:]
        rng.shuffle(order)
        for case in order:
            n, hit, m = case
            keys = (present if hit else absent)[:n]
            start = time.perf_counter()
            found = methods[m](keys)
            samples[case].append(time.perf_counter() - start)
            if found != (n if hit else 0):
                raise RuntimeError(f"lookup ({m}) of {n} keys found {found}, expected "
                                   f"{n if hit else 0}")
    return samples


def bench_lookup(args: argparse.Namespace, url: str, clients: dict[str, Any]) -> dict:
    """Per (keys, all present or none, method): latency of one lookup; see LOOKUPS."""
    def tier(client: Any) -> RemoteTier:
        return RemoteTier(RemoteTarget(url), namespace=NAMESPACE, num_ranks=1,
                          payload_bytes=4096, timeout_s=args.timeout_s,
                          connect=lambda _t, _s: client)

    ours, ours_python = tier(clients["remote"]), tier(clients["remote_pyparser"])
    default = clients["redispy_hiredis"]
    methods: dict[str, Callable[[list[bytes]], int]] = {
        "ours": ours.lookup,
        "ours_python": ours_python.lookup,
        "redispy_pipeline": lambda keys: pipeline_lookup(default, ours, keys),
    }
    largest = max(args.lookup_sizes)
    present = chunk_keys("lookup-present", largest)
    payload = memoryview(bytes(4096))
    if not all(ours.write(k, 0, payload) for k in present):
        raise RuntimeError("lookup: could not write the present keys")
    samples = _time_cases(methods, args.lookup_sizes, args.lookup_calls, present,
                          chunk_keys("lookup-absent", largest))
    if ours.health.num_failures or ours_python.health.num_failures:  # errors answer 0
        raise RuntimeError("lookup: RemoteTier recorded failures")
    clients["remote"].flushall()
    rows, medians = _percentile_rows(samples, LOOKUPS)
    ratios = [{"keys": n, "present": hit,
               # > 1: the redis-py pipeline (before) takes longer than ours (now)
               "pipeline_vs_ours": round(medians[(n, hit, "redispy_pipeline")]
                                         / medians[(n, hit, "ours")], 3),
               # > 1: the Python parser takes longer than hiredis's
               "python_vs_hiredis_parser": round(medians[(n, hit, "ours_python")]
                                                 / medians[(n, hit, "ours")], 3)}
              for n in args.lookup_sizes for hit in (True, False)]
    return {"rows": rows, "ratios": ratios}


def bench_cluster_lookup(args: argparse.Namespace, workdir: Any) -> dict:
    """The same lookups against a 3-node cluster on loopback: ours (one pipeline per
    node, all sent before any reply is read) against redis-py's cluster pipeline."""
    with RedisCluster(workdir) as cluster:
        target = RemoteTarget(cluster_nodes=tuple(cluster.seeds))
        ours = RemoteTier(target, namespace=NAMESPACE, num_ranks=1, payload_bytes=4096,
                          timeout_s=args.timeout_s)
        largest = max(args.lookup_sizes)
        present = chunk_keys("cluster-present", largest)
        if not all(ours.write(k, 0, memoryview(bytes(4096))) for k in present):
            raise RuntimeError("cluster lookup: could not write the present keys")
        client = ours._get_client()
        methods: dict[str, Callable[[list[bytes]], int]] = {
            "ours": ours.lookup,
            "redispy_cluster_pipeline": lambda keys: pipeline_lookup(client, ours, keys),
        }
        calls = max(10, args.lookup_calls // 4)
        samples = _time_cases(methods, args.lookup_sizes, calls, present,
                              chunk_keys("cluster-absent", largest))
        if ours.health.num_failures:
            raise RuntimeError("cluster lookup: RemoteTier recorded failures")
        ours.close()
    rows, medians = _percentile_rows(samples, CLUSTER_LOOKUPS)
    ratios = [{"keys": n, "present": hit,
               "redispy_cluster_pipeline_vs_ours": round(
                   medians[(n, hit, "redispy_cluster_pipeline")] / medians[(n, hit, "ours")],
                   3)}
              for n in args.lookup_sizes for hit in (True, False)]
    return {"rows": rows, "ratios": ratios, "nodes": 3}


def _simulate(tier: RemoteTier, keys: list[list[bytes]], asynchronous: bool,
              step_s: float) -> list[dict]:
    """vLLM's scheduler in miniature: one request arrives per step; every step asks each
    waiting request again. Per request: seconds spent in the lookup call(s) on this
    (the scheduler) thread, seconds from arrival to an answer, the answer."""
    out: list[dict] = []
    if not asynchronous:
        for req_keys in keys:
            start = time.perf_counter()
            hits = tier.lookup(req_keys)
            spent = time.perf_counter() - start
            out.append({"thread_s": spent, "wait_s": spent, "hits": hits})
            time.sleep(step_s)
        return out
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
    """Scheduler-thread time per request: ``RemoteLookups.ask`` (asynchronous) against
    ``RemoteTier.lookup`` on the scheduler thread (synchronous, before), each with the
    socket timeout the connector gives the scheduler's tier (the budget)."""
    requests = 20 if args.quick else 100
    rows = []
    for scenario, (label, delay) in SERVERS.items():
        for asynchronous in (False, True):
            proxy = SlowProxy(server_port, delay_s=delay).start() if delay else None
            url = proxy.url if proxy else f"redis://127.0.0.1:{server_port}/0"
            tier = RemoteTier(RemoteTarget(url), namespace=NAMESPACE, num_ranks=1,
                              payload_bytes=4096, timeout_s=BUDGET_S)
            half = chunk_keys(f"sched-{scenario}", 8)
            direct = RemoteTier(RemoteTarget(f"redis://127.0.0.1:{server_port}/0"),
                                namespace=NAMESPACE, num_ranks=1, payload_bytes=4096,
                                timeout_s=args.timeout_s)
            if not all(direct.write(k, 0, memoryview(bytes(4096))) for k in half[:4]):
                raise RuntimeError("scheduler thread: could not write the present keys")
            direct.close()
            keys = [half if i % 2 else chunk_keys(f"cold-{scenario}-{asynchronous}-{i}", 8)
                    for i in range(requests)]
            try:
                got = _simulate(tier, keys, asynchronous, step_s=0.002)
            finally:
                tier.close()
                if proxy:
                    proxy.stop()
            thread_us = sorted(r["thread_s"] * 1e6 for r in got)
            wait_ms = sorted(r["wait_s"] * 1e3 for r in got)
            rows.append({
                "server": scenario, "label": label,
                "method": "RemoteLookups.ask" if asynchronous else "RemoteTier.lookup (sync)",
                "requests": len(got),
                "thread_us_median": round(statistics.median(thread_us), 1),
                "thread_us_p99": round(thread_us[min(len(got) - 1, round(0.99 * len(got)))], 1),
                "thread_us_total_per_request": round(sum(thread_us) / len(got), 1),
                "answer_ms_median": round(statistics.median(wait_ms), 2),
                "answer_ms_max": round(wait_ms[-1], 2),
                "hit_requests": sum(r["hits"] > 0 for r in got)})
    return {"budget_ms": BUDGET_S * 1e3, "rows": rows}
