"""A raw ZMTP 3.0 peer over a plain TCP socket, for frames no ZeroMQ library would send.

A ZeroMQ socket only sends a frame's size header together with that many bytes, so "a frame
that *declares* 2^40 bytes" needs the wire format by hand: the 64-byte greeting with the NULL
mechanism, a READY command naming a DEALER, then a frame header with the huge size and a few
bytes of body. A server without ZMQ_MAXMSGSIZE starts allocating for it; one with the limit
drops the connection as soon as it reads the header. (RFC 23/ZMTP, sections "Greeting",
"NULL security mechanism" and "Framing".)
"""

from __future__ import annotations

import socket
import struct
import time


def _greeting() -> bytes:
    # signature (0xFF, 8 padding bytes, 0x7F), version 3.0, mechanism "NULL" padded to 20 bytes,
    # as-server 0, 31 bytes of filler: 64 bytes in all
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _ready_command() -> bytes:
    name = b"Socket-Type"
    value = b"DEALER"
    body = bytes([5]) + b"READY" + bytes([len(name)]) + name + struct.pack(">I", len(value)) + value
    return bytes([0x04, len(body)]) + body  # 0x04: a short command frame


def send_oversized_frame(host: str, port: int, declared_bytes: int, body: bytes = b"\x81\xa1a\x01",
                         timeout_s: float = 5.0) -> bool:
    """Connect, say hello as a DEALER, send one frame header declaring ``declared_bytes`` followed
    by ``body``. Returns True if the server closed the connection within ``timeout_s`` (what a
    server with a message-size limit does), False if it kept it open waiting for the rest."""
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        s.sendall(_greeting())
        _read_exactly(s, 64)  # the server's greeting
        s.sendall(_ready_command())
        # the server's READY command: flags, size (1 or 8 bytes), body
        flags = _read_exactly(s, 1)[0]
        size = struct.unpack(">Q", _read_exactly(s, 8))[0] if flags & 0x02 else _read_exactly(s, 1)[0]
        _read_exactly(s, size)
        s.sendall(b"\x02" + struct.pack(">Q", declared_bytes) + body)  # a long, final message frame
        try:
            return s.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


def _handshake(s: socket.socket) -> None:
    """The NULL greeting and READY, as a DEALER; ConnectionError if the server hangs up first (a
    CURVE server does, as soon as it reads a NULL greeting)."""
    s.sendall(_greeting())
    _read_exactly(s, 64)
    s.sendall(_ready_command())
    flags = _read_exactly(s, 1)[0]
    size = struct.unpack(">Q", _read_exactly(s, 8))[0] if flags & 0x02 else _read_exactly(s, 1)[0]
    _read_exactly(s, size)


def send_endless_message(host: str, port: int, max_bytes: int, timeout_s: float = 30.0) -> tuple[int, bool]:
    """Send one multipart message that never ends: 1-byte frames, each with the MORE flag, up to
    ``max_bytes`` of wire bytes or ``timeout_s``. Returns (bytes of frames sent, whether the server
    closed the connection). libzmq delivers a message only once its last frame is in and holds
    every frame until then; ZMQ_MAXMSGSIZE bounds each frame, not their number."""
    chunk = b"\x01\x01x" * 65536  # flags MORE, short size 1, one byte of body
    sent = 0
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as s:
        try:
            _handshake(s)
            while sent < max_bytes and time.monotonic() < deadline:
                s.sendall(chunk)
                sent += len(chunk)
        except (ConnectionError, TimeoutError):
            return sent, True
    return sent, False


def hold_connections(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` plain TCP connections to the server that never say anything (close them after)."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            held.append(socket.create_connection((host, port), timeout=10))
    except BaseException:
        for s in held:
            s.close()
        raise
    return held


def _read_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"the server closed the connection during the handshake ({len(data)}/{n} bytes)")
        data += chunk
    return data
