"""RemoteTier against real Redis servers (standalone and a 3-node cluster on loopback).

Regression scenarios: a dead server must cost one refused connection per backoff
period, never a wait; a frozen server must not hold a lookup past its budget; a server
restarted empty answers misses, and the tier comes back by itself.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import redis

from kv_offload.remote import RemoteTarget, RemoteTier, ValueCheck
from kv_offload.remote import cluster as cluster_module
from kv_offload.remote import tier as tier_module
from kv_offload.testing.clock import FakeClock

NS = "ab" * 16
SLOT = 64 * 1024


def payload(i: int, rank: int = 0) -> bytes:
    return np.random.default_rng(i * 31 + rank).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def tier_for(target: RemoteTarget, *, num_ranks: int = 1, timeout_s: float = 1.0,
             namespace: str = NS, **kwargs) -> RemoteTier:
    t = RemoteTier(target, namespace=namespace, num_ranks=num_ranks, payload_bytes=SLOT,
                   timeout_s=timeout_s, key_prefix="kvo-test", **kwargs)
    t.health.min_backoff_s = 0.05
    return t


class CountingConnect:
    """``connect`` for a tier: real redis-py clients, recording each client's timeout and
    counting the connections its commands take from the pool (each one a network call)."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []
        self.num_calls = 0

    def __call__(self, target: RemoteTarget, timeout_s: float):
        self.timeouts.append(timeout_s)
        client = tier_module.connect_redis(target, timeout_s)
        pool = client.connection_pool
        get_connection = pool.get_connection

        def counted(*args, **kwargs):
            self.num_calls += 1
            return get_connection(*args, **kwargs)

        pool.get_connection = counted
        return client


def test_write_then_read_round_trips(redis_server):
    tier = tier_for(RemoteTarget(redis_server.url))
    for i in range(4):
        assert tier.write(key(i), 0, memoryview(payload(i)))
    out = bytearray(SLOT)
    assert tier.read_into(key(2), 0, memoryview(out)) is ValueCheck.OK
    assert bytes(out) == payload(2)
    assert tier.lookup([key(0), key(1), key(9), key(3)]) == 2, "a prefix, stops at the gap"
    tier.close()


def test_a_chunk_is_a_hit_only_when_every_rank_wrote_it(redis_server):
    tier = tier_for(RemoteTarget(redis_server.url), num_ranks=2)
    tier.write(key(100), 0, memoryview(payload(100, 0)))
    assert tier.lookup([key(100)]) == 0
    tier.write(key(100), 1, memoryview(payload(100, 1)))
    assert tier.lookup([key(100)]) == 1
    out = bytearray(SLOT)
    assert tier.read_into(key(100), 1, memoryview(out)) is ValueCheck.OK
    assert bytes(out) == payload(100, 1), "each rank reads its own part"


def test_other_namespace_never_hits(redis_server):
    tier = tier_for(RemoteTarget(redis_server.url))
    other = tier_for(RemoteTarget(redis_server.url), namespace="cd" * 16)
    tier.write(key(200), 0, memoryview(payload(200)))
    assert other.lookup([key(200)]) == 0
    assert other.read_into(key(200), 0, memoryview(bytearray(SLOT))) is ValueCheck.MISSING


def test_a_foreign_or_truncated_value_is_a_miss_and_leaves_the_slot_alone(redis_server):
    tier = tier_for(RemoteTarget(redis_server.url))
    client = redis.Redis.from_url(redis_server.url)
    client.set(tier.name(key(300), 0), b"not ours" * 100)
    good = bytes(tier.name(key(301), 0))
    tier.write(key(301), 0, memoryview(payload(301)))
    client.set(good, client.get(good)[:-5])  # truncated by someone
    out = bytearray(b"\x55" * SLOT)
    assert tier.read_into(key(300), 0, memoryview(out)) is ValueCheck.BAD_FORMAT
    assert tier.read_into(key(301), 0, memoryview(out)) is ValueCheck.BAD_LENGTH
    assert out == bytearray(b"\x55" * SLOT)


def test_dead_server_backs_off_then_the_tier_comes_back(redis_server, caplog):
    """While the backoff lasts (the tier's clock stands still), lookups, writes and reads
    answer at once without a network call: a dead server costs one refused connection
    per backoff period, never a wait per request."""
    clock, connect = FakeClock(), CountingConnect()
    tier = tier_for(RemoteTarget(redis_server.url), clock=clock, connect=connect)
    tier.write(key(400), 0, memoryview(payload(400)))
    redis_server.kill()
    try:
        assert tier.lookup([key(400)]) == 0
        assert not tier.health.up and tier.health.num_failures == 1
        network_calls = connect.num_calls
        calls = [tier.lookup([key(400)]) for _ in range(1000)]
        assert calls == [0] * 1000
        assert not tier.write(key(401), 0, memoryview(payload(401)))
        assert isinstance(tier.read_into(key(400), 0, memoryview(bytearray(SLOT))), Exception)
        assert connect.num_calls == network_calls, "backing off: no call per request"
        assert tier.health.num_failures == 1
    finally:
        redis_server.start()
    deadline = time.monotonic() + 30  # bounds a hang only
    while not tier.write(key(402), 0, memoryview(payload(402))):
        assert time.monotonic() < deadline, "the tier did not come back"
        clock.now += 1.0  # past the backoff: the next call is a probe
    assert tier.health.up
    assert tier.lookup([key(400)]) == 0, "a restarted server is empty: a miss, not an error"
    assert tier.lookup([key(402)]) == 1


def test_frozen_server_answers_within_the_lookup_budget(redis_server):
    """A lookup on a frozen server ends by the tier's timeout (its connection's socket
    timeout), while the server is still frozen, as a miss and a failure."""
    connect = CountingConnect()
    tier = tier_for(RemoteTarget(redis_server.url), timeout_s=0.05, connect=connect)
    tier.write(key(500), 0, memoryview(payload(500)))
    assert tier.lookup([key(500)]) == 1
    answers: list[int] = []
    redis_server.pause()
    try:
        lookup = threading.Thread(target=lambda: answers.append(tier.lookup([key(500)])))
        lookup.start()
        lookup.join(30)  # bounds a hang only: the server stays frozen until it returns
        assert not lookup.is_alive(), "the lookup waited for the frozen server"
    finally:
        redis_server.resume()
    assert answers == [0] and tier.health.num_failures == 1
    assert connect.timeouts == [0.05], "every network call is bounded by timeout_s"
    deadline = time.monotonic() + 30  # bounds a hang only
    while tier.lookup([key(500)]) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_cluster_spreads_chunks_and_finds_them_in_one_lookup(redis_cluster):
    tier = tier_for(RemoteTarget(cluster_nodes=tuple(redis_cluster.seeds)), num_ranks=2)
    keys = [key(1000 + i) for i in range(24)]
    for k in keys:
        for rank in range(2):
            assert tier.write(k, rank, memoryview(payload(int.from_bytes(k[:4], "little"), rank)))
    assert tier.lookup(keys) == len(keys)
    per_node = [int(n.cli("dbsize").strip()) for n in redis_cluster.nodes]
    assert sum(per_node) >= 2 * len(keys) and all(c > 0 for c in per_node), per_node
    out = bytearray(SLOT)
    assert tier.read_into(keys[5], 1, memoryview(out)) is ValueCheck.OK
    assert bytes(out) == payload(1005, 1)
    tier.close()


@pytest.mark.parametrize("url", ["valkey://127.0.0.1:{port}/0", "redis://127.0.0.1:{port}"])
def test_valkey_scheme_and_plain_urls_connect(redis_server, url):
    tier = tier_for(RemoteTarget(url.format(port=redis_server.port)))
    assert tier.write(key(600), 0, memoryview(payload(600)))
    assert tier.lookup([key(600)]) == 1


def test_describe_hides_passwords():
    assert "secret" not in RemoteTarget("redis://:secret@h:1/0").describe()
    assert "secret" not in RemoteTarget(cluster_nodes=("redis://u:secret@h:7000",)).describe()


def test_ttl_and_a_client_built_elsewhere(redis_server):
    """Values expire with remote_ttl_s; writes do not depend on the client's packer."""

    def plain_client(target, timeout_s):
        return redis.Redis.from_url(target.url, socket_timeout=timeout_s)

    tier = RemoteTier(RemoteTarget(redis_server.url), namespace=NS, num_ranks=1,
                      payload_bytes=SLOT, timeout_s=1.0, key_prefix="kvo-test", ttl_s=60,
                      connect=plain_client)
    assert tier.write(key(700), 0, memoryview(payload(700)))
    assert 0 < redis.Redis.from_url(redis_server.url).ttl(tier.name(key(700), 0)) <= 60
    out = bytearray(SLOT)
    assert tier.read_into(key(700), 0, memoryview(out)) is ValueCheck.OK
    assert bytes(out) == payload(700)


def test_lookup_without_script_permission_falls_back_to_exists(redis_server, caplog):
    """Servers whose ACLs (or managed service) refuse EVAL still answer lookups."""
    redis_server.cli("ACL", "SETUSER", "noscript", "on", "nopass", "~*", "+@all", "-eval",
                     "-evalsha")
    url = f"redis://noscript:any@127.0.0.1:{redis_server.port}/0"
    tier = tier_for(RemoteTarget(url))
    for i in (800, 801):
        assert tier.write(key(i), 0, memoryview(payload(i)))
    with caplog.at_level("INFO", logger="kv_offload.remote.tier"):
        assert tier.lookup([key(800), key(801), key(802)]) == 2
        assert tier.lookup([key(800), key(802)]) == 1
    assert tier.health.up and tier.health.num_failures == 0
    assert sum("refuses Lua scripts" in r.getMessage() for r in caplog.records) == 1


def test_lookup_many_answers_each_request_in_one_round_trip(redis_server, monkeypatch):
    tier = tier_for(RemoteTarget(redis_server.url))
    for i in (900, 901, 903):
        assert tier.write(key(i), 0, memoryview(payload(i)))
    sent = []
    real = tier_module.pipeline_on_connection
    monkeypatch.setattr(tier_module, "pipeline_on_connection",
                        lambda pool, commands: sent.append(len(commands)) or real(pool, commands))
    requests = [[key(900), key(901), key(902)], [], [key(903)], [key(902), key(903)]]
    assert tier.lookup_many(requests) == [2, 0, 1, 0]
    assert sent == [3], "one pipeline: a script call per request that has keys"
    assert tier.lookup_many([[], []]) == [0, 0] and sent == [3], "nothing to ask: no call"


def test_cluster_lookup_is_one_call_per_node_sent_together(redis_cluster, monkeypatch):
    tier = tier_for(RemoteTarget(cluster_nodes=tuple(redis_cluster.seeds)))
    present = [key(1100 + i) for i in range(30)]
    for k in present:
        assert tier.write(k, 0, memoryview(payload(int.from_bytes(k[:4], "little"))))
    batches = []
    real = cluster_module.pipelines_on_connections
    monkeypatch.setattr(cluster_module, "pipelines_on_connections",
                        lambda b: batches.append(list(b.values())) or real(b))
    requests = [present[:20], present[20:] + [key(1199)] + present[:3], [key(1198)]]
    assert tier.lookup_many(requests) == [20, 10, 0]
    (per_node,) = batches
    assert len(per_node) == 3 and all(len(commands) == 1 for commands in per_node)
    assert all(commands[0][0] == b"EVAL" for commands in per_node), "one script call a node"
    assert sum(len(commands[0]) - 4 for commands in per_node) == 35, "every chunk once"
    tier.close()


def test_cluster_refusing_the_script_pipelines_exists_per_node(redis_cluster, caplog):
    tier = tier_for(RemoteTarget(cluster_nodes=tuple(redis_cluster.seeds)), num_ranks=2)
    keys = [key(1400 + i) for i in range(12)]
    for k in keys[:8]:
        for rank in range(2):
            assert tier.write(k, rank, memoryview(payload(1, rank)))
    for node in redis_cluster.nodes:
        node.cli("ACL", "SETUSER", "default", "-eval")
    try:
        with caplog.at_level("INFO", logger="kv_offload.remote.cluster"):
            assert tier.lookup_many([keys, keys[4:], keys[9:]]) == [8, 4, 0]
            assert tier.lookup(keys) == 8
    finally:
        for node in redis_cluster.nodes:
            node.cli("ACL", "SETUSER", "default", "+@all")
    assert tier.health.up and tier.health.num_failures == 0
    assert sum("refuses the lookup script" in r.getMessage() for r in caplog.records) == 1
    tier.close()


def test_read_lands_in_the_slot_without_the_clients_get(redis_server):
    """read_into receives on the pooled connection itself; redis-py's GET (which
    returns a bytes copy of the value) is never called."""

    class NoGet(redis.Redis):
        def get(self, name):
            raise AssertionError("read_into must not GET through redis-py")

    def connect(target, timeout_s):
        return NoGet.from_url(target.url, socket_timeout=timeout_s)

    tier = RemoteTier(RemoteTarget(redis_server.url), namespace=NS, num_ranks=1,
                      payload_bytes=SLOT, timeout_s=1.0, key_prefix="kvo-test",
                      connect=connect)
    for i in (1200, 1201):
        assert tier.write(key(i), 0, memoryview(payload(i)))
    out = np.zeros(SLOT, dtype=np.uint8)
    for i in (1200, 1299, 1201, 1200):  # a miss in between leaves the connection usable
        expected = ValueCheck.MISSING if i == 1299 else ValueCheck.OK
        assert tier.read_into(key(i), 0, memoryview(out)) is expected
        if expected:
            assert out.tobytes() == payload(i)
    assert tier.health.num_failures == 0


def test_a_damaged_value_is_a_miss_and_the_next_read_is_clean(redis_server):
    tier = tier_for(RemoteTarget(redis_server.url))
    client = redis.Redis.from_url(redis_server.url)
    assert tier.write(key(1300), 0, memoryview(payload(1300)))
    assert tier.write(key(1301), 0, memoryview(payload(1301)))
    name = tier.name(key(1300), 0)
    damaged = bytearray(client.get(name))
    damaged[-3] ^= 1
    client.set(name, bytes(damaged))
    out = bytearray(SLOT)
    assert tier.read_into(key(1300), 0, memoryview(out)) is ValueCheck.BAD_CHECKSUM
    assert tier.read_into(key(1300), 0, memoryview(out),
                          verify_checksum=False) is ValueCheck.OK, "checked only on request"
    assert tier.read_into(key(1301), 0, memoryview(out)) is ValueCheck.OK
    assert bytes(out) == payload(1301)


def test_warm_connects_before_the_first_lookup(redis_server, redis_cluster):
    for target in (RemoteTarget(redis_server.url),
                   RemoteTarget(cluster_nodes=tuple(redis_cluster.seeds))):
        tier = tier_for(target)
        assert tier.warm()
        client = tier._get_client()
        pools = ([client.get_redis_connection(n).connection_pool
                  for n in client.get_primaries()] if target.is_cluster
                 else [client.connection_pool])
        assert all(p._available_connections for p in pools), "a connected, idle connection"
        tier.close()
    dead = tier_for(RemoteTarget("redis://127.0.0.1:1/0"))
    assert not dead.warm() and not dead.health.up


def test_key_slot_agrees_with_redis_py():
    from redis.crc import key_slot as redis_key_slot

    from kv_offload.remote.cluster import key_slot

    tier = tier_for(RemoteTarget(cluster_nodes=("127.0.0.1:1",)))
    names = [tier.name(key(i), 0) for i in range(500)] + [b"plain", b"{}x", b"a{b}c{d}"]
    assert [key_slot(n) for n in names] == [redis_key_slot(n) for n in names]


def test_async_lookups_answer_from_the_server(redis_server):
    tier = tier_for(RemoteTarget(redis_server.url), timeout_s=0.5)
    assert tier.write(key(1500), 0, memoryview(payload(1500)))
    lookups = tier.async_lookups(clock=FakeClock())  # the budget never passes here
    try:
        assert lookups.budget_s == 0.5, "the tier's timeout is the budget by default"
        answer = lookups.ask("r", [key(1500), key(1501)])
        deadline = time.monotonic() + 30  # bounds a hang only
        while answer is None and time.monotonic() < deadline:
            time.sleep(0.002)
            answer = lookups.ask("r", [key(1500), key(1501)])
        assert answer == 1
    finally:
        lookups.close()
        tier.close()


def test_a_redirect_answering_the_probe_brings_the_tier_back(redis_server, monkeypatch):
    """After an outage, the probe that ended the backoff got -ASK/-MOVED (a slot being
    resharded): neither a success nor a failure was recorded, the probe never ended,
    and the tier stayed off for the rest of the process."""
    clock = FakeClock()
    tier = tier_for(RemoteTarget(redis_server.url), clock=clock)
    tier.health.record_failure("timeout")  # an outage...
    clock.now += 1.0  # ...whose backoff ended: the next call is the probe

    def moved(*args, **kwargs):
        raise tier_module.RespErrorReply("MOVED 3999 127.0.0.1:1")
    monkeypatch.setattr(tier_module, "read_value_into", moved)
    assert isinstance(tier.read_into(key(1), 0, memoryview(bytearray(SLOT))), Exception)
    monkeypatch.undo()
    assert tier.health.up, "the server answered: the tier is up"
    assert tier.write(key(2), 0, memoryview(payload(2)))


def test_a_passing_server_state_does_not_turn_the_lookup_script_off(redis_server,
                                                                      monkeypatch):
    """Any error reply to EVAL (-CLUSTERDOWN during a failover, -BUSY, -LOADING) turned
    the script off for the life of the process; now only a refusal does."""
    from redis.exceptions import ResponseError

    from kv_offload.remote.cluster import scripts_refused

    assert scripts_refused(ResponseError("NOPERM this user has no permissions to run 'eval'"))
    assert scripts_refused(ResponseError("ERR unknown command 'EVAL'"))
    for passing in ("CLUSTERDOWN The cluster is down", "BUSY Redis is busy running a script",
                    "LOADING Redis is loading the dataset in memory", "MASTERDOWN Link down"):
        assert not scripts_refused(ResponseError(passing))
    tier = tier_for(RemoteTarget(redis_server.url))

    def busy(*args, **kwargs):
        raise ResponseError("BUSY Redis is busy running a script")
    monkeypatch.setattr(tier_module, "pipeline_on_connection", busy)
    assert tier.lookup([key(9901)]) == 0
    assert tier._use_script and not tier.health.up, "a failed call, the script stays"


def test_closing_a_cluster_client_closes_its_node_connections(redis_cluster):
    """A cluster client is rebuilt after every failure and redirect; its node clients do
    not own their pools, so close() left their sockets open until the garbage collector
    ran (20 rebuilds: 60 connections held on the shared servers)."""
    import gc

    def connected() -> int:
        return sum(int(line.split(":")[1]) - 1 for n in redis_cluster.nodes
                   for line in n.cli("info", "clients").split("\n")
                   if line.startswith("connected_clients:"))

    tier = tier_for(RemoteTarget(cluster_nodes=tuple(redis_cluster.seeds)))
    keys = [bytes([i]) * 32 for i in range(30)]  # spread over the 3 nodes
    gc.collect()
    gc.disable()
    try:
        before = connected()
        for _ in range(10):
            tier.lookup(keys)
            tier.close()
        assert connected() - before <= 3
    finally:
        gc.enable()
