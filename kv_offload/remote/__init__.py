"""The remote tier: chunks shared between hosts through Redis or Valkey.

The names below load on first use: ``kv_offload.config`` imports ``remote.address`` (URL
checks, no third-party package), and that must not pull in redis or xxhash, which
``benchmarks/gpu_check.sh`` runs without.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_offload.remote.health import RemoteHealth
    from kv_offload.remote.lookups import RemoteLookups
    from kv_offload.remote.tier import RemoteTarget, RemoteTier, connect_redis, remote_tier_for
    from kv_offload.remote.values import ValueCheck, check_value, encode_header, key_name

_WHERE = {"RemoteHealth": "health", "RemoteLookups": "lookups", "RemoteTarget": "tier",
          "RemoteTier": "tier", "connect_redis": "tier", "remote_tier_for": "tier",
          "ValueCheck": "values", "check_value": "values", "encode_header": "values",
          "key_name": "values"}

__all__ = ["RemoteHealth", "RemoteLookups", "RemoteTarget", "RemoteTier", "ValueCheck",
           "check_value", "connect_redis", "encode_header", "key_name", "remote_tier_for"]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
