"""Remote value format: anything but an intact value of this key and size is a miss."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from redis.crc import key_slot

from kv_offload.remote.values import (
    FORMAT_VERSION,
    HEADER_BYTES,
    ValueCheck,
    check_value,
    encode_header,
    key_name,
    namespace_pattern,
)

NS = "ab" * 16
PAYLOAD = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()


def value_for(name: bytes, payload: bytes = PAYLOAD) -> bytes:
    return encode_header(name, payload) + payload


def test_intact_value_verifies():
    name = key_name("kvo", NS, b"\x01" * 32, 0, 1)
    assert check_value(name, value_for(name), len(PAYLOAD)) is ValueCheck.OK


@pytest.mark.parametrize("damage, expected", [
    (lambda v: None, ValueCheck.MISSING),
    (lambda v: v[:10], ValueCheck.BAD_FORMAT),
    (lambda v: b"XXXX" + v[4:], ValueCheck.BAD_FORMAT),
    (lambda v: v[:4] + struct.pack("<H", FORMAT_VERSION + 1) + v[6:], ValueCheck.BAD_FORMAT),
    (lambda v: v[:-1], ValueCheck.BAD_LENGTH),
    (lambda v: v + b"\0", ValueCheck.BAD_LENGTH),
    (lambda v: v[:HEADER_BYTES] + bytes([v[HEADER_BYTES] ^ 1]) + v[HEADER_BYTES + 1:],
     ValueCheck.BAD_CHECKSUM),
])
def test_damaged_values_are_misses(damage, expected):
    name = key_name("kvo", NS, b"\x01" * 32, 0, 1)
    result = check_value(name, damage(value_for(name)), len(PAYLOAD))
    assert result is expected and not result


def test_value_of_another_key_rank_or_namespace_is_refused():
    """A value copied (or written by a buggy client) under the wrong name never loads."""
    name = key_name("kvo", NS, b"\x01" * 32, 0, 2)
    for other in (key_name("kvo", NS, b"\x02" * 32, 0, 2), key_name("kvo", NS, b"\x01" * 32, 1, 2),
                  key_name("kvo", "cd" * 16, b"\x01" * 32, 0, 2)):
        assert check_value(name, value_for(other), len(PAYLOAD)) is ValueCheck.WRONG_KEY


def test_ranks_of_a_chunk_share_a_cluster_slot_and_chunks_spread():
    """The hash tag puts every rank of one chunk on one node (one multi-key EXISTS)."""
    chunk = b"\x07" * 32
    assert len({key_slot(key_name("kvo", NS, chunk, r, 4)) for r in range(4)}) == 1
    slots = {key_slot(key_name("kvo", NS, bytes([i]) * 32, 0, 1)) for i in range(64)}
    assert len(slots) > 50


def test_namespace_pattern_matches_only_its_namespace():
    import fnmatch

    name = key_name("kvo", NS, b"\x01" * 32, 0, 1).decode()
    assert fnmatch.fnmatchcase(name, namespace_pattern("kvo", NS).decode())
    assert fnmatch.fnmatchcase(name, namespace_pattern("kvo").decode())
    assert not fnmatch.fnmatchcase(name, namespace_pattern("kvo", "cd" * 16).decode())


def test_the_tier_names_keys_exactly_like_key_name():
    import os

    from kv_offload.remote import RemoteTarget, RemoteTier

    for namespace in (NS, "00" * 16, "0a" * 16):
        tier = RemoteTier(RemoteTarget("redis://127.0.0.1:1/0"), namespace=namespace,
                          num_ranks=4, payload_bytes=1, timeout_s=1, key_prefix="kv-offload")
        for _ in range(20):
            chunk = os.urandom(32)
            for rank in range(4):
                assert tier.name(chunk, rank) == key_name("kv-offload", namespace, chunk, rank, 4)
