"""The stages' own figures (``ctx.report_metrics``), joined to the step rows by when they were measured.

A stage worker sends its figures (``StageMetrics``) with the wall-clock moment it measured them; a
trainer sends each step's row (``StepReport``) with the moment the step ended, which is before the
new policy version became visible to generation. A row carries, for every stage worker, the merge of
all the figures it measured up to the row's moment: each name keeps its last value until the worker
reports it again. Figures measured later wait for a later row, even when they reach the launcher
first: with ``max_staleness: 0`` the next step's chain can run (generate, score, advantage) while
the trainer process is still sending the row of the step before, and arrival order would put those
figures in the wrong row.

Each worker's figures arrive in the order it measured them (one connection each), so the figures
waiting per worker form a queue. It is bounded (:data:`MAX_WAITING`): past that, the oldest are
merged in early, where a trainer that reports no rows for a long while would otherwise let the
queue grow. On one host the moments share one clock; across hosts a row's join is as exact as the
hosts' clocks agree.
"""

from __future__ import annotations

import time
from collections import deque

MAX_WAITING = 256  # figures a worker may have waiting for a row; older ones merge in early


class StageFigures:
    """Every stage worker's figures as of the last row, and those measured after it."""

    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self.current: dict[tuple[str, int], dict[str, float]] = {}
        self._waiting: dict[tuple[str, int], deque[tuple[float, dict[str, float]]]] = {}

    def report(self, stage: str, worker: int, metrics: dict[str, float], measured_at: float = 0.0) -> None:
        """A worker's ``StageMetrics``, measured at ``measured_at`` (``time.time()``; 0: now)."""
        at = measured_at if measured_at > 0 else time.time()
        key = (stage, worker)
        queue = self._waiting.setdefault(key, deque())
        queue.append((at, metrics))
        while len(queue) > self.max_waiting:
            self.current.setdefault(key, {}).update(queue.popleft()[1])

    def until(self, ended: float) -> dict[tuple[str, int], dict[str, float]]:
        """Each worker's figures for the row of a step that ended at ``ended`` (wall clock): its
        merged figures measured at or before then. Later ones stay for a later row."""
        for key, queue in self._waiting.items():
            while queue and queue[0][0] <= ended:
                self.current.setdefault(key, {}).update(queue.popleft()[1])
        return self.current
