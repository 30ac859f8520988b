"""RemoteTier: one process's redis-py access to a Redis/Valkey server or cluster.

Used by the scheduler side (``lookup``: one pipelined existence check per request,
bounded by the lookup budget) and by workers (``read_into`` / ``write`` of one rank's
chunk, on the worker's I/O threads). Every failure is an expected outcome: lookups
answer 0, reads answer a ``ValueCheck`` or the error, writes answer False; the
``RemoteHealth`` backoff keeps a dead server from costing more than one timeout per
backoff period. The client is created lazily, so an engine starts while the server is
down and picks it up when it comes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kv_offload.remote.address import redact
from kv_offload.remote.bulk import RespErrorReply, read_value_into
from kv_offload.remote.cluster import (
    ClusterCounter,
    ClusterTopologyChanged,
    node_pool,
    scripts_refused,
)
from kv_offload.remote.health import RemoteHealth
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.remote.resp import (
    Joined,
    RespPacker,
    pipeline_on_connection,
    pipelines_on_connections,
)
from kv_offload.remote.tail_records import RemoteTails
from kv_offload.remote.values import HEADER_BYTES, ValueCheck, encode_header, meta_key

logger = logging.getLogger(__name__)

# KEYS: every rank's key of each chunk, chunk after chunk; ARGV[1]: ranks per chunk.
# Returns how many chunks from the first have all their ranks' keys.
_PREFIX_SCRIPT = b"""
local per = tonumber(ARGV[1])
local hits = 0
for i = 1, #KEYS, per do
  if redis.call('EXISTS', unpack(KEYS, i, i + per - 1)) ~= per then return hits end
  hits = hits + 1
end
return hits
"""


@dataclass(frozen=True, slots=True)
class RemoteTarget:
    """Where the remote tier lives: one server URL, or the seed nodes of a cluster.
    ``password``: given apart from the URL (``remote_password_env``/``_file``); never in
    ``repr`` or ``describe``."""

    url: str | None = None
    cluster_nodes: tuple[str, ...] = ()
    password: str | None = field(default=None, repr=False)

    @property
    def is_cluster(self) -> bool:
        return bool(self.cluster_nodes)

    def describe(self) -> str:
        """For logs: the address without credentials."""
        if self.is_cluster:
            return "cluster " + ",".join(redact(n) for n in self.cluster_nodes)
        return redact(self.url or "")


class RemoteTier:
    """Reads, writes and looks up chunks of one namespace. Thread-safe (redis-py pools).

    ``payload_bytes``: bytes of one chunk on one rank (a host slot). ``timeout_s``
    bounds every network call of this instance (connect, send, receive).
    ``lookup_budget_s``: how long a request may wait for ``async_lookups`` to answer
    (None: ``timeout_s``).
    """

    def __init__(self, target: RemoteTarget, *, namespace: str, num_ranks: int,
                 payload_bytes: int, timeout_s: float, key_prefix: str = "kv-offload",
                 ttl_s: int | None = None, who: str = "", max_backoff_s: float = 30.0,
                 lookup_budget_s: float | None = None,
                 connect: Callable[[RemoteTarget, float], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.target = target
        self.namespace = namespace
        self.num_ranks = num_ranks
        self.payload_bytes = payload_bytes
        self.timeout_s = timeout_s
        self.lookup_budget_s = timeout_s if lookup_budget_s is None else lookup_budget_s
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.health = RemoteHealth(f"{target.describe()}{' (' + who + ')' if who else ''}",
                                   max_backoff_s=max_backoff_s, clock=clock)
        self._connect = connect or connect_redis
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._use_script = True
        self._commands_refused = False  # ``pipeline``'s commands (tails' records)
        self._cluster = ClusterCounter()
        # key_name's parts, precomputed: lookups name every rank of every chunk.
        self._name_head = f"{key_prefix}:{{{namespace}:".encode()
        self._name_tails = [f"}}:r{r}of{num_ranks}".encode() for r in range(num_ranks)]

    def name(self, chunk_key: bytes, rank: int) -> bytes:
        """The key of this rank's part of ``chunk_key`` (``values.key_name``)."""
        return self._name_head + chunk_key.hex().encode() + self._name_tails[rank]

    # -- scheduler side ---------------------------------------------------------------------

    def lookup(self, chunk_keys: Sequence[bytes]) -> int:
        """How many of ``chunk_keys``, from the first, are present for every rank.

        One round trip; 0 on any failure or while the server is backing off.
        ``lookup_many`` of one request."""
        return self.lookup_many([chunk_keys])[0]

    def lookup_many(self, requests: Sequence[Sequence[bytes]]) -> list[int]:
        """``lookup`` of several requests in one round trip (per cluster node).

        Blocks for the round trip: call it off the scheduler thread (``RemoteLookups``).
        Read-only on the server; all zeros on any failure or while backing off. A
        standalone server counts each request's prefix itself (one read-only Lua script
        call per request, all pipelined); where scripts are refused (ACLs, managed
        services) one ``EXISTS`` per chunk is pipelined instead. On a cluster, every
        node gets one call over the chunks it holds (``cluster.ClusterCounter``), sent
        to every node before any reply is read.
        """
        if not any(requests) or not self.health.should_try():
            return [0] * len(requests)
        names = [[self.name(key, r) for key in keys for r in range(self.num_ranks)]
                 for keys in requests]
        try:
            client = self._get_client()
            if not self.target.is_cluster and self._use_script:
                prefixes = self._lookup_by_script(client, names)
                if prefixes is not None:
                    self.health.record_success()
                    return prefixes
            counts = self._exists_per_chunk(client, [n for group in names for n in group])
        except Exception as exc:  # redis errors, timeouts, refused connections
            if _is_redirect(exc):  # resharded: refresh the topology, no backoff
                self.close()
                self.health.record_success()  # the server answered (ends a probe too)
                return [0] * len(requests)
            self._failed(exc)
            return [0] * len(requests)
        self.health.record_success()
        out, at = [], 0
        for keys in requests:
            hits = 0
            for count in counts[at:at + len(keys)]:
                if count != self.num_ranks:
                    break
                hits += 1
            out.append(hits)
            at += len(keys)
        return out

    def _lookup_by_script(self, client: Any, names: list[list[bytes]]) -> list[int] | None:
        """Each request's prefix length, counted by the server; None (and never again)
        if the server refuses scripts."""
        from redis.exceptions import ResponseError

        per = b"%d" % self.num_ranks
        commands = [(b"EVAL", _PREFIX_SCRIPT, b"%d" % len(group), *group, per)
                    for group in names if group]
        try:
            replies = pipeline_on_connection(client.connection_pool, commands)
        except ResponseError as exc:
            if not scripts_refused(exc):
                raise  # a passing state: a failed call, the script stays
            self._use_script = False
            logger.info("kv-offload: the remote server refuses Lua scripts (%s); lookups "
                        "use one EXISTS per chunk", exc)
            return None
        it = iter(replies)
        return [int(next(it)) if group else 0 for group in names]

    def _exists_per_chunk(self, client: Any, names: list[bytes]) -> list[int]:
        """How many of its ranks' keys exist, per chunk (``ClusterCounter`` on a
        cluster: one script call or one EXISTS pipeline per node)."""
        per = self.num_ranks
        if self.target.is_cluster:
            return self._cluster.counts(client, names, per)
        commands = [(b"EXISTS", *names[i:i + per]) for i in range(0, len(names), per)]
        return pipeline_on_connection(client.connection_pool, commands)

    def pipeline(self, commands: Sequence[Sequence[Any]]) -> list[Any] | None:
        """Send single-key commands (the key second, as in ``HGETALL name``) in one round
        trip (per cluster node: each command to its key's node) and return the raw
        replies in order; None on any failure or while backing off (recorded like any
        call's). A server that refuses these commands (ACLs, a managed service) is not
        failing: logged once, then None without a call (the tier stays up for its
        chunks). Blocks: lookup and writer threads only."""
        if not commands:
            return []
        if self._commands_refused or not self.health.should_try():
            return None
        try:
            client = self._get_client()
            if not self.target.is_cluster:
                replies = pipeline_on_connection(client.connection_pool, commands)
            else:
                by_pool: dict[Any, list[int]] = {}
                for i, command in enumerate(commands):
                    by_pool.setdefault(node_pool(client, command[1]), []).append(i)
                answers = pipelines_on_connections(
                    {pool: [commands[i] for i in at] for pool, at in by_pool.items()})
                replies = [None] * len(commands)
                for pool, at in by_pool.items():
                    for i, reply in zip(at, answers[pool]):
                        replies[i] = reply
        except Exception as exc:
            if _is_redirect(exc):  # resharded: refresh the topology, no backoff
                self.close()
                self.health.record_success()
            elif _refused(exc):
                self._commands_refused = True
                logger.info("kv-offload: the remote server refuses the request tails' "
                            "commands (%s); tails are not kept in the remote tier", exc)
                self.health.record_success()  # it answered (ends a probe too)
            else:
                self._failed(exc)
            return None
        self.health.record_success()
        return replies

    def tail_records(self) -> RemoteTails:
        """The request tails' records of this namespace (``remote/tail_records.py``)."""
        return RemoteTails(self)

    def async_lookups(self, *, clock: Callable[[], float] = time.monotonic,
                      **kwargs: Any) -> RemoteLookups:
        """A ``RemoteLookups`` over this tier (its lookup threads start now): what the
        scheduler asks instead of calling ``lookup`` on its own thread, each request
        waiting at most ``lookup_budget_s``; ``kwargs`` go to it (``fetch`` and ``miss``
        for another kind of question, ``num_threads``). The caller closes it (before
        closing the tier)."""
        return RemoteLookups(self, budget_s=self.lookup_budget_s, clock=clock, **kwargs)

    def warm(self) -> bool:
        """Open a pooled connection now (one per node on a cluster), so that the next
        lookup pays no connection set-up. Blocks: lookup threads call it as they start.
        False when the server is unreachable (a failure, as for any call)."""
        if not self.health.should_try():
            return False
        try:
            client = self._get_client()
            pools = ([client.get_redis_connection(n).connection_pool
                      for n in client.get_primaries()] if self.target.is_cluster
                     else [client.connection_pool])
            for pool in pools:
                pool.release(pool.get_connection())  # get_connection connects
        except Exception as exc:
            self._failed(exc)
            return False
        self.health.record_success()
        return True

    def publish_descriptor(self, descriptor: dict) -> bool:
        """Record what this namespace is (model, layout) for ``kv-offload inspect
        --remote``; best effort, False when the server is unreachable."""
        if not self.health.should_try():
            return False
        try:
            self._get_client().set(meta_key(self.key_prefix, self.namespace),
                                   json.dumps(descriptor, sort_keys=True))
        except Exception as exc:
            self._failed(exc)
            return False
        self.health.record_success()
        return True

    # -- worker side --------------------------------------------------------------------------

    def read_into(self, chunk_key: bytes, rank: int, out: memoryview,
                  *, verify_checksum: bool = True) -> ValueCheck | Exception:
        """Fetch this rank's part of ``chunk_key`` straight into ``out`` (a host slot).

        The value is received into ``out`` itself (no intermediate bytes object) and its
        checksum verified there. ``out`` is untouched unless the value's length and
        header verified; with BAD_CHECKSUM it holds damaged bytes that the caller must
        not use (a failed load: the scheduler discards the slot). Returns the error
        itself when the call failed (server down, timeout). Worker I/O threads.
        """
        if not self.health.should_try():
            return ConnectionError("remote tier is backing off")
        name = self.name(chunk_key, rank)
        try:
            client = self._get_client()
            pool = (node_pool(client, name) if self.target.is_cluster
                    else client.connection_pool)
            conn = pool.get_connection()
            try:
                result = read_value_into(conn, name, out, verify_checksum=verify_checksum)
            finally:
                pool.release(conn)
        except Exception as exc:
            if _is_redirect(exc):
                self.close()  # resharded: the next call learns the new topology
                self.health.record_success()  # the server answered (ends a probe too)
            else:
                self._failed(exc)
            return exc
        self.health.record_success()
        return result

    def write(self, chunk_key: bytes, rank: int, payload: memoryview) -> bool:
        """Store this rank's part of ``chunk_key``; False when skipped or failed."""
        if not self.health.should_try():
            return False
        name = self.name(chunk_key, rank)
        value = Joined(encode_header(name, payload), payload)  # sent as is: no copy
        command = ("SET", name, value) + (("EX", self.ttl_s) if self.ttl_s else ())
        try:
            client = self._get_client()
            if self.target.is_cluster:  # its node connections pack with RespPacker
                client.execute_command(*command)
            else:
                pipeline_on_connection(client.connection_pool, [command])
        except Exception as exc:
            self._failed(exc)
            return False
        self.health.record_success()
        return True

    # -- plumbing -------------------------------------------------------------------------------

    def _get_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._connect(self.target, self.timeout_s)
            return self._client

    def _failed(self, exc: Exception) -> None:
        self.health.record_failure(f"{type(exc).__name__}: {exc}")
        if self.target.is_cluster:  # a cluster client caches topology: rebuild it
            self.close()

    def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            # A cluster's node clients do not own their pools: close() alone leaves their
            # sockets to the garbage collector. Idle ones go now (a read still running
            # on another thread keeps its connection until it returns it).
            with contextlib.suppress(Exception):
                for node in client.get_nodes() if self.target.is_cluster else ():
                    redis_node = getattr(node, "redis_connection", None)
                    if redis_node is not None:
                        redis_node.connection_pool.disconnect(inuse_connections=False)
            with contextlib.suppress(Exception):
                client.close()


def _refused(exc: Exception) -> bool:
    """An error reply that says the server will never run the command for us (ACLs, a
    command a managed service lacks); not a passing state (-OOM, -MISCONF, -BUSY...),
    which is a failed call."""
    from redis.exceptions import NoPermissionError, ResponseError

    text = str(exc).lower()
    return isinstance(exc, NoPermissionError) or (isinstance(exc, ResponseError) and any(
        s in text for s in ("noperm", "no permissions", "unknown command")))


def _is_redirect(exc: Exception) -> bool:
    """A cluster's MOVED/ASK answer: our topology is stale, the server is fine."""
    from redis.exceptions import AskError

    return (isinstance(exc, (AskError, ClusterTopologyChanged))
            or (isinstance(exc, RespErrorReply) and exc.moved))


def remote_tier_for(config: Any, layout: Any, *, namespace: str, who: str) -> RemoteTier:
    """The RemoteTier an ``OffloadConfig`` asks for, for chunks of ``layout``: every call
    bounded by ``remote_timeout_s``, a lookup's wait by ``remote_lookup_budget_ms``.

    Raises ValueError naming ``remote_max_value_size`` when a chunk does not fit, and
    naming ``remote_password_env``/``_file`` when the password cannot be read."""
    from kv_offload.sizes import format_size

    try:
        import redis  # noqa: F401
    except ImportError:
        raise ValueError("remote_url / remote_cluster_nodes: the remote tier needs redis-py; "
                         "install it with: pip install 'kv-offload[remote]'") from None
    value_bytes = HEADER_BYTES + layout.slot_bytes
    if value_bytes > config.remote_max_value_size:
        raise ValueError(
            f"remote_max_value_size: a chunk of this model is {format_size(value_bytes)} per "
            f"rank ({layout.chunk_tokens} tokens), above the limit of "
            f"{format_size(config.remote_max_value_size)}; raise remote_max_value_size (the "
            f"server's proto-max-bulk-len must allow it) or lower chunk_tokens")
    target = RemoteTarget(config.remote_url, tuple(config.remote_cluster_nodes or ()),
                          password=config.remote_password())
    return RemoteTier(target, namespace=namespace, num_ranks=layout.tp_size,
                      payload_bytes=layout.slot_bytes, timeout_s=config.remote_timeout_s,
                      key_prefix=config.remote_key_prefix, ttl_s=config.remote_ttl_s, who=who,
                      max_backoff_s=config.remote_max_backoff_s,
                      lookup_budget_s=config.remote_lookup_budget_ms / 1000)


def connect_redis(target: RemoteTarget, timeout_s: float) -> Any:
    """A redis-py client for ``target`` that never retries (our backoff decides) and
    gives up after ``timeout_s`` per call."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # RESP2 and no CLIENT SETINFO: a new connection costs one round trip fewer than
    # redis-py's default handshake (HELLO 3 + two SETINFO), which matters when a
    # connection is made while a request waits (after a reconnect, on a far server).
    common = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
              "retry": Retry(NoBackoff(), 0), "command_packer": RespPacker(),
              "protocol": 2, "driver_info": None}
    if target.password is not None:  # the URL has none (OffloadConfig checks)
        common["password"] = target.password
    if not target.is_cluster:
        return redis.Redis.from_url(_redis_scheme(target.url or ""), **common)
    from redis.cluster import ClusterNode, RedisCluster

    seeds = [_redis_scheme(n if "://" in n else f"redis://{n}") for n in target.cluster_nodes]
    nodes = [ClusterNode(p.hostname or "127.0.0.1", p.port or 6379)
             for p in map(urlsplit, seeds)]
    # from_url: node connection pools get the URL's credentials and TLS and our
    # connection class (RedisCluster drops a command_packer argument); the other seeds
    # are tried when the first is down.
    base = redis.SSLConnection if seeds[0].startswith("rediss://") else redis.Connection
    common["connection_class"] = type("KVOffloadConnection", (base,),
                                      {"__init__": _packer_init(base)})
    del common["command_packer"]
    return RedisCluster.from_url(seeds[0], startup_nodes=nodes, require_full_coverage=False,
                                 **common)


def _packer_init(base: type) -> Any:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", RespPacker())
        base.__init__(self, *args, **kwargs)  # type: ignore[misc]

    return __init__


def _redis_scheme(url: str) -> str:
    """Valkey URLs use redis-py's schemes (valkey:// -> redis://, valkeys:// -> rediss://)."""
    for ours, theirs in (("valkeys://", "rediss://"), ("valkey://", "redis://")):
        if url.startswith(ours):
            return theirs + url[len(ours):]
    return url
