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
``except`` to write. The dock's and the reward protocol's own decode paths use the same pieces:
``DECODE_ERRORS``, :func:`describe`, :func:`nests_deeper_than` (bounding the nesting of free-form
values below the recursion limit) and :func:`peek_id` (the request id of a message that failed, so
the error can be answered). :func:`limit_socket` sets the socket-level limit every ROUTER needs: without
``ZMQ_MAXMSGSIZE`` a peer that declares a 100 GB frame makes ZeroMQ allocate it. That limit is per
frame: libzmq bounds neither the number of frames of one message nor a message that never ends
(docs/reliability.md, "Multipart floods"). :func:`raise_fd_limit` lets a server hold as many
connections as the hard open-files limit allows.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, TypeVar

import msgspec
import zmq

T = TypeVar("T")

# Everything a decode of untrusted bytes may raise: msgspec.DecodeError and UnicodeDecodeError are
# ValueErrors; RecursionError for nesting past the interpreter's limit; OverflowError / MemoryError
# for absurd sizes; TypeError from extension types.
DECODE_ERRORS: tuple[type[BaseException], ...] = (ValueError, RecursionError, OverflowError, MemoryError, TypeError)
INT63 = (1 << 63) - 1
_CONTAINERS = (list, dict, tuple)  # tuple: msgspec decodes array *keys* of a map as tuples


class WireError(ValueError):
    """A peer's message could not be decoded into the socket's message type; ``str()`` says why."""


def decode(decoder: msgspec.msgpack.Decoder[T], data: bytes | memoryview) -> T:
    """The typed message in ``data``, or :class:`WireError` (never any other exception)."""
    try:
        return decoder.decode(data)
    except DECODE_ERRORS as exc:
        raise WireError(describe(exc)) from None


def describe(exc: BaseException, too_deep: str = "values are nested too deeply") -> str:
    """One line saying why a decode failed (``too_deep``: what to say for a RecursionError)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"a string is not valid UTF-8 ({exc.reason} at byte {exc.start} of that string); send msgpack str as UTF-8"
    if isinstance(exc, msgspec.DecodeError) and "UTF-8" in str(exc):
        # a newer msgspec (0.23 here) reports bad UTF-8 as a DecodeError of its own, without the position
        return "a string is not valid UTF-8; send msgpack str as UTF-8"
    if isinstance(exc, RecursionError):
        return too_deep
    if isinstance(exc, OverflowError):
        return "an integer does not fit in 64 bits"
    text = str(exc) if isinstance(exc, msgspec.DecodeError) else f"{type(exc).__name__}: {exc}"
    return text[:500] + ("..." if len(text) > 500 else "")


def nests_deeper_than(value: object, limit: int) -> bool:
    """True if ``value`` has more than ``limit`` levels of arrays/maps (``value`` itself, if one, is
    level 1; map keys count too). Iterative, so a hostile value cannot exhaust the stack here; scalars
    cost one type check and are never pushed."""
    if type(value) not in _CONTAINERS:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = (*item.keys(), *item.values()) if type(item) is dict else item
        stack.extend((child, depth + 1) for child in children if type(child) in _CONTAINERS)
    return False


def peek_id(probe: msgspec.msgpack.Decoder[Any], data: bytes | memoryview, field: str) -> int | None:
    """The integer ``field`` of a message that failed typed decoding, read through ``probe`` (a
    decoder of a Struct with just that field, so msgspec skips the other keys unread), when it is
    one the sender would accept back: an int in [0, 2^63). Never raises."""
    try:
        value = getattr(probe.decode(data), field)
    except DECODE_ERRORS:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= INT63:
        return value
    return None


class SparseLog:
    """Warnings about what peers send, at most one a second per kind: a peer sending garbage in a
    loop must not fill the disk (nor slow the server down with its own logging)."""

    def __init__(self, logger: logging.Logger, every_s: float = 1.0) -> None:
        self.logger = logger
        self.every_s = every_s
        self._next: dict[str, float] = {}

    def warning(self, kind: str, fmt: str, *args: object) -> None:
        now = time.monotonic()
        if now >= self._next.get(kind, 0.0):
            self._next[kind] = now + self.every_s
            self.logger.warning(fmt, *args)


def limit_socket(sock: zmq.Socket[Any], max_message_bytes: int) -> None:
    """Refuse, at the ZeroMQ level, any message whose frames declare more than ``max_message_bytes``.

    ZeroMQ drops the peer's connection when a frame exceeds the limit (before allocating it), so a
    well-behaved client never sees this unless it sends more than the documented maximum."""
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


# ZMTP heartbeats on every dock/control link (issue 25): a link that died without a TCP reset (a
# peer's host gone, a half-open connection after a network blip) is dropped after this long without
# traffic, so the connecting side reconnects (and re-registers) instead of waiting for TCP, which
# can take hours to notice. The PINGs are answered by libzmq's I/O thread: a busy Python loop on
# either side never times a link out.
HEARTBEAT_IVL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 10_000


def watch_link(sock: zmq.Socket[Any]) -> None:
    """Send ZMTP heartbeats on ``sock``'s connections and drop one silent for HEARTBEAT_TIMEOUT_MS."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)  # tells the peer to time us out as well


def fixed_routing_id(sock: zmq.Socket[Any], prefix: bytes = b"id-") -> bytes:
    """Give a connecting (DEALER) socket a random routing id that survives its reconnects.

    Without one, a ROUTER names each new connection afresh, so after a link reset the server no
    longer knows the peer (a warehouse's registration, a worker's control registration) and its
    replies to the old name are dropped. With one, and ``ZMQ_ROUTER_HANDOVER`` on the server, the
    reconnected link takes over the name. 16 random bytes: other peers never see it, and one
    cannot take over a name it cannot guess. ``prefix`` must not be empty (a leading zero byte is
    reserved by ZeroMQ)."""
    rid = prefix + os.urandom(16)
    sock.setsockopt(zmq.ROUTING_ID, rid)
    return rid

def raise_fd_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; return the soft limit now.

    Every connection a server holds is a file descriptor. At the common soft default of 1024, a
    peer holding ~1000 connections open left libzmq's listener unable to accept (EMFILE): new
    clients waited in the kernel's backlog until the held ones went away (issue 25). The hard limit
    is the administrator's bound; the soft one is only a default, and a server should use what it
    is allowed. Safe to call more than once; never raises.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft
    # An infinite hard limit is not a valid soft one everywhere (macOS caps at OPEN_MAX = 10240).
    for target in ([hard] if hard != resource.RLIM_INFINITY else []) + [1 << 20, 10240]:
        if target <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            continue
    return soft
