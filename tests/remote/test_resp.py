"""RESP packing without copies: byte-identical to hiredis's encoding of the same command."""

from __future__ import annotations

import hiredis
import numpy as np
import pytest

from kv_offload.remote.resp import Joined, RespPacker, pack_command

BIG = np.arange(200_000, dtype=np.uint8)


def wire(pieces) -> bytes:
    return b"".join(bytes(p) for p in pieces)


@pytest.mark.parametrize("args", [
    ("PING",),
    ("SET", b"k", b"v", "EX", 60),
    ("EXISTS", b"a:{x}:r0of2", b"a:{x}:r1of2"),
    ("INCRBYFLOAT", "k", 1.5),
    ("SET", "k\u00e9", memoryview(BIG)),
])
def test_same_bytes_as_hiredis(args):
    expected = hiredis.pack_command(tuple(bytes(a) if isinstance(a, memoryview) else a
                                          for a in args))
    assert wire(pack_command(*args)) == expected


def test_large_values_are_referenced_not_copied():
    slot = memoryview(BIG)
    pieces = pack_command("SET", b"key", Joined(b"header", slot), "EX", 5)
    assert any(p.obj is BIG for p in pieces if isinstance(p, memoryview)), "copied"
    assert wire(pieces) == hiredis.pack_command((b"SET", b"key", b"header" + BIG.tobytes(),
                                                 b"EX", b"5"))
    assert not any(p is slot or bytes(p) == BIG.tobytes() for p in pieces
                   if isinstance(p, bytes)), "the big value must not be inside a bytes piece"


def test_packer_splits_commands_with_a_subcommand_and_refuses_booleans():
    assert wire(RespPacker().pack("CONFIG GET", "maxmemory")) == hiredis.pack_command(
        (b"CONFIG", b"GET", b"maxmemory"))
    with pytest.raises(TypeError):
        pack_command("SET", "k", True)
