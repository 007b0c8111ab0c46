"""A bounded window of recent latencies with percentiles, for statistics()."""

from __future__ import annotations

import bisect
from collections import deque


class LatencyWindow:
    """The last ``size`` latencies in seconds; percentiles are reported in milliseconds.

    Bounded so a week-long run does not grow memory; 4096 replies is enough for a stable p99.
    The window is also kept sorted as values come and go (a binary search and a move of the list's
    tail each), so a percentile is one lookup: a stage reports its backend's p50 and p99 at every
    micro-batch, and sorting a full window each time took half a millisecond of it.
    """

    def __init__(self, size: int = 4096) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self._ordered: list[float] = []  # the same values, ascending
        self.count = 0

    def add(self, seconds: float) -> None:
        if len(self._values) == self._values.maxlen:  # the oldest leaves the window
            del self._ordered[bisect.bisect_left(self._ordered, self._values[0])]
        self._values.append(seconds)
        bisect.insort(self._ordered, seconds)
        self.count += 1

    def percentile_ms(self, q: float) -> float | None:
        """Nearest-rank percentile ``q`` in [0, 100] in ms, None before the first value."""
        ordered = self._ordered
        if not ordered:
            return None
        rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[rank] * 1000.0
