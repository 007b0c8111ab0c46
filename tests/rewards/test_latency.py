"""The latency window's percentiles: nearest rank over the last ``size`` values only, as values
come and go (the window is kept sorted incrementally)."""

from __future__ import annotations

import random

from streamrl.rewards.latency import LatencyWindow


def _nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))] * 1000.0


def test_percentiles_follow_the_window_as_values_come_and_go() -> None:
    window = LatencyWindow(size=64)
    assert window.percentile_ms(50) is None
    rng = random.Random(0)
    seen: list[float] = []
    for k in range(500):  # many times the window: evictions, and repeated values among them
        value = rng.choice([0.001, 0.002, rng.random()])
        window.add(value)
        seen.append(value)
        last = seen[-64:]
        for q in (0, 50, 99, 100):
            assert window.percentile_ms(q) == _nearest_rank(last, q), (k, q)
    assert window.count == 500
    assert len(window._ordered) == 64
