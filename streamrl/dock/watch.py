"""A server process's check that the process which started it still exists (no orphans)."""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("streamrl.dock")


class ParentWatch:
    """``gone()`` turns True once the parent ``pid`` is no longer this process's parent.

    A dead parent's children are re-parented (to init or a subreaper), so comparing
    ``os.getppid()`` is exact and costs one system call, made at most every ``every_s``.
    """

    def __init__(self, pid: int = 0, every_s: float = 0.2) -> None:
        self.pid = pid  # 0: not watching
        self.every_s = every_s
        self._next = 0.0

    def gone(self) -> bool:
        now = time.monotonic()
        if not self.pid or now < self._next:
            return False
        self._next = now + self.every_s
        if os.getppid() != self.pid:
            log.error("parent process %d is gone: stopping", self.pid)
            return True
        return False
