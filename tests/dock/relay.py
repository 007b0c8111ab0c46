"""A TCP relay the dock tests put between two processes, to reset their link at a chosen moment.

``reset()`` closes every connection through the relay with a TCP RST on both sides (SO_LINGER 0)
and drops the bytes it was carrying, like a link blip on a real cluster: both peers see the
connection die, ZeroMQ reconnects underneath (through the relay again: it keeps listening), and
whatever was in flight is gone. ``stall()`` instead leaves the connections open but carries nothing
more on them, as in a link that died without a reset (half-open): only a peer's own heartbeat can
tell, and a fresh connection through the relay works. Portable (no ``ss -K``, no privileges), loopback only.
"""

from __future__ import annotations

import selectors
import socket
import struct
import threading
import time


class Relay:
    def __init__(self, upstream: str) -> None:
        """``upstream``: ``tcp://host:port`` to forward to; :attr:`endpoint` is where to connect instead."""
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.endpoint = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.resets = 0
        self.accepted = 0
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._peer: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._reset_asked = threading.Event()
        self._paused = threading.Event()
        self._stall_asked = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relay", daemon=True)
        self._thread.start()

    def pause(self) -> None:
        """Stop carrying bytes (they wait in the kernel's buffers) until the next :meth:`reset`,
        which drops them: what was sent meanwhile is lost, as in a link that died silently."""
        self._paused.set()

    def stall(self, timeout_s: float = 5.0) -> int:
        """Carry nothing more on the connections open now, without closing them (a half-open link);
        connections made afterwards are carried as usual. Returns how many were stalled."""
        with self._lock:
            n = len(self._peer) // 2
            self._stall_asked.set()
        deadline = time.monotonic() + timeout_s
        while self._stall_asked.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return n

    def reset(self, timeout_s: float = 5.0) -> int:
        """RST every live connection now (and end a pause); returns how many were cut."""
        with self._lock:
            n = len(self._peer) // 2
            self._reset_asked.set()
        deadline = time.monotonic() + timeout_s
        while self._reset_asked.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)  # the relay thread cuts them between two selects
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._cut_all()
        self.listener.close()
        self._sel.close()

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cut_all(self) -> None:
        for s in list(self._peer):
            self._cut(s)

    def _cut(self, s: socket.socket) -> None:
        other = self._peer.pop(s, None)
        for x in (s, other):
            if x is None:
                continue
            self._peer.pop(x, None)
            try:
                self._sel.unregister(x)
            except (KeyError, ValueError):
                pass
            try:  # linger on, timeout 0: close sends RST, not FIN, and drops unsent bytes
                x.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            x.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._reset_asked.is_set():
                with self._lock:
                    self._cut_all()
                    self.resets += 1
                    self._paused.clear()
                    self._reset_asked.clear()
            if self._stall_asked.is_set():
                with self._lock:
                    for s in self._peer:  # still held (a reset or close cuts them), never read again
                        try:
                            self._sel.unregister(s)
                        except (KeyError, ValueError):
                            pass
                    self._stall_asked.clear()
            if self._paused.is_set():
                time.sleep(0.005)
                continue
            for key, _ in self._sel.select(timeout=0.01):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                if s is self.listener:
                    self._accept()
                    continue
                if s not in self._peer:
                    continue  # cut earlier in this round
                try:
                    data = s.recv(1 << 20)
                except OSError:
                    data = b""
                if not data:
                    self._cut(s)
                    continue
                try:  # blocking send: the relay is a test tool, its peers read promptly
                    self._peer[s].sendall(data)
                except OSError:
                    self._cut(s)

    def _accept(self) -> None:
        try:
            down, _ = self.listener.accept()
        except BlockingIOError:
            return
        try:
            up = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            down.close()
            return
        for s in (down, up):
            s.setblocking(True)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._peer[down], self._peer[up] = up, down
            self.accepted += 1
        self._sel.register(down, selectors.EVENT_READ, None)
        self._sel.register(up, selectors.EVENT_READ, None)
