"""``busy/<stage>``: the fraction of each optimizer step's wall time a stage's workers spent in batches.

Each worker counts the seconds inside ``process()`` (``produce()`` for a source) and tells the
launcher (``StageBusy``) when a batch has run 20 ms (or, sooner, just before a StepReport the batch
sends: the trainer's), when it ends, and every 0.5 s in between: its busy seconds so far, the
running batch's seconds, and the wall-clock moment it measured them. From
these the launcher knows when each batch ran, as an interval of wall-clock time (a batch that
ends within 20 ms is reported once, at its end, which places it just as well). A step's figure
for one worker is the part of those intervals inside the step's window (from the previous step's
report to this one's, both as the trainer measured them; the first step's from Go), divided by the
window; the stage's figure is the mean over its workers. So it is a fraction in [0, 1], also for
steps shorter than the report interval and for a batch that spans several steps (it counts in
each, for its part).

What the launcher cannot see when it writes a row (a report still on its way, milliseconds) stays
within that row: a batch it still believes running counts until the step's end, and a batch
reported late is missed where it fell in an earlier step (so is the part before a step's end of
a batch that spans it and ran less than 20 ms); each row is clipped to [0, 1]. A batch
cut short by a worker's death is not counted; a restarted worker counts from zero again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class _WorkerBusy:
    finished: float = 0.0  # its last report's seconds in finished batches
    running_since: float | None = None  # when the batch it runs began (wall clock); None: between batches
    intervals: list[tuple[float, float]] = field(default_factory=list)  # finished batches not yet counted whole


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


class BusyTracker:
    """The launcher's view of when every worker was busy; one ``busy/<stage>`` per stage and step."""

    def __init__(self, workers: Mapping[str, int]) -> None:
        """``workers``: each stage's number of workers, in pipeline order."""
        self.workers = dict(workers)
        self._by_worker: dict[tuple[str, int], _WorkerBusy] = {}
        self.last_step: float | None = None  # the previous step's end (wall clock)

    def report(self, stage: str, worker: int, busy_s: float, in_batch_s: float, measured_at: float = 0.0) -> None:
        """A worker's ``StageBusy``: its busy seconds so far (the running batch's included), the
        running batch's seconds (0: none runs), and when it measured them (``time.time()``; 0: now)."""
        at = measured_at if measured_at > 0 else time.time()
        w = self._by_worker.setdefault((stage, worker), _WorkerBusy())
        finished = max(busy_s - in_batch_s, 0.0)
        if finished < w.finished - 1e-6:  # a restarted worker: it counts from 0 again
            w.finished = 0.0
        done = finished - w.finished  # batches that ended since its last report (one, as it reports each end)
        if done > 1e-9:
            end = at - in_batch_s  # at the latest when the batch running now began
            w.intervals.append((end - done, end))
        w.finished = finished
        w.running_since = at - in_batch_s if in_batch_s > 0 else None

    def step(self, until: float, go: float) -> dict[str, float]:
        """``busy/<stage>`` for the step that ended at ``until``: from the previous step's end (``go``,
        when training started, for the first step) to ``until``; both wall-clock times."""
        since = self.last_step if self.last_step is not None else go
        until = max(until, since)
        self.last_step = until
        wall = max(until - since, 1e-9)
        row: dict[str, float] = {}
        for stage, n in self.workers.items():
            fraction = 0.0
            for k in range(n):
                w = self._by_worker.get((stage, k))
                if w is None:
                    continue
                worked = sum(_overlap(a, b, since, until) for a, b in w.intervals)
                if w.running_since is not None:
                    worked += _overlap(w.running_since, until, since, until)
                w.intervals = [(a, b) for a, b in w.intervals if b > until]  # the rest falls in later steps
                fraction += min(worked / wall, 1.0)
            row[f"busy/{stage}"] = round(fraction / max(n, 1), 4)
        return row
