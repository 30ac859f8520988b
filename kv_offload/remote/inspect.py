"""What a Redis/Valkey server holds for kv-offload: namespaces, chunks, bytes, server state.

Read-only (SCAN, STRLEN, HKEYS, GET, INFO); safe while engines run. Request tails are
the chunks named by a record (``<prefix>:{<namespace>:<parent>}:tails``, one field per
tail): their values are chunk values like any other, and a record whose values the
server evicted counts no tail. Used by
``kv-offload inspect --remote``. Namespaces are named by the descriptor that each
engine's scheduler publishes at start (``<prefix>:meta:<namespace>``); a descriptor the
server evicted shows as unknown.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kv_offload.remote.tier import RemoteTarget, connect_redis
from kv_offload.remote.values import meta_key, namespace_pattern
from kv_offload.sizes import format_size

_KEY_RE = re.compile(rb"^.*:\{(?P<ns>[0-9a-f]{32}):(?P<chunk>[0-9a-f]+)\}:r(?P<rank>\d+)of(?P<n>\d+)$")
_TAILS_RE = re.compile(rb"^.*:\{(?P<ns>[0-9a-f]{32}):(?P<parent>[0-9a-f]+)\}:tails$")
_SERVER_FIELDS = ("used_memory", "maxmemory", "maxmemory_policy", "evicted_keys",
                  "expired_keys", "keyspace_hits", "keyspace_misses")


def inspect_remote(target: RemoteTarget, *, key_prefix: str, namespace: str | None = None,
                   max_keys: int = 10_000_000, timeout_s: float = 10.0,
                   client: Any = None) -> dict:
    """Scan the server for kv-offload values; returns a JSON-serialisable report."""
    client = client or connect_redis(target, timeout_s)
    found: dict[str, dict[str, Any]] = {}
    pattern = namespace_pattern(key_prefix, namespace)
    batch: list[tuple[bytes, re.Match]] = []
    tail_hashes: list[tuple[bytes, str]] = []  # (records' hash, namespace)
    scanned = 0

    def ns_entry(ns_id: str, num_ranks: int = 0) -> dict[str, Any]:
        return found.setdefault(ns_id, {"values": 0, "bytes": 0, "chunks": set(),
                                        "num_ranks": num_ranks, "tails": 0})

    def flush() -> None:
        pipe = client.pipeline(transaction=False)
        for name, _ in batch:
            pipe.strlen(name)
        for (_, match), size in zip(batch, pipe.execute()):
            ns = ns_entry(match["ns"].decode())
            ns["num_ranks"] = int(match["n"])
            ns["values"] += 1
            ns["bytes"] += int(size)
            ns["chunks"].add(match["chunk"])
        batch.clear()

    for name in client.scan_iter(match=pattern, count=1000):
        scanned += 1
        if scanned > max_keys:
            break
        match = _KEY_RE.match(name)
        if match:
            batch.append((name, match))
            if len(batch) >= 1000:
                flush()
        elif tails := _TAILS_RE.match(name):
            tail_hashes.append((name, tails["ns"].decode()))
    if batch:
        flush()
    tail_keys: dict[str, set[bytes]] = {}  # namespace -> recorded tails (key hex)
    for at in range(0, len(tail_hashes), 1000):  # records: one field per tail (HKEYS)
        pipe = client.pipeline(transaction=False)
        for name, _ in tail_hashes[at:at + 1000]:
            pipe.hkeys(name)
        for (_, ns_id), fields in zip(tail_hashes[at:at + 1000], pipe.execute()):
            ns_entry(ns_id)
            tail_keys.setdefault(ns_id, set()).update(bytes(f).hex().encode() for f in fields)
    for ns_id, keys in tail_keys.items():  # a record whose values are gone holds no tail
        found[ns_id]["tails"] = len(keys & found[ns_id]["chunks"])
    namespaces = []
    for ns_id, ns in sorted(found.items()):
        raw = client.get(meta_key(key_prefix, ns_id))
        namespaces.append({
            "namespace_id": ns_id, "values": ns["values"], "bytes": ns["bytes"],
            "chunks": len(ns["chunks"]), "num_ranks": ns["num_ranks"],
            "tails": ns["tails"],  # chunks that are recorded request tails
            # Some ranks' values were evicted: those chunks miss until stored again.
            "partial": ns["values"] != len(ns["chunks"]) * ns["num_ranks"],
            "descriptor": json.loads(raw) if raw else None})
    return {"remote": target.describe(), "key_prefix": key_prefix, "truncated": scanned > max_keys,
            "server": _server_info(client, cluster=target.is_cluster),
            "namespaces": namespaces,
            "values": sum(n["values"] for n in namespaces),
            "bytes": sum(n["bytes"] for n in namespaces)}


def _server_info(client: Any, *, cluster: bool) -> dict:
    """INFO fields, summed over the primaries of a cluster."""
    if cluster:
        per_node = list(client.info(target_nodes=client.PRIMARIES).values())
    else:
        per_node = [client.info()]
    out: dict[str, Any] = {"nodes": len(per_node)}
    for name in _SERVER_FIELDS:
        values = [n.get(name) for n in per_node if name in n]
        if values and all(isinstance(v, (int, float)) for v in values):
            out[name] = sum(values)
        elif values:
            out[name] = values[0]
    return out


def format_report(report: dict) -> list[str]:
    """Human-readable lines of an ``inspect_remote`` report."""
    s = report["server"]
    limit = format_size(s["maxmemory"]) if s.get("maxmemory") else "no limit"
    lines = [f"remote {report['remote']}: {len(report['namespaces'])} namespace(s), "
             f"{report['values']} values, {format_size(report['bytes'])}"
             + (" (scan truncated)" if report["truncated"] else ""),
             f"  server     {s.get('nodes', 1)} node(s), {format_size(s.get('used_memory', 0))} "
             f"used of {limit} ({s.get('maxmemory_policy', '?')}), evicted "
             f"{s.get('evicted_keys', 0)}, expired {s.get('expired_keys', 0)}, hits "
             f"{s.get('keyspace_hits', 0)}, misses {s.get('keyspace_misses', 0)}"]
    for ns in report["namespaces"]:
        d = ns["descriptor"] or {}
        lines += [f"\nremote namespace {ns['namespace_id']}",
                  f"  model      {d.get('model', '? (descriptor evicted or not published)')}",
                  f"  chunks     {ns['chunks']} x {ns['num_ranks']} rank(s), {ns['values']} "
                  f"values" + (" (some ranks' values evicted: those chunks miss)"
                               if ns["partial"] else "")
                  + (f", {ns['tails']} of them request tails" if ns["tails"] else ""),
                  f"  bytes      {format_size(ns['bytes'])}"]
        if d:
            lines.append(f"  layout     {d.get('dtype')}, {d.get('num_layers')} layers, "
                         f"chunk {d.get('chunk_tokens')} tokens, TP {d.get('tp_size')}")
    return lines
