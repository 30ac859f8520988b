"""ClusterCounter with fake cluster nodes: routing, the script's fallback, resharding.

Regression scenario: a node that no longer holds a key (resharded since the client
learned the topology) answers the script with "non local key"; that must read as a
stale topology (refresh, a miss, no backoff), not as a server refusing scripts.
"""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from kv_offload.remote.cluster import ClusterCounter, ClusterTopologyChanged, key_slot


class Node:
    def __init__(self, name: str) -> None:
        self.name = name
        self.keys: set[bytes] = set()
        self.error: str | None = None
        self.commands: list[tuple] = []
        self.connection_pool = self

    # pool
    def get_connection(self):
        return self

    def release(self, conn) -> None:
        pass

    # connection
    def send_packed_command(self, pieces) -> None:
        self.pending = list(self.sent)
        self.sent = []

    def disconnect(self) -> None:
        pass

    def read_response(self):
        command = self.pending.pop(0)
        self.commands.append(command)
        if self.error:
            raise ResponseError(self.error)
        if command[0] == b"EVAL":
            per, names = int(command[3]), command[4:]
            return [sum(n in self.keys for n in names[i:i + per])
                    for i in range(0, len(names), per)]
        return sum(n in self.keys for n in command[1:])


class Client:
    """Two nodes: even slots on one, odd on the other."""

    def __init__(self) -> None:
        self.nodes = [Node("a"), Node("b")]
        self.nodes_manager = self
        self.slots_cache = {slot: [self.nodes[slot % 2]] for slot in range(16384)}

    def get_redis_connection(self, node):
        return node

    def node_of(self, name: bytes) -> Node:
        return self.nodes[key_slot(name) % 2]


@pytest.fixture
def client(monkeypatch):
    """Commands reach a node as tuples (the packing is tested elsewhere)."""
    import kv_offload.remote.cluster as cluster

    def fake_pipelines(batches):
        for pool, commands in batches.items():
            pool.sent = list(commands)
            pool.send_packed_command(None)
        return {pool: [pool.read_response() for _ in commands]
                for pool, commands in batches.items()}

    monkeypatch.setattr(cluster, "pipelines_on_connections", fake_pipelines)
    return Client()


def names(n: int, per: int = 2) -> list[bytes]:
    return [b"kv:{ns:%d}:r%dof%d" % (i, r, per) for i in range(n) for r in range(per)]


def test_each_node_gets_one_call_over_its_chunks(client):
    keys = names(10)
    for name in keys[:14]:  # chunks 0-6 complete
        client.node_of(name).keys.add(name)
    counts = ClusterCounter().counts(client, keys, 2)
    assert counts == [2] * 7 + [0] * 3
    assert all(len(node.commands) == 1 and node.commands[0][0] == b"EVAL"
               for node in client.nodes)


def test_a_refused_script_falls_back_to_exists_for_good(client):
    counter = ClusterCounter()
    keys = names(4)
    for name in keys:
        client.node_of(name).keys.add(name)
    client.nodes[0].error = "NOPERM this user has no permissions to run the 'eval' command"
    with pytest.raises(ResponseError):  # the EXISTS fallback meets the same fake error
        counter.counts(client, keys, 2)
    assert not counter.use_script
    client.nodes[0].error = None
    assert counter.counts(client, keys, 2) == [2, 2, 2, 2]
    assert all(c[0] == b"EXISTS" for node in client.nodes for c in node.commands[-2:])


def test_a_resharded_node_is_a_stale_topology_not_a_refusal(client):
    counter = ClusterCounter()
    client.nodes[1].error = ("Script attempted to access a non local key in a cluster node "
                             "script")
    with pytest.raises(ClusterTopologyChanged):
        counter.counts(client, names(4), 2)
    assert counter.use_script, "scripts stay on"


def test_the_tier_answers_a_miss_and_refreshes_without_backing_off(client):
    from kv_offload.remote import RemoteTarget, RemoteTier

    built = []

    def connect(target, timeout_s):
        built.append(client)
        return client

    client.close = lambda: None
    tier = RemoteTier(RemoteTarget(cluster_nodes=("127.0.0.1:1",)), namespace="ns",
                      num_ranks=1, payload_bytes=64, timeout_s=1.0, connect=connect)
    client.nodes[0].error = client.nodes[1].error = "non local key in a cluster node script"
    assert tier.lookup_many([[b"k" * 32, b"j" * 32]]) == [0]
    assert tier.health.up and tier.health.num_failures == 0
    client.nodes[0].error = client.nodes[1].error = None
    assert tier.lookup_many([[b"k" * 32]]) == [0]
    assert len(built) == 2, "the client (and its topology) was rebuilt"
