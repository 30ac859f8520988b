"""read_value_into: a GET reply received straight into the host slot.

A fake connection replays crafted replies in pieces of chosen sizes (a real socket
splits them anywhere). Regression scenarios: a reply must never be half-read on a
connection that goes back to the pool (the next GET would read the rest as its
value); a foreign or misplaced value must not touch the slot.
"""

from __future__ import annotations

import numpy as np
import pytest

from kv_offload.remote.bulk import RespErrorReply, RespProtocolError, read_value_into
from kv_offload.remote.values import ValueCheck, encode_header
from kv_offload.testing.clock import FakeClock

NAME = b"kvo:{ns:00}:r0of1"
SLOT = 4096


class FakeSock:
    """Replays ``pieces``: each recv_into returns at most one piece (or its rest), and
    takes ``delay_s`` on ``clock``; a receive longer than the socket's timeout times
    out once the timeout has passed (as a socket does)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [p for p in pieces if p]
        self.recvs: list[tuple[int, object]] = []  # (bytes asked for, buffer object)
        self.clock = FakeClock()

    def recv_into(self, buf, nbytes: int = 0) -> int:
        if not self.pieces:
            return 0
        if self.pieces[0] == b"TIMEOUT":
            raise TimeoutError("timed out")  # what socket.timeout is
        if self.delay_s > self.timeout:
            self.clock.now += self.timeout
            raise TimeoutError("timed out")
        self.clock.now += self.delay_s
        want = nbytes or len(buf)
        self.recvs.append((want, buf.obj if isinstance(buf, memoryview) else buf))
        piece = self.pieces[0][:want]
        memoryview(buf)[:len(piece)] = piece
        self.pieces[0] = self.pieces[0][len(piece):]
        if not self.pieces[0]:
            self.pieces.pop(0)
        return len(piece)

    timeout = 0.5
    delay_s = 0.0  # each receive takes this long (a server trickling the value)

    def gettimeout(self) -> float:
        return self.timeout

    def settimeout(self, seconds: float) -> None:
        self.timeout = seconds


class FakeConn:
    def __init__(self, pieces: list[bytes]) -> None:
        self._sock = FakeSock(pieces)
        self.sent: list[bytes] = []
        self.disconnected = False

    def send_packed_command(self, pieces) -> None:
        self.sent.append(b"".join(bytes(p) for p in pieces))

    def disconnect(self) -> None:
        self.disconnected = True


def payload(seed: int = 1) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, SLOT, dtype=np.uint8).tobytes()


def value(data: bytes, name: bytes = NAME) -> bytes:
    return encode_header(name, data) + data


def bulk(raw: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(raw), raw)


def split(data: bytes, sizes: list[int]) -> list[bytes]:
    out, at = [], 0
    for size in sizes:
        out.append(data[at:at + size])
        at += size
    return out + [data[at:]]


def read(pieces: list[bytes], out: bytearray | None = None):
    conn = FakeConn(pieces)
    out = out if out is not None else bytearray(b"\x55" * SLOT)
    result = read_value_into(conn, NAME, memoryview(out))
    return result, out, conn


@pytest.mark.parametrize("sizes", [[], [1, 1, 1, 1], [7, 30, 3, 1000], [60, 4000]])
def test_a_value_lands_in_the_slot_whatever_the_split(sizes):
    data = payload()
    result, out, conn = read(split(bulk(value(data)), sizes))
    assert result is ValueCheck.OK
    assert bytes(out) == data
    assert conn.sent == [b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(NAME), NAME)]
    assert not conn.disconnected, "the whole reply was read: the connection is reusable"


def test_the_reply_line_is_read_in_small_pieces():
    """At most 64 bytes of a reply are received outside the caller's buffers."""
    conn = FakeConn([bulk(value(payload()))])
    out = bytearray(SLOT)
    assert read_value_into(conn, NAME, memoryview(out)) is ValueCheck.OK
    assert any(obj is out for _, obj in conn._sock.recvs), "received into the slot itself"
    assert all(want <= 64 for want, obj in conn._sock.recvs if obj is not out)


@pytest.mark.parametrize("reply", [b"$-1\r\n", b"_\r\n"])
def test_missing_key_in_resp2_and_resp3(reply):
    result, out, conn = read([reply])
    assert result is ValueCheck.MISSING
    assert out == bytearray(b"\x55" * SLOT) and not conn.disconnected


def test_bytes_after_a_missing_reply_do_not_go_back_to_the_pool():
    result, _, conn = read([b"$-1\r\n+extra\r\n"])
    assert result is ValueCheck.MISSING
    assert conn.disconnected


def test_error_reply_raises_and_keeps_the_connection():
    with pytest.raises(RespErrorReply) as info:
        read([b"-MOVED 3999 127.0.0.1:6381\r\n"])
    assert info.value.moved


@pytest.mark.parametrize("raw, expected", [
    (value(payload(), name=b"another key"), ValueCheck.WRONG_KEY),
    (value(payload()[:-8]), ValueCheck.BAD_LENGTH),
    (b"not a kv-offload value at all, long enough for a header" * 2, ValueCheck.BAD_FORMAT),
    (b"short", ValueCheck.BAD_FORMAT),
])
def test_a_foreign_or_misplaced_value_leaves_the_slot_untouched(raw, expected):
    result, out, conn = read([bulk(raw)])
    assert result is expected
    assert out == bytearray(b"\x55" * SLOT)
    assert conn.disconnected, "the rest of the reply was not read: never back to the pool"


def test_a_damaged_payload_is_a_miss():
    data = payload()
    damaged = bytearray(value(data))
    damaged[-1] ^= 0xFF
    result, _, conn = read([bulk(bytes(damaged))])
    assert result is ValueCheck.BAD_CHECKSUM
    assert not conn.disconnected


@pytest.mark.parametrize("reply", [
    b"+OK\r\n",
    b"$abc\r\n",
    bulk(value(payload()))[:-2] + b"XX",  # not ending where the length says
])
def test_protocol_surprises_raise_and_disconnect(reply):
    conn = FakeConn([reply])
    with pytest.raises(RespProtocolError):
        read_value_into(conn, NAME, memoryview(bytearray(SLOT)))
    assert conn.disconnected


@pytest.mark.parametrize("pieces, error", [
    ([bulk(value(payload()))[:1000]], ConnectionError),  # closed mid-value
    ([bulk(value(payload()))[:1000], b"TIMEOUT"], TimeoutError),
])
def test_closed_or_timed_out_mid_value_disconnects(pieces, error):
    conn = FakeConn(pieces)
    with pytest.raises(error):
        read_value_into(conn, NAME, memoryview(bytearray(SLOT)))
    assert conn.disconnected


def test_a_slot_of_wider_elements_is_filled_byte_for_byte():
    data = payload()
    out = np.zeros(SLOT // 4, dtype=np.float32)
    conn = FakeConn([bulk(value(data))])
    assert read_value_into(conn, NAME, memoryview(out)) is ValueCheck.OK
    assert out.tobytes() == data


def test_a_server_trickling_a_value_is_a_timeout_for_the_whole_reply():
    """remote_timeout_s bounded each receive only: a server sending the value in pieces,
    each within the timeout, held the I/O thread and its host slot as long as it liked.
    Six receives of 0.1 s against a 0.3 s timeout: the read gives up by 0.3 s (on the
    socket's fake clock), before the whole reply arrived."""
    conn = FakeConn(split(bulk(value(payload())), [100, 1000, 1000, 1000, 1000, 1000]))
    sock = conn._sock
    sock.timeout, sock.delay_s = 0.3, 0.1
    with pytest.raises(TimeoutError):
        read_value_into(conn, NAME, memoryview(bytearray(SLOT)), clock=sock.clock)
    assert sock.clock.now == pytest.approx(0.3) and sock.pieces, "gave up by the timeout"
    assert conn.disconnected


def test_a_connection_goes_back_with_its_own_timeout():
    conn = FakeConn([bulk(value(payload()))])
    assert read_value_into(conn, NAME, memoryview(bytearray(SLOT))) is ValueCheck.OK
    assert conn._sock.timeout == 0.5 and not conn.disconnected
