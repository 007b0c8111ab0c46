"""A bounded window of recent latencies with percentiles, for statistics()."""

from __future__ import annotations

from collections import deque


class LatencyWindow:
    """The last ``size`` latencies in seconds; percentiles are reported in milliseconds.

    Bounded so a week-long run does not grow memory; 4096 replies is enough for a stable p99.
    """

    def __init__(self, size: int = 4096) -> None:
        self._values: deque[float] = deque(maxlen=size)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._values.append(seconds)
        self.count += 1

    def percentile_ms(self, q: float) -> float | None:
        """Nearest-rank percentile ``q`` in [0, 100] in ms, None before the first value."""
        if not self._values:
            return None
        ordered = sorted(self._values)
        rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
        return ordered[rank] * 1000.0
