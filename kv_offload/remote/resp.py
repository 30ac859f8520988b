"""RESP (the Redis protocol) encoding without copies, and a raw pipeline.

Why not redis-py's own: with hiredis installed, redis-py packs every command with
hiredis, which turns a large value into ``bytes`` and then copies it into one new
buffer (two copies of every chunk; stores ran ~3x slower in benchmarks/bench_remote.py).
``RespPacker`` sends large values and ``Joined`` (header + payload) as their own
buffers. ``pipeline_on_connection`` sends many small commands in one write and reads
the replies without redis-py's per-command pipeline machinery (~4 us per command
instead of ~15 us). Replies are still parsed by redis-py (hiredis when installed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_INLINE_MAX = 16 * 1024  # smaller arguments are copied into the command buffer


class Joined:
    """One bulk-string argument made of several buffers, sent without joining them."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, *parts: Any) -> None:
        self.parts = tuple(memoryview(p).cast("B") for p in parts)
        self.nbytes = sum(len(p) for p in self.parts)


def pack_command(*args: Any) -> list[Any]:
    """The RESP encoding of one command as a list of buffers to send in order.

    Arguments: bytes-like, ``str`` (UTF-8), ``int``, ``float`` or ``Joined``.
    Large bytes-like arguments are referenced, not copied: keep them unchanged until
    the command was sent.
    """
    if all(type(a) is bytes and len(a) <= _INLINE_MAX for a in args):  # lookups: fast path
        return [b"*%d\r\n" % len(args)
                + b"".join([b"$%d\r\n%b\r\n" % (len(a), a) for a in args])]
    out: list[Any] = []
    head = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, Joined):
            head.append(b"$%d\r\n" % arg.nbytes)
            out.append(b"".join(head))
            out.extend(arg.parts)
            head = [b"\r\n"]
            continue
        if isinstance(arg, str):
            arg = arg.encode()
        elif isinstance(arg, bool):
            raise TypeError("Redis commands take no booleans")
        elif isinstance(arg, (int, float)):
            arg = repr(arg).encode()
        view = memoryview(arg).cast("B")
        if len(view) > _INLINE_MAX:
            head.append(b"$%d\r\n" % len(view))
            out.append(b"".join(head))
            out.append(view)
            head = [b"\r\n"]
        else:
            head.append(b"$%d\r\n%b\r\n" % (len(view), view.tobytes()))
    out.append(b"".join(head))
    return out


class RespPacker:
    """A redis-py ``command_packer`` built on ``pack_command``."""

    def pack(self, *args: Any) -> list[Any]:
        # redis-py passes some commands with their sub-command in one string ("CONFIG GET").
        if isinstance(args[0], str) and " " in args[0]:
            args = (*args[0].split(), *args[1:])
        return pack_command(*args)


def pack_commands(commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Several commands as buffers to send in order: small pieces joined, large values
    referenced (one ``sendall`` per large value, one for everything between)."""
    out: list[Any] = []
    small: list[bytes] = []
    for command in commands:
        for piece in pack_command(*command):
            if isinstance(piece, bytes):
                small.append(piece)
                continue
            if small:
                out.append(b"".join(small))
                small = []
            out.append(piece)
    if small:
        out.append(b"".join(small))
    return out


def pipeline_on_connection(pool: Any, commands: Sequence[Sequence[Any]]) -> list[Any]:
    """Send ``commands`` on one pooled connection of a standalone server and read every
    reply, packed by ``pack_command`` whatever packer the client was built with.

    A failed or timed-out connection is closed before it returns to the pool, so the
    next caller reconnects instead of reading stale replies. Raises what redis-py raises
    (an error reply included).
    """
    pieces = pack_commands(commands)
    conn = pool.get_connection()
    try:
        conn.send_packed_command(pieces)
        return [conn.read_response() for _ in commands]
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def pipelines_on_connections(batches: Mapping[Any, Sequence[Sequence[Any]]]
                             ) -> dict[Any, list[Any]]:
    """``pipeline_on_connection`` on several pools at once (the nodes of a cluster):
    every pool's commands are sent before any reply is read, so the round trips overlap
    (one round trip in all, not one per node). Replies per pool, in command order.
    Raises what redis-py raises; every connection is released, failed ones closed."""
    taken: list[tuple[Any, Any]] = []
    try:
        for pool, commands in batches.items():
            conn = pool.get_connection()
            taken.append((pool, conn))
            conn.send_packed_command(pack_commands(commands))
        return {pool: [conn.read_response() for _ in batches[pool]] for pool, conn in taken}
    except BaseException:
        for _, conn in taken:
            conn.disconnect()
        raise
    finally:
        for pool, conn in taken:
            pool.release(conn)
