"""Blocking calls that may wait indefinitely, awaited without pinning the process.

A torch.distributed receive or rendezvous can wait for a peer that never comes (it failed, or the
run is stopping). anyio's worker threads are not daemonic and their calls cannot be abandoned, so
such a wait would block cancellation and process exit; :class:`DaemonCall` runs it in a daemon
thread instead and polls for its end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio

T = TypeVar("T")


class DaemonCall(Generic[T]):
    """``fn()`` started now in a daemon thread; ``await wait()`` for its result.

    The call outlives a cancelled ``await``: whoever awaits it next picks up the same result (a
    weight receiver resumes the same header wait, so no header is ever lost).
    """

    def __init__(self, fn: Callable[[], T], name: str = "streamrl-daemon-call") -> None:
        self._box: dict[str, object] = {}

        def target() -> None:
            try:
                self._box["value"] = fn()
            except BaseException as exc:
                self._box["error"] = exc

        self._thread = threading.Thread(target=target, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """The call has not returned yet."""
        return self._thread.is_alive()

    async def wait(self, poll_s: float = 0.005) -> T:
        while self._thread.is_alive():
            await anyio.sleep(poll_s)
        if "error" in self._box:
            raise self._box["error"]  # type: ignore[misc]
        return self._box["value"]  # type: ignore[return-value]
