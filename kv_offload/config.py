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
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kv_offload.remote.address import (
    check_cluster_node,
    check_env_name,
    check_password_file,
    check_server_url,
    has_password,
    has_user_only,
    read_password,
    redact,
)
from kv_offload.sizes import format_size, parse_size
from kv_offload.tier_plugins import check_specs

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "OffloadConfig", "format_size", "parse_size"]

CONNECTOR_NAME = "KVOffloadConnector"
CONNECTOR_MODULE = "kv_offload.connector"

EVICTION_POLICIES = ("lru", "fifo")
CONNECTOR_RESETS = ("all", "cpu")
COPY_MODES = ("auto", "dma", "kernel")  # kv_offload.copy.cupy_engine.COPY_MODES
MAX_SECONDS = 86400  # one day: the longest time value (a timeout, a budget, a backoff)
MAX_TTL_S = 10 * 365 * 86400  # ten years; Redis refuses an expiry past its own limit
# The fields of vLLM's KVTransferConfig: a JSON object holding any of them is the whole
# --kv-transfer-config, whose kv_connector_extra_config holds kv-offload's options.
KV_TRANSFER_FIELDS = frozenset({
    "kv_connector", "kv_connector_module_path", "kv_connector_extra_config", "kv_role",
    "kv_rank", "kv_parallel_size", "kv_ip", "kv_port", "kv_buffer_device", "kv_buffer_size",
    "kv_load_failure_policy", "engine_id", "enable_permute_local_kv"})


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
        remote_password_env: the name of an environment variable that holds the server's
            password, read when the tier starts (vLLM's engine processes inherit it). The
            way to keep the password out of the config, which vLLM prints at start-up and
            ``vllm serve`` shows on its command line; the URL then has no password
            ("redis://host:6379/0", or "redis://USER@host:6379/0" for an ACL user).
        remote_password_file: instead, the absolute path of a file that holds the password
            (a mounted secret); one trailing line break is ignored.
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
        copy_mode: how CUDA copies move KV between the GPU and the CPU tier. "dma": the
            GPU's copy engines (one cuMemcpyBatchAsync per copy on 12.8+ drivers), never
            the SMs the forward runs on; "kernel": one SM kernel launch per copy (fewer
            calls, but it competes with the forward); "auto" (default): "dma" for now.
            Ignored on vLLM's CPU backend.
        audit_rate: the fraction of stored and loaded chunks whose copy is checked again
            at run time (the device blocks re-read and compared with the host slot); a
            mismatch discards the chunk and falls back to the plainest copy path.
            Default 0.01; 0 turns the audit off.
        sync_load_budget_ms: copy time a step may spend loading CPU-tier hits before its
            forward, so that their requests run in the step that schedules them (a
            same-step load) instead of waiting a step outside the batch. The whole batch's
            forward waits for these copies: the budget bounds that wait, at the load
            bandwidth the workers measure. Hits past it, and disk and remote hits, load
            asynchronously. Default 20; 0 turns same-step loads off. Models with several
            KV cache groups (hybrids) always load asynchronously.
        partial_hits: serve a hit to the last cached token, not only whole chunks: a
            request that ends inside a chunk is served that chunk up to its last token
            but one, and the tokens a request computed past its last whole chunk (its
            tail) are kept in the CPU, disk and remote tiers once its prompt is computed,
            for a later prompt that shares them (the next turn of a chat). Default true; models with several
            KV cache groups (hybrids) are served whole chunks only.
        extra_tiers: secondary tiers from other packages, asked after the disk and
            remote tiers: a list of factories, "package.module:factory"
            (``kv_offload.tier_plugins``). Default none.
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
    remote_password_env: str | None = None
    remote_password_file: str | None = None
    remote_timeout_s: float = 2.0
    remote_lookup_budget_ms: float = 50.0
    remote_max_value_size: int | str = "256MiB"
    remote_key_prefix: str = "kv-offload"
    remote_ttl_s: int | None = None
    remote_max_backoff_s: float = 30.0
    connector_reset: str = "all"
    copy_mode: str = "auto"
    audit_rate: float = 0.01
    sync_load_budget_ms: float = 20.0
    partial_hits: bool = True
    extra_tiers: list[str] | None = None

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
                     "disk_allow_unsafe_permissions", "cpu_background_stores",
                     "partial_hits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if not isinstance(self.namespace_salt, str):
            raise ValueError(f"namespace_salt: expected a string, got {self.namespace_salt!r}")
        _check_seconds(self.load_timeout_s, "load_timeout_s", maximum=MAX_SECONDS)
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode: {self.copy_mode!r} is not supported; choose one of "
                             f"{', '.join(COPY_MODES)}")
        rate = self.audit_rate
        if (isinstance(rate, bool) or not isinstance(rate, (int, float))
                or not math.isfinite(rate) or not 0 <= rate <= 1):
            raise ValueError(f"audit_rate: expected a fraction from 0 (off) to 1, got {rate!r}")
        budget = self.sync_load_budget_ms
        if budget != 0:
            _check_seconds(budget, "sync_load_budget_ms (0 turns same-step loads off)",
                           maximum=10_000, unit="milliseconds")
        self._check_remote()
        set_(self, "extra_tiers", check_specs(self.extra_tiers) or None)

    def _check_remote(self) -> None:
        set_ = object.__setattr__
        set_(self, "remote_max_value_size",
             parse_size(self.remote_max_value_size, name="remote_max_value_size"))
        url, nodes = self.remote_url, self.remote_cluster_nodes
        if url is not None:
            check_server_url(url)
            if nodes:
                raise ValueError("remote_url and remote_cluster_nodes are both set; use "
                                 "remote_url for one server, remote_cluster_nodes for a cluster")
        if nodes is not None:
            if isinstance(nodes, str):
                nodes = [n for n in nodes.split(",") if n.strip()]
            if not isinstance(nodes, (list, tuple)) or not nodes:
                raise ValueError(
                    f"remote_cluster_nodes: expected a list of seed nodes like "
                    f"['10.0.0.5:7000', '10.0.0.6:7000'], got {_redacted(nodes)!r}")
            set_(self, "remote_cluster_nodes", [check_cluster_node(n) for n in nodes])
        self._check_password_source()
        _check_seconds(self.remote_timeout_s, "remote_timeout_s", maximum=MAX_SECONDS)
        _check_seconds(self.remote_lookup_budget_ms, "remote_lookup_budget_ms",
                       maximum=MAX_SECONDS * 1000, unit="milliseconds")
        _check_seconds(self.remote_max_backoff_s, "remote_max_backoff_s", maximum=MAX_SECONDS)
        if self.remote_max_value_bytes <= 0:
            raise ValueError("remote_max_value_size: must be > 0")
        prefix = self.remote_key_prefix
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,64}", prefix):
            raise ValueError(
                f"remote_key_prefix: use 1-64 letters, digits or '_.:-', got {prefix!r}")
        if self.remote_ttl_s is not None:
            _check_int(self.remote_ttl_s, "remote_ttl_s", minimum=1)
            if self.remote_ttl_s > MAX_TTL_S:
                raise ValueError(
                    f"remote_ttl_s: at most {MAX_TTL_S} seconds (ten years), got "
                    f"{self.remote_ttl_s}; to keep values until the server evicts them, "
                    f"leave it unset")

    def _check_password_source(self) -> None:
        """At most one place holds the password: the URL, an environment variable or a
        file; those two need a server. No message shows a password."""
        env, path = self.remote_password_env, self.remote_password_file
        if env is not None:
            check_env_name(env)
        if path is not None:
            object.__setattr__(self, "remote_password_file", check_password_file(path))
        if env is not None and path is not None:
            raise ValueError("remote_password_env and remote_password_file are both set; keep "
                             "one of them")
        source = ("remote_password_env" if env is not None
                  else "remote_password_file" if path is not None else None)
        field, urls = (("remote_url", [self.remote_url]) if self.remote_url is not None
                       else ("remote_cluster_nodes", self.remote_cluster_nodes or []))
        if source is not None and not urls:
            raise ValueError(f"{source}: set, but no remote server is configured; set "
                             f"remote_url (or remote_cluster_nodes), or remove {source}")
        if source is not None and any(has_password(u) for u in urls):
            raise ValueError(
                f"{field} holds a password and {source} is set; keep one: remove the "
                f"password from {field} (e.g. 'redis://10.0.0.5:6379/0', or "
                f"'redis://USER@10.0.0.5:6379/0' for an ACL user)")
        if source is None and any(has_user_only(u) for u in urls):
            raise ValueError(
                f"{field}: names a user but no password, and the server cannot be logged in "
                f"to with a user alone; give the password with remote_password_env or "
                f"remote_password_file, or drop the user name (if that name is the "
                f"password, move it to remote_password_env)")

    def __repr__(self) -> str:
        """The fields, with any password in ``remote_url`` or ``remote_cluster_nodes``
        shown as ``***``."""
        shown = {name: getattr(self, name) for name in self.field_names()}
        shown["remote_url"] = _redacted(self.remote_url)
        shown["remote_cluster_nodes"] = _redacted(self.remote_cluster_nodes)
        return f"OffloadConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

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

    @property
    def remote_password_in_config(self) -> bool:
        """A password is written in ``remote_url`` or ``remote_cluster_nodes``: vLLM prints
        it with the config (``remote_password_env`` keeps it out)."""
        urls = [self.remote_url] if self.remote_url else self.remote_cluster_nodes or []
        return any(has_password(u) for u in urls)

    def resolve_chunk_tokens(self, block_size: int, max_model_len: int | None = None) -> int:
        """Tokens per chunk for an engine with ``block_size`` and ``max_model_len``.

        ValueError naming ``chunk_tokens`` when it is not a multiple of the block size, or
        when no request can fill a chunk (a request holds at most ``max_model_len`` tokens
        and a hit leaves its last one to compute): nothing would be stored or loaded."""
        if self.chunk_tokens is None:
            chunk = max(1, -(-256 // block_size)) * block_size
        elif self.chunk_tokens % block_size:
            lower = max(block_size, self.chunk_tokens // block_size * block_size)
            raise ValueError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of vLLM's block size "
                f"{block_size}; use {lower} or {lower + block_size}, or leave it unset"
            )
        else:
            chunk = self.chunk_tokens
        if max_model_len is not None and chunk >= max_model_len:
            raise ValueError(self._chunk_too_long(chunk, block_size, max_model_len))
        return chunk

    def _chunk_too_long(self, chunk: int, block_size: int, max_model_len: int) -> str:
        if max_model_len <= block_size:
            return (f"chunk_tokens: max_model_len {max_model_len} is not longer than one "
                    f"block ({block_size} tokens), so no request fills a chunk: nothing would "
                    f"be stored or loaded; raise max_model_len (--max-model-len) or run "
                    f"without the connector")
        example = max(block_size, max_model_len // 2 // block_size * block_size)
        default = " (the default)" if self.chunk_tokens is None else ""
        return (f"chunk_tokens: a chunk of {chunk} tokens{default} is not shorter than "
                f"max_model_len {max_model_len}, so no request ever fills one: nothing would "
                f"be stored or loaded. Set chunk_tokens to a multiple of the block size "
                f"{block_size} below {max_model_len}, e.g. {example}, or raise max_model_len "
                f"(--max-model-len)")

    def remote_password(self) -> str | None:
        """The remote server's password from ``remote_password_env`` or
        ``remote_password_file``, read now (None when neither is set). ValueError names
        the option and the fix, never the password."""
        return read_password(env_name=self.remote_password_env,
                             file_path=self.remote_password_file)

    # -- conversions ------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> OffloadConfig:
        """Build from vLLM's ``kv_connector_extra_config`` dict; unknown keys are errors."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            quotes = (" (a JSON object written as a string? remove the quotes around it)"
                      if isinstance(extra, str) else "")
            raise ValueError(
                f'kv_connector_extra_config: expected an object of kv-offload options, e.g. '
                f'{{"cpu_size": "8GiB"}}, got {_json_kind(extra)}{quotes}')
        extra = dict(extra)
        valid = cls.field_names()
        for key in extra:
            if key in KV_TRANSFER_FIELDS:
                raise ValueError(
                    f"{key!r} is a field of --kv-transfer-config, not a kv-offload option: "
                    f"put it next to kv_connector_extra_config, not inside it")
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
    def from_kv_transfer_dict(cls, data: Mapping[str, Any]) -> OffloadConfig:
        """Build from a whole ``--kv-transfer-config`` object: its
        ``kv_connector_extra_config`` holds the options. Refuses one for another connector,
        and kv-offload options written next to ``kv_connector`` instead of inside."""
        connector = data.get("kv_connector")
        if connector is not None and connector != CONNECTOR_NAME:
            raise ValueError(
                f"kv_connector: this --kv-transfer-config is for {connector!r}, not kv-offload "
                f"({CONNECTOR_NAME!r}); pass kv-offload's --kv-transfer-config or only its "
                f"kv_connector_extra_config object")
        options = cls.field_names()
        for key in data:
            if key in options:
                raise ValueError(
                    f"{key}: a kv-offload option belongs inside kv_connector_extra_config, "
                    f"not next to kv_connector")
            close = difflib.get_close_matches(key, KV_TRANSFER_FIELDS, n=1, cutoff=0.8)
            if key not in KV_TRANSFER_FIELDS and close:
                raise ValueError(f"unknown --kv-transfer-config field {key!r}. Did you mean "
                                 f"{close[0]!r}?")
        return cls.from_extra_config(data.get("kv_connector_extra_config"))

    @classmethod
    def from_json(cls, text: str) -> OffloadConfig:
        """Parse a ``--kv-transfer-config`` JSON string or a bare extra-config object."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-offload config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("kv-offload config JSON must be an object")
        if data.keys() & KV_TRANSFER_FIELDS:
            return cls.from_kv_transfer_dict(data)
        return cls.from_extra_config(data)


def _check_seconds(value: Any, name: str, *, maximum: int, unit: str = "seconds") -> None:
    """A time value: a positive, finite number of ``unit``, at most ``maximum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name}: expected a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number of {unit}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name}: at most {maximum} {unit}, got {value!r}")


def _redacted(value: Any) -> Any:
    """``value`` (a URL, a list of them, anything) with every password shown as ``***``."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, (list, tuple)):
        return [_redacted(v) for v in value]
    return value


def _json_kind(value: Any) -> str:
    kinds = {str: "a string", list: "a list", tuple: "a list", bool: "true or false",
             int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def _check_int(value: Any, name: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
