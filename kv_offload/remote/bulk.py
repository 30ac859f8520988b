"""Read a value's reply from the socket straight into a host slot: no bytes object.

redis-py's ``GET`` returns the value as a new ``bytes`` (its parser buffers and joins
the reply), which the tier then copied into the host slot: one copy of every chunk
too many. ``read_value_into`` speaks just enough RESP to read the reply to one ``GET``
from the connection's own socket: the reply line, then the value's 40-byte header
into a small buffer (checked before any payload byte moves), then ``recv_into`` the
host slot, then the checksum verified in place.

The connection is a redis-py connection taken from its pool (it already did AUTH,
SELECT and TLS). A connection is returned clean (every byte of the reply consumed)
or disconnected: never half-read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kv_offload.checksum import checksum
from kv_offload.remote.resp import pack_command
from kv_offload.remote.values import HEADER_BYTES, ValueCheck, check_header

_LINE_MAX = 64 * 1024  # an error line longer than this is not Redis talking


class RespProtocolError(ConnectionError):
    """The server's reply is not what a GET answers (a desynchronised connection)."""


class RespErrorReply(Exception):
    """The server answered a GET with an error (``-MOVED ...``, ``-WRONGTYPE ...``)."""

    @property
    def moved(self) -> bool:
        return str(self).startswith(("MOVED ", "ASK "))


class _Reader:
    """Bytes of one reply: a few already received (``pending``), the rest on ``sock``,
    all of it by ``deadline`` (on ``clock``; None: each receive bounded by the socket's
    own timeout only). A server that trickles a value slower raises TimeoutError."""

    def __init__(self, sock: Any, deadline: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sock = sock
        self.pending = b""
        self.deadline = deadline
        self._clock = clock

    def _recv_into(self, buf: Any, nbytes: int = 0) -> int:
        if self.deadline is not None:
            left = self.deadline - self._clock()
            if left <= 0:
                raise TimeoutError("the reply did not arrive in time")
            self.sock.settimeout(left)
        return int(self.sock.recv_into(buf, nbytes))

    def line(self) -> bytes:
        """The first line of the reply, without CRLF. Receives at most 64 bytes at a
        time, so no more than that of the value lands outside the caller's buffers."""
        data = self.pending
        small = bytearray(64)
        while b"\r\n" not in data:
            if len(data) > _LINE_MAX:
                raise RespProtocolError("reply line too long")
            n = self._recv_into(small, 64)
            if n == 0:
                raise ConnectionError("the server closed the connection")
            data += small[:n]
        end = data.index(b"\r\n")
        self.pending = data[end + 2:]
        return data[:end]

    def fill(self, out: memoryview) -> None:
        """Fill ``out`` exactly: what is pending first, then straight from the socket."""
        have = min(len(self.pending), len(out))
        out[:have] = self.pending[:have]
        self.pending = self.pending[have:]
        while have < len(out):
            n = self._recv_into(out[have:])
            if n == 0:
                raise ConnectionError("the server closed the connection")
            have += n


def read_value_into(conn: Any, name: bytes, out: memoryview, *, verify_checksum: bool = True,
                    clock: Callable[[], float] = time.monotonic) -> ValueCheck:
    """``GET name`` on ``conn`` (a connected redis-py connection) into ``out``.

    ``out`` is written only after the reply's length and the value's header verified
    (magic, format, key digest, payload length); with a bad checksum it then holds
    damaged bytes and the answer is BAD_CHECKSUM: the caller must not use them.
    Raises RespErrorReply for an error reply (the connection stays usable); a timeout,
    a closed connection or RespProtocolError leave it disconnected, like any
    ValueCheck other than OK or MISSING (the rest of the reply was not read). The
    socket's timeout bounds the whole reply, measured on ``clock`` (injected for tests).
    """
    if out.format != "B" or out.ndim != 1:
        out = out.cast("B")  # lengths in bytes, whatever the slot's element type
    conn.send_packed_command(pack_command(b"GET", name))
    clean = False
    sock = conn._sock
    timeout = sock.gettimeout()  # the tier's remote_timeout_s: for the whole reply
    try:
        reader = _Reader(sock, None if timeout is None else clock() + timeout, clock=clock)
        result, clean = _read_reply(reader, name, out, verify_checksum)
        return result
    except RespErrorReply:
        clean = True
        raise
    except TimeoutError as exc:  # socket.timeout, or the whole reply too slow
        raise TimeoutError(f"no whole reply to GET within {timeout}s") from exc
    finally:
        if not clean:
            conn.disconnect()
        elif timeout is not None:
            sock.settimeout(timeout)  # the connection goes back to its pool as it came


def _read_reply(reader: _Reader, name: bytes, out: memoryview, verify_checksum: bool
                ) -> tuple[ValueCheck, bool]:
    """(outcome, whether the whole reply was consumed)."""
    line = reader.line()
    if line[:1] == b"-":
        if reader.pending:
            raise RespProtocolError("bytes after an error reply")
        raise RespErrorReply(line[1:].decode(errors="replace"))
    if line == b"_":  # RESP3's null (redis-py 8 speaks RESP3 when the server does)
        return ValueCheck.MISSING, not reader.pending
    if line[:1] != b"$":
        raise RespProtocolError(f"unexpected reply to GET: {line[:32]!r}")
    try:
        length = int(line[1:])
    except ValueError:
        raise RespProtocolError(f"unexpected reply to GET: {line[:32]!r}") from None
    if length < 0:
        return ValueCheck.MISSING, not reader.pending
    head = bytearray(HEADER_BYTES)
    if length < HEADER_BYTES:
        return ValueCheck.BAD_FORMAT, False
    reader.fill(memoryview(head))
    result, expected = check_header(name, head, length, len(out))
    if result is not ValueCheck.OK:
        return result, False
    reader.fill(out)
    tail = bytearray(2)
    reader.fill(memoryview(tail))
    if tail != b"\r\n" or reader.pending:
        raise RespProtocolError("a GET reply did not end where its length said")
    if verify_checksum and checksum(out) != expected:
        return ValueCheck.BAD_CHECKSUM, True
    return ValueCheck.OK, True
