"""A ZeroMQ socket served by the running asyncio event loop itself, without pyzmq's asyncio layer.

Why: a small model's step is mostly dock hops, and pyzmq's ``zmq.asyncio`` sockets spend more CPU
per message than the message itself costs libzmq: a Future and its done-callback per send and per
receive, a ``ZMQ_EVENTS`` read as an ``enum.IntFlag`` several times a message, and an extra
loop callback after each send while a receive waits. :class:`LoopSocket` keeps a plain (blocking
API) ``zmq.Socket``, registers its ``ZMQ_FD`` with the loop once, and does every send and receive
with ``NOBLOCK`` (docs/benchmarks.md §33: a request's round trip takes about two thirds of the CPU).

How ZeroMQ's ``ZMQ_FD`` works, and so what this does (libzmq's zmq_getsockopt(3)):

* the descriptor becomes readable when the socket's ``ZMQ_EVENTS`` *may* have changed, and stays
  so until ``ZMQ_EVENTS`` is read: it is edge-triggered with respect to messages. On each wake-up
  :meth:`_serve` reads ``ZMQ_EVENTS`` and receives until no message is left.
* a send (or a receive) may take in the socket's pending commands, and with them the signal of a
  message that arrived meanwhile: the descriptor does not wake the loop for it again. So after each
  send, ``ZMQ_EVENTS`` is read, and a message waiting then is served at the loop's next turn.
* a send that the socket cannot take now (``EAGAIN``: the high-water mark, or a peer not connected
  on a socket that queues only to connected peers) waits, in order, in a queue that each wake-up
  flushes once ``ZMQ_EVENTS`` says the socket takes messages again.

Two ways to receive: with ``on_message``, every message is handed to it as it arrives (a client
that routes replies to waiting requests by id, in the loop's own callback: no task wakes just to
route); without, :meth:`recv` takes one message when a task asks, so messages nobody asks for stay
in libzmq's queue (bounded by ``ZMQ_RCVHWM``) as with any socket.

The socket and the loop must be used from the loop's thread only (as pyzmq's asyncio sockets).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

_POLLIN = int(zmq.POLLIN)  # plain ints: zmq's IntFlag operations cost a microsecond or more each
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
# at most this many messages per loop wake-up: a flooded socket must not starve the loop's other work
MAX_MESSAGES_PER_TURN = 256


class LoopSocket:
    """``sock`` served by the running event loop: :meth:`send` never blocks, :meth:`recv` awaits.

    ``on_message``: called with each message's frames as it arrives (then :meth:`recv` is not
    used); an exception it raises is logged and the socket goes on. ``copy``: receive frames as
    ``bytes`` (True) or as ``zmq.Frame`` (False, zero-copy, for large messages). The socket joins
    the event loop that first uses it (so it may be made before the loop runs).
    """

    def __init__(self, sock: zmq.Socket[Any], on_message: Callable[[list[Any]], None] | None = None, *,
                 copy: bool = False) -> None:
        if isinstance(sock, zmq.asyncio.Socket):
            raise TypeError("LoopSocket serves a plain zmq.Socket (context.socket(type, socket_class=zmq.Socket)), "
                            "not a zmq.asyncio socket: both would register the same descriptor with the loop")
        self.socket = sock
        self.on_message = on_message
        self.copy = copy
        self._fd = sock.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued: deque[Sequence[Any]] = deque()  # sends the socket could not take yet, in order
        # recv() calls waiting, in order, each with its frame cap; a result is (frames, frame count)
        self._waiters: deque[tuple[asyncio.Future[tuple[list[Any], int]], int | None]] = deque()
        self._kept: deque[tuple[list[Any], int]] = deque()  # messages whose recv() was cancelled as they came
        self._turn_scheduled = False
        self.messages_sent = 0
        self.messages_received = 0
        self.handler_errors = 0
        try:
            self._join(asyncio.get_running_loop())
        except RuntimeError:
            pass  # no loop runs yet: the first send or recv inside one joins it

    def _join(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._loop = loop
        loop.add_reader(self._fd, self._serve)
        # what the descriptor signalled before (a reply to a send made outside the loop) is served now
        self._turn_scheduled = True
        loop.call_soon(self._serve)

    def _running_loop(self) -> asyncio.AbstractEventLoop | None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        if loop is not self._loop:
            self._join(loop)
        return loop

    @property
    def closed(self) -> bool:
        return self.socket.closed

    @property
    def queued(self) -> int:
        """Messages waiting for the socket to take them."""
        return len(self._queued)

    def send(self, frames: Sequence[Any]) -> None:
        """Send one message (its frames: bytes, buffers, or ``zmq.Frame``; sent zero-copy, so a
        buffer must stay unchanged until it has left). Never blocks: a message the socket cannot take
        now is queued and sent, in order, when it can."""
        if self._queued:
            self._queued.append(frames)
            return
        if not self.try_send(frames):
            self._queued.append(frames)

    def try_send(self, frames: Sequence[Any]) -> bool:
        """Send one message now if the socket takes it (True), else drop it (False): for a ROUTER,
        where one slow peer must not hold back the messages to the others."""
        try:
            self.socket.send_multipart(frames, _NOBLOCK, copy=False)
        except zmq.Again:
            return False
        self.messages_sent += 1
        if self._running_loop() is not None:
            self._look_again(self.socket.getsockopt(_EVENTS))
        return True

    def message_waiting(self) -> bool:
        """Whether a message waits to be received (it is still delivered as usual)."""
        events = self.socket.getsockopt(_EVENTS)
        self._look_again(events)  # this read took the descriptor's signal
        return bool(events & _POLLIN) or bool(self._kept)

    async def recv(self) -> list[Any]:
        """The next message's frames (only without ``on_message``)."""
        return (await self._receive(None))[0]

    async def recv_capped(self, max_frames: int) -> tuple[list[Any], int]:
        """The next message's first ``max_frames`` frames, and how many it had in all.

        ``ZMQ_MAXMSGSIZE`` bounds each frame, not their number: a peer may send a message of
        millions of small frames. libzmq hands a multipart message over only once its last frame is
        in, holding every frame until then (no socket option bounds their number or total:
        docs/reliability.md, "Multipart floods"); reading the frames past ``max_frames`` without
        keeping them spares only the Python objects for them."""
        return await self._receive(max_frames)

    def recv_capped_nowait(self, max_frames: int) -> tuple[list[Any], int] | None:
        """:meth:`recv_capped` without waiting: None when no message is here."""
        if self.on_message is not None:
            raise RuntimeError("this LoopSocket hands every message to on_message")
        return self._take_now(max_frames) if self._next_waiter() is None else None

    async def _receive(self, max_frames: int | None) -> tuple[list[Any], int]:
        if self.on_message is not None:
            raise RuntimeError("this LoopSocket hands every message to on_message; recv() would never return")
        loop = self._running_loop()
        assert loop is not None
        if self._next_waiter() is None and (got := self._take_now(max_frames)) is not None:
            return got  # a message is here already: no wait, no Future
        fut: asyncio.Future[tuple[list[Any], int]] = loop.create_future()
        entry = (fut, max_frames)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._kept.append(fut.result())  # it came just as this task was cancelled: the next recv() has it
            raise
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)

    def _take_now(self, max_frames: int | None) -> tuple[list[Any], int] | None:
        if self._kept:
            return self._kept.popleft()
        if self.socket.getsockopt(_EVENTS) & _POLLIN:
            got = self._recv_one(max_frames)
            self._look_again(self.socket.getsockopt(_EVENTS))
            return got
        return None

    def _recv_one(self, max_frames: int | None) -> tuple[list[Any], int]:
        """One message (its first ``max_frames`` frames; None: all) and its frame count."""
        self.messages_received += 1
        if max_frames is None:
            frames = self.socket.recv_multipart(_NOBLOCK, copy=self.copy)
            return frames, len(frames)
        # a multipart message arrives whole: once its first frame is here, so are the others
        frames = [self.socket.recv(_NOBLOCK, copy=self.copy)]
        count = 1
        while self.socket.getsockopt(zmq.RCVMORE):
            frame = self.socket.recv(_NOBLOCK, copy=self.copy)
            count += 1
            if len(frames) < max_frames:
                frames.append(frame)
        return frames, count

    def _next_waiter(self) -> tuple[asyncio.Future[tuple[list[Any], int]], int | None] | None:
        while self._waiters and self._waiters[0][0].done():  # cancelled while waiting
            self._waiters.popleft()
        return self._waiters[0] if self._waiters else None

    def _wants_messages(self) -> bool:
        return self.on_message is not None or self._next_waiter() is not None

    def _look_again(self, events: int) -> None:
        """After reading ``ZMQ_EVENTS`` outside :meth:`_serve`: that read took the descriptor's
        signal, so serve at the loop's next turn what it would have woken the loop for."""
        if self._turn_scheduled or self._loop is None:
            return
        if (events & _POLLIN and self._wants_messages()) or (events & _POLLOUT and self._queued):
            self._turn_scheduled = True
            self._loop.call_soon(self._serve)

    def _serve(self) -> None:
        """The loop's callback: the descriptor woke (or a send or receive found work waiting)."""
        self._turn_scheduled = False
        sock = self.socket
        if sock.closed:
            return
        events = sock.getsockopt(_EVENTS)
        if self._queued and events & _POLLOUT:
            self._flush()
            events = sock.getsockopt(_EVENTS)
        while self._kept and (waiter := self._next_waiter()) is not None:
            waiter[0].set_result(self._kept.popleft())
        served = 0
        while events & _POLLIN and self._wants_messages():
            if served == MAX_MESSAGES_PER_TURN:
                self._turn_scheduled = True
                assert self._loop is not None
                self._loop.call_soon(self._serve)  # the rest at the loop's next turn
                return
            served += 1
            if self.on_message is None:
                fut, max_frames = self._waiters.popleft()  # _wants_messages left a live one first
                fut.set_result(self._recv_one(max_frames))
            else:
                frames, _ = self._recv_one(None)
                try:
                    self.on_message(frames)
                except Exception:  # one bad message (or a handler's bug) must not stop the socket
                    self.handler_errors += 1
                    log.exception("a LoopSocket message handler failed")
                if sock.closed:  # the handler closed it
                    return
            events = sock.getsockopt(_EVENTS)
        if self._queued and events & _POLLOUT:
            self._flush()
            self._look_again(sock.getsockopt(_EVENTS))  # the sends may have taken a message's signal

    def _flush(self) -> None:
        while self._queued:
            try:
                self.socket.send_multipart(self._queued[0], _NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._queued.popleft()
            self.messages_sent += 1

    def close(self, linger: int | None = None) -> None:
        """Stop serving and close the socket (messages still queued here that the socket cannot take
        now are dropped; those libzmq holds leave within ``linger`` ms, None: the socket's LINGER). A recv() waiting ends in ``zmq.ZMQError`` (ENOTSOCK)."""
        if self.socket.closed:
            return
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        if self._queued and self.socket.getsockopt(_EVENTS) & _POLLOUT:
            self._flush()  # a last chance for what waited here (a worker's final event)
        self._queued.clear()
        for fut, _ in self._waiters:
            if not fut.done():
                fut.set_exception(zmq.ZMQError(zmq.ENOTSOCK, "the socket was closed"))
        self.socket.close(linger=linger)
