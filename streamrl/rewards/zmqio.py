"""Awaiting a plain ZeroMQ socket from any anyio backend (asyncio or trio).

ZeroMQ's ``FD`` is edge-triggered: it becomes readable when the socket's command mailbox has
something, and *any* operation on the socket (a send from another task, reading ``EVENTS``) may
consume that signal while messages wait. So the one receiving task waits on the FD inside a cancel
scope, and every send checks ``EVENTS`` afterwards and wakes the receiver when input is pending.
All use is from one thread (the event loop's): ZeroMQ sockets are not thread-safe.
"""

from __future__ import annotations

import anyio
import zmq


class AsyncSocket:
    """A ZeroMQ socket with non-blocking sends and an awaitable receive (one receiving task)."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket
        self._wait_scope: anyio.CancelScope | None = None
        self._closed = False

    def send_nowait(self, frames: list[bytes]) -> bool:
        """Queue a multipart message; False when ZeroMQ cannot take it now (no peer, HWM reached)."""
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False
        finally:
            self._wake_receiver_if_readable()

    def _wake_receiver_if_readable(self) -> None:
        if self._wait_scope is not None and not self._closed and self.socket.get(zmq.EVENTS) & zmq.POLLIN:
            self._wait_scope.cancel()

    async def receive(self) -> list[bytes]:
        """The next multipart message."""
        while True:
            try:
                return self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                await self._wait_readable()

    async def receive_capped(self, max_frames: int) -> tuple[list[bytes], int]:
        """The next multipart message's first ``max_frames`` frames, and how many it had in all.

        ``MAXMSGSIZE`` bounds each frame, not their number: a peer may send a message of millions
        of small frames. libzmq hands a multipart message over only once its last frame is in, and
        holds every frame until then (no socket option bounds their number or total: see
        docs/reliability.md, "Multipart floods"), so that memory is spent before this runs. Reading
        the frames past ``max_frames`` without keeping them only spares the Python copies of them.
        """
        while (got := self.receive_capped_nowait(max_frames)) is None:
            await self._wait_readable()
        return got

    async def _wait_readable(self) -> None:
        """Return once a receive may succeed (or at once if ``EVENTS`` already says so)."""
        if self.socket.get(zmq.EVENTS) & zmq.POLLIN:
            return
        with anyio.CancelScope() as scope:
            self._wait_scope = scope
            try:
                await anyio.wait_readable(self.socket.FD)
            finally:
                self._wait_scope = None

    def receive_capped_nowait(self, max_frames: int) -> tuple[list[bytes], int] | None:
        """:meth:`receive_capped` without waiting: None when no message is queued."""
        try:
            first = self.socket.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self._rest_of_message(first, max_frames)

    def _rest_of_message(self, first: bytes, max_frames: int) -> tuple[list[bytes], int]:
        # ZeroMQ delivers a multipart message atomically: once its first frame is here, so are the
        # others, and these non-blocking reads cannot fail with EAGAIN.
        frames, count = [first], 1
        while self.socket.get(zmq.RCVMORE):
            frame = self.socket.recv(flags=zmq.NOBLOCK)
            count += 1
            if len(frames) < max_frames:
                frames.append(frame)
        return frames, count

    def close(self, linger_ms: int = 0) -> None:
        """Close the socket; the receiving task must have been cancelled first."""
        if not self._closed:
            self._closed = True
            self.socket.close(linger=linger_ms)
