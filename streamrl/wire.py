"""Decoding what a peer sent: the one path by which every server turns bytes into a typed message.

Every server in streamrl (dock controller and warehouses, reward server, launcher control channel,
policy publisher) serves many peers from one loop, so one peer's message must never end the loop.
A typed msgspec decode already refuses wrong types, unknown tags and out-of-range numbers with
``msgspec.DecodeError``; but a few inputs fail *around* the typed check with other exceptions,
found by sending single messages from outside:

* a ``str`` field holding bytes that are not UTF-8 raises ``UnicodeDecodeError``;
* nesting deeper than the interpreter's recursion limit (``[[[[...]]]]`` in an ``Any`` field, a
  few hundred kilobytes of ``0x91`` bytes) raises ``RecursionError``;
* an integer beyond 64 bits raises ``OverflowError``.

:func:`decode` folds all of these into one :class:`WireError`, so a server has exactly one
``except`` to write. :func:`limit_socket` sets the socket-level limit every ROUTER needs: without
``ZMQ_MAXMSGSIZE`` a peer that declares a 100 GB frame makes ZeroMQ allocate it.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import zmq

T = TypeVar("T")

# Everything a decode of untrusted bytes may raise (msgspec.DecodeError is a ValueError).
DECODE_ERRORS: tuple[type[BaseException], ...] = (ValueError, UnicodeDecodeError, RecursionError, OverflowError)


class WireError(ValueError):
    """A peer's message could not be decoded into the socket's message type; ``str()`` says why."""


def decode(decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview) -> T:
    """The typed message in ``data``, or :class:`WireError` (never any other exception)."""
    try:
        return decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise WireError(_describe(exc)) from None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 (byte {exc.start} of that string)"
    if isinstance(exc, RecursionError):
        return "values are nested too deeply"
    if isinstance(exc, OverflowError):
        return "an integer does not fit in 64 bits"
    return str(exc)


def limit_socket(sock: zmq.Socket[Any], max_message_bytes: int) -> None:
    """Refuse, at the ZeroMQ level, any message whose frames declare more than ``max_message_bytes``.

    ZeroMQ drops the peer's connection when a frame exceeds the limit (before allocating it), so a
    well-behaved client never sees this unless it sends more than the documented maximum."""
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
