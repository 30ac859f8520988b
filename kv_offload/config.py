"""OffloadConfig: the user-facing configuration of kv-offload.

Written by users in Python instead of JSON; converts to and from vLLM's
``kv_connector_extra_config`` dict, ``KVTransferConfig`` and the JSON string for
``vllm serve --kv-transfer-config``. Validation is strict: every mistake is a
``ValueError`` that names the field and says what to change.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
from dataclasses import dataclass
from typing import Any

CONNECTOR_NAME = "KVOffloadConnector"
CONNECTOR_MODULE = "kv_offload.connector"

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
EVICTION_POLICIES = ("lru", "fifo")
CONNECTOR_RESETS = ("all", "cpu")
_REMOTE_SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
_NODE_RE = re.compile(r"^((redis|rediss|valkey|valkeys)://([^@/]*@)?)?[A-Za-z0-9_.\[\]:-]+:\d+/?$")


def parse_size(value: Any, *, name: str) -> int:
    """Parse a byte size (an int, or a string like "8GiB", "500MB", "1024") into bytes.

    Raises ValueError naming ``name`` when the value is not a non-negative size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}: expected a size like '8GiB' or an integer, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"{name}: cannot parse {value!r} as a size; write e.g. '8GiB', '500MB' "
                f"or a number of bytes (units: KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            )
        size = int(float(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ValueError(
            f"{name}: expected a size like '8GiB' or an integer, got {type(value).__name__}"
        )
    if size < 0:
        raise ValueError(f"{name}: size must not be negative, got {value!r}")
    return size


def format_size(num_bytes: int) -> str:
    """Human-readable binary size ("1.5 GiB")."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{num_bytes} B"


@dataclass(frozen=True)
class OffloadConfig:
    """Configuration of the kv-offload connector (all sizes in bytes after validation).

    Fields:
        cpu_size: host-RAM budget of the CPU tier, per worker (rank), all of it in use
            from start-up (pinned on CUDA; mapped in the background on CPU). Default 4 GiB.
        disk_path: store directory of the persistent disk tier; None turns the tier off.
        disk_size: disk budget of one model's namespace in the store. Default 32 GiB.
        chunk_tokens: tokens per stored chunk, a multiple of vLLM's block size;
            None picks the smallest multiple of the block size >= 256.
        eviction_policy: "lru" (default) or "fifo", for the CPU tier.
        io_threads: worker threads doing disk I/O, per worker. Default 4.
        verify_checksums: verify each chunk's checksum when loading from disk or the
            remote tier. Default True. Off, nothing catches a damaged chunk, nor one that
            another instance sharing the store evicts and rewrites during the read.
        disk_fsync: fdatasync slab writes before a chunk is committed (survives power
            loss, costs throughput). Default False: a process crash never loses
            committed chunks; after power loss, torn chunks fail their checksum.
        namespace_salt: extra string mixed into the namespace; instances with different
            salts never share chunks.
        store_generated: also store chunks made of generated (decode) tokens.
        load_timeout_s: a load not finished within this many seconds is failed and
            its tokens are recomputed. Default 30.
        cpu_background_stores: on vLLM's CPU backend, copy stored blocks to the CPU tier
            on a thread of their own, overlapping the next forward, instead of at the
            end of the step. Default False: on 2 shared cores the store thread was not
            faster (docs/benchmarks.md, connector overhead). On CUDA, copies always run
            on their own stream.
        disk_allow_unsafe_permissions: open a store directory that belongs to another
            user or is writable by group or others. Default False: such a store is
            refused, because whoever can write it can plant KV that would be served.
        remote_url: a Redis/Valkey server shared by several hosts, below the disk tier
            ("redis://host:6379/0", "rediss://...", "unix:///path.sock", "valkey://...").
            None (default) turns the remote tier off.
        remote_cluster_nodes: seed nodes of a Redis Cluster ("host:port" or URLs), instead
            of ``remote_url``.
        remote_timeout_s: limit of one remote call (read, write, lookup round trip,
            connect); slower is a failure and the tier backs off. Default 2.
        remote_lookup_budget_ms: how long a request may wait for its remote lookup (which
            runs off the scheduler thread); past it the answer is a miss. Default 50
            (docs/remote-tier.md says why).
        remote_max_value_size: the largest value kv-offload may write (a chunk of one rank
            plus a 40-byte header); must cover a chunk. Default 256MiB (Redis allows 512MB).
        remote_key_prefix: prefix of every key kv-offload writes. Default "kv-offload".
        remote_ttl_s: expire remote values after this many seconds; None (default)
            leaves eviction to the server (``maxmemory-policy allkeys-lru``).
        remote_max_backoff_s: after failures, the remote server is retried with a backoff
            that doubles from 0.5 s up to this. Default 30.
        connector_reset: what vLLM's ``reset_prefix_cache(reset_connector=True)`` clears.
            "all" (default): every chunk of the CPU tier, and the disk and remote tiers
            are not used for the rest of the run: vLLM resets connectors around weight
            updates, and those tiers are keyed by the model's config, not its weights.
            "cpu": the CPU tier only (the disk and remote tiers keep serving; for tests
            and benchmarks, or when weights never change in place).
    """

    cpu_size: int | str = "4GiB"
    disk_path: str | None = None
    disk_size: int | str = "32GiB"
    chunk_tokens: int | None = None
    eviction_policy: str = "lru"
    io_threads: int = 4
    verify_checksums: bool = True
    disk_fsync: bool = False
    namespace_salt: str = ""
    store_generated: bool = False
    load_timeout_s: float = 30.0
    cpu_background_stores: bool = False
    disk_allow_unsafe_permissions: bool = False
    remote_url: str | None = None
    remote_cluster_nodes: list[str] | None = None
    remote_timeout_s: float = 2.0
    remote_lookup_budget_ms: float = 50.0
    remote_max_value_size: int | str = "256MiB"
    remote_key_prefix: str = "kv-offload"
    remote_ttl_s: int | None = None
    remote_max_backoff_s: float = 30.0
    connector_reset: str = "all"

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "cpu_size", parse_size(self.cpu_size, name="cpu_size"))
        set_(self, "disk_size", parse_size(self.disk_size, name="disk_size"))
        if self.cpu_size == 0:
            raise ValueError("cpu_size: must be > 0; the CPU tier stages every transfer")
        if self.disk_path is not None:
            if not isinstance(self.disk_path, (str, os.PathLike)) or not str(self.disk_path):
                raise ValueError(
                    f"disk_path: expected a directory path or None, got {self.disk_path!r}"
                )
            # Only the string is checked here: the directory is checked where the store is
            # opened (DiskIndex.open, SlabFile, `kv-offload warm` before its engine starts).
            set_(self, "disk_path", os.path.abspath(os.path.expanduser(str(self.disk_path))))
            if self.disk_size == 0:
                raise ValueError("disk_size: must be > 0 when disk_path is set")
        if self.chunk_tokens is not None:
            _check_int(self.chunk_tokens, "chunk_tokens", minimum=1)
        if self.connector_reset not in CONNECTOR_RESETS:
            raise ValueError(
                f"connector_reset: {self.connector_reset!r} is not supported; choose one of "
                f"{', '.join(CONNECTOR_RESETS)}")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy: {self.eviction_policy!r} is not supported; "
                f"choose one of {', '.join(EVICTION_POLICIES)}"
            )
        _check_int(self.io_threads, "io_threads", minimum=1)
        for name in ("verify_checksums", "disk_fsync", "store_generated",
                     "disk_allow_unsafe_permissions", "cpu_background_stores"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not isinstance(self.namespace_salt, str):
            raise ValueError(f"namespace_salt: expected a string, got {self.namespace_salt!r}")
        timeout = self.load_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"load_timeout_s: expected a positive number, got {timeout!r}")
        self._check_remote()

    def _check_remote(self) -> None:
        set_ = object.__setattr__
        set_(self, "remote_max_value_size",
             parse_size(self.remote_max_value_size, name="remote_max_value_size"))
        url, nodes = self.remote_url, self.remote_cluster_nodes
        if url is not None:
            if not isinstance(url, str) or not url.startswith(_REMOTE_SCHEMES):
                raise ValueError(
                    f"remote_url: expected a URL starting with one of "
                    f"{', '.join(_REMOTE_SCHEMES)} (e.g. 'redis://10.0.0.5:6379/0'), got {url!r}")
            if nodes:
                raise ValueError("remote_url and remote_cluster_nodes are both set; use "
                                 "remote_url for one server, remote_cluster_nodes for a cluster")
        if nodes is not None:
            if isinstance(nodes, str):
                nodes = [n for n in nodes.split(",") if n.strip()]
            if not isinstance(nodes, (list, tuple)) or not nodes or not all(
                    isinstance(n, str) and _NODE_RE.match(n.strip()) for n in nodes):
                raise ValueError(
                    f"remote_cluster_nodes: expected a list of seed nodes like "
                    f"['10.0.0.5:7000', '10.0.0.6:7000'], got {self.remote_cluster_nodes!r}")
            set_(self, "remote_cluster_nodes", [n.strip() for n in nodes])
        for name in ("remote_timeout_s", "remote_lookup_budget_ms", "remote_max_backoff_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        if self.remote_max_value_bytes <= 0:
            raise ValueError("remote_max_value_size: must be > 0")
        prefix = self.remote_key_prefix
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", prefix):
            raise ValueError(
                f"remote_key_prefix: use 1-64 letters, digits or '_.:-', got {prefix!r}")
        if self.remote_ttl_s is not None:
            _check_int(self.remote_ttl_s, "remote_ttl_s", minimum=1)

    # -- derived values -------------------------------------------------------------------

    @property
    def cpu_bytes(self) -> int:
        """``cpu_size`` in bytes (validation parsed a size given as a string)."""
        return parse_size(self.cpu_size, name="cpu_size")

    @property
    def disk_bytes(self) -> int:
        """``disk_size`` in bytes."""
        return parse_size(self.disk_size, name="disk_size")

    @property
    def remote_max_value_bytes(self) -> int:
        """``remote_max_value_size`` in bytes."""
        return parse_size(self.remote_max_value_size, name="remote_max_value_size")

    @property
    def disk_enabled(self) -> bool:
        return self.disk_path is not None

    @property
    def remote_enabled(self) -> bool:
        return self.remote_url is not None or bool(self.remote_cluster_nodes)

    def resolve_chunk_tokens(self, block_size: int) -> int:
        """Tokens per chunk for an engine with ``block_size``; ValueError if incompatible."""
        if self.chunk_tokens is None:
            return max(1, -(-256 // block_size)) * block_size
        if self.chunk_tokens % block_size:
            lower = max(block_size, self.chunk_tokens // block_size * block_size)
            raise ValueError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of vLLM's block size "
                f"{block_size}; use {lower} or {lower + block_size}, or leave it unset"
            )
        return self.chunk_tokens

    # -- conversions ------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> OffloadConfig:
        """Build from vLLM's ``kv_connector_extra_config`` dict; unknown keys are errors."""
        extra = dict(extra or {})
        valid = cls.field_names()
        for key in extra:
            if key not in valid:
                close = difflib.get_close_matches(key, valid, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"unknown kv-offload option {key!r}.{hint} "
                    f"Valid options: {', '.join(valid)}"
                )
        return cls(**extra)

    def to_extra_config(self) -> dict[str, Any]:
        """The ``kv_connector_extra_config`` dict (JSON-serialisable, sizes in bytes)."""
        return {name: getattr(self, name) for name in self.field_names()}

    def to_kv_transfer_dict(self) -> dict[str, Any]:
        """The full ``--kv-transfer-config`` object as a dict."""
        return {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            # A failed load (checksum mismatch, I/O error) must be recomputed, not
            # turned into a failed request: vLLM's default policy is "fail".
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": self.to_extra_config(),
        }

    def to_json(self) -> str:
        """The JSON string for ``vllm serve --kv-transfer-config``."""
        return json.dumps(self.to_kv_transfer_dict())

    def to_kv_transfer_config(self) -> Any:
        """vLLM's ``KVTransferConfig`` for ``LLM(kv_transfer_config=...)``."""
        from vllm.config import KVTransferConfig

        return KVTransferConfig(**self.to_kv_transfer_dict())

    @classmethod
    def from_json(cls, text: str) -> OffloadConfig:
        """Parse a ``--kv-transfer-config`` JSON string or a bare extra-config object."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-offload config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("kv-offload config JSON must be an object")
        if "kv_connector_extra_config" in data:
            data = data["kv_connector_extra_config"]
        return cls.from_extra_config(data)


def _check_int(value: Any, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
