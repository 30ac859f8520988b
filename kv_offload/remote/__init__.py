"""The remote tier: chunks shared between hosts through Redis or Valkey."""

from kv_offload.remote.health import RemoteHealth
from kv_offload.remote.lookups import RemoteLookups
from kv_offload.remote.tier import RemoteTarget, RemoteTier, connect_redis, remote_tier_for
from kv_offload.remote.values import ValueCheck, check_value, encode_header, key_name

__all__ = ["RemoteHealth", "RemoteLookups", "RemoteTarget", "RemoteTier", "ValueCheck", "check_value",
           "connect_redis", "encode_header", "key_name", "remote_tier_for"]
