"""Redis Cluster routing for the tier's own pipelines: which node holds a key, and the
existence counts of many chunks in one round trip per node.

redis-py's cluster pipeline costs ~20-30 us per command in Python. Here every chunk's
``EXISTS`` goes to its node and each node gets one script call over all its chunks
(``COUNT_SCRIPT``, flagged ``allow-cross-slot-keys``: Redis/Valkey 7+ run a script over
keys of several slots when the node holds them all), or one pipeline of ``EXISTS``
where the server refuses the script. Every node's request is sent before any reply is
read, so the round trips overlap.
"""

from __future__ import annotations

import logging
from binascii import crc_hqx
from collections.abc import Sequence
from typing import Any

from kv_offload.remote.resp import pipelines_on_connections

logger = logging.getLogger(__name__)

# ARGV[1]: ranks per chunk; ARGV[2..]: every rank's key of each chunk, chunk after chunk.
# The keys are arguments, not KEYS: a cluster refuses declared keys of several slots in
# one call even on the node that holds them all. Returns one count per chunk.
COUNT_SCRIPT = b"""#!lua flags=no-writes,allow-cross-slot-keys
local per = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV, per do
  out[#out + 1] = redis.call('EXISTS', unpack(ARGV, i, i + per - 1))
end
return out
"""


class ClusterTopologyChanged(Exception):
    """A node no longer holds a key we sent it (resharded): refresh and retry later."""


def key_slot(name: bytes) -> int:
    """The cluster hash slot of key ``name`` (CRC16 of its hash tag, as Redis)."""
    start = name.find(b"{")
    if start >= 0:
        end = name.find(b"}", start + 1)
        if end > start + 1:
            name = name[start + 1:end]
    return crc_hqx(name, 0) & 16383


def node_pool(client: Any, name: bytes) -> Any:
    """The connection pool of the node of ``client`` (a RedisCluster) holding ``name``."""
    node = client.nodes_manager.get_node_from_slot(key_slot(name))
    return client.get_redis_connection(node).connection_pool


class ClusterCounter:
    """Counts, per chunk, how many of its ranks' keys exist, one round trip per node.

    Thread-safe. ``use_script`` turns off (logged once) when a node refuses the script
    (Redis before 7, ACLs); then each node gets a pipeline of ``EXISTS``.
    """

    def __init__(self) -> None:
        self.use_script = True

    def counts(self, client: Any, names: Sequence[bytes], per: int) -> list[int]:
        """``names``: every rank's key of each chunk (``per`` keys a chunk), in order.
        Raises ClusterTopologyChanged, or what redis-py raises."""
        chunks = [names[i:i + per] for i in range(0, len(names), per)]
        manager = client.nodes_manager
        pools: dict[str, Any] = {}  # node name -> pool (redis-py's lookup is ~10 us)
        by_pool: dict[Any, list[int]] = {}
        for i, chunk in enumerate(chunks):
            slot = key_slot(chunk[0])
            # slots_cache: redis-py's slot -> [primary, replicas...]; get_node_from_slot
            # (locked, wrapped) costs several microseconds per key.
            nodes = manager.slots_cache.get(slot)
            node = nodes[0] if nodes else manager.get_node_from_slot(slot)  # raises
            pool = pools.get(node.name)
            if pool is None:
                pool = pools[node.name] = client.get_redis_connection(node).connection_pool
            by_pool.setdefault(pool, []).append(i)
        if self.use_script:
            replies = self._by_script(by_pool, chunks, per)
            if replies is not None:
                return _scatter(len(chunks), by_pool, {p: r[0] for p, r in replies.items()})
        replies = pipelines_on_connections(
            {pool: [(b"EXISTS", *chunks[i]) for i in idx] for pool, idx in by_pool.items()})
        return _scatter(len(chunks), by_pool, replies)

    def _by_script(self, by_pool: dict[Any, list[int]], chunks: list, per: int
                   ) -> dict[Any, list[Any]] | None:
        from redis.exceptions import ResponseError

        batches = {pool: [(b"EVAL", COUNT_SCRIPT, b"0", b"%d" % per,
                           *(n for i in idx for n in chunks[i]))]
                   for pool, idx in by_pool.items()}
        try:
            return pipelines_on_connections(batches)
        except ResponseError as exc:
            if "non local key" in str(exc):
                raise ClusterTopologyChanged(str(exc)) from exc
            if not scripts_refused(exc):
                raise
            self.use_script = False
            logger.info("kv-offload: the cluster refuses the lookup script (%s); lookups "
                        "use one EXISTS per chunk", exc)
            return None


def scripts_refused(exc: Exception) -> bool:
    """Whether an error reply to EVAL means the server will never run our script (ACLs,
    a managed service without scripting, an unknown command), rather than a passing
    state (-CLUSTERDOWN, -BUSY, -MASTERDOWN, -LOADING), which is a failed call."""
    text = str(exc).lower()
    return any(s in text for s in ("noperm", "unknown command", "disabled", "not allowed",
                                   "no permissions"))


def _scatter(num_chunks: int, by_pool: dict[Any, list[int]], replies: dict[Any, list[Any]]
             ) -> list[int]:
    counts = [0] * num_chunks
    for pool, idx in by_pool.items():
        if len(replies[pool]) != len(idx):
            raise ValueError(f"a node answered {len(replies[pool])} counts for {len(idx)} chunks")
        for i, count in zip(idx, replies[pool]):
            counts[i] = int(count)
    return counts
