"""`kv-offload inspect --remote`: what an operator sees of the remote tier."""

from __future__ import annotations

import json

import pytest
import redis

from kv_offload.remote import RemoteTarget, RemoteTier
from kv_offload.tools.cli import main

NS_A, NS_B = "a1" * 16, "b2" * 16
SLOT = 4096


def fill(url: str, namespace: str, chunks: int, ranks: int) -> RemoteTier:
    tier = RemoteTier(RemoteTarget(url), namespace=namespace, num_ranks=ranks,
                      payload_bytes=SLOT, timeout_s=1.0)
    for c in range(chunks):
        for r in range(ranks):
            assert tier.write(bytes([c]) * 32, r, memoryview(bytes(SLOT)))
    return tier


def test_inspect_remote_reports_namespaces_chunks_and_server(redis_server, capsys):
    redis_server.cli("flushall")
    tier = fill(redis_server.url, NS_A, chunks=5, ranks=2)
    tier.publish_descriptor({"model": "/models/llama", "num_layers": 4, "chunk_tokens": 64,
                             "dtype": "bfloat16", "tp_size": 2})
    fill(redis_server.url, NS_B, chunks=3, ranks=1)
    redis.Redis.from_url(redis_server.url).delete(tier.name(bytes([4]) * 32, 1))

    assert main(["inspect", "--remote", redis_server.url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by_id = {n["namespace_id"]: n for n in report["namespaces"]}
    assert by_id[NS_A]["chunks"] == 5 and by_id[NS_A]["values"] == 9
    assert by_id[NS_A]["partial"] and not by_id[NS_B]["partial"]
    assert by_id[NS_A]["descriptor"]["model"] == "/models/llama"
    assert by_id[NS_B]["descriptor"] is None
    assert report["bytes"] >= 12 * SLOT
    assert report["server"]["maxmemory_policy"] == "allkeys-lru"

    assert main(["inspect", "--remote", redis_server.url, "--namespace", NS_B[:6]]) == 0
    text = capsys.readouterr().out
    assert NS_B in text and NS_A not in text
    assert "3 x 1 rank(s)" in text and "descriptor evicted or not published" in text


def test_inspect_remote_on_a_cluster(redis_cluster, capsys):
    seeds = ",".join(redis_cluster.seeds)
    tier = RemoteTier(RemoteTarget(cluster_nodes=tuple(redis_cluster.seeds)), namespace=NS_A,
                      num_ranks=1, payload_bytes=SLOT, timeout_s=1.0)
    for c in range(30):
        assert tier.write(bytes([c]) * 32, 0, memoryview(bytes(SLOT)))
    assert main(["inspect", "--remote-cluster", seeds, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (ns,) = [n for n in report["namespaces"] if n["namespace_id"] == NS_A]
    assert ns["chunks"] >= 30
    assert report["server"]["nodes"] == 3


@pytest.mark.parametrize("args, code, message", [
    (["inspect"], 2, "give a store directory"),
    (["inspect", "--remote", "http://x:1"], 2, "remote_url"),
    (["inspect", "--remote", "redis://127.0.0.1:1/0"], 1, "cannot read"),
])
def test_inspect_remote_errors_name_the_problem(args, code, message, capsys):
    assert main(args) == code
    assert message in capsys.readouterr().err
