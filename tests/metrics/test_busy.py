"""busy/<stage> (streamrl.metrics.busy): a fraction of each step's wall time, from the workers' reports.

The reports are given their measuring times here (what a worker's StageBusy carries), so every
case is exact: steps far shorter than the 0.5 s report interval, a batch longer than a step, a
report that arrives after the step it belongs to, a restarted worker.
"""

from __future__ import annotations

import pytest

from streamrl.metrics.busy import BusyTracker

T0 = 1_000_000.0  # wall-clock seconds; Go


def _batch(tracker: BusyTracker, stage: str, worker: int, start: float, end: float, done_before: float) -> float:
    """A worker's begin and end reports for one batch from start to end; its busy total after it."""
    tracker.report(stage, worker, done_before, 1e-9, start)
    tracker.report(stage, worker, done_before + (end - start), 0.0, end)
    return done_before + (end - start)


def test_steps_shorter_than_the_report_interval_get_their_own_share() -> None:
    t = BusyTracker({"generate": 1, "train": 1})
    done_g = done_t = 0.0
    rows = []
    for n in range(10):  # steps of 0.1 s: generate works 0.03 s, train 0.06 s of each
        base = T0 + 0.1 * n
        done_g = _batch(t, "generate", 0, base, base + 0.03, done_g)
        done_t = _batch(t, "train", 0, base + 0.035, base + 0.095, done_t)
        rows.append(t.step(base + 0.1, go=T0))
    for row in rows:
        assert row["busy/generate"] == pytest.approx(0.3, abs=1e-3)
        assert row["busy/train"] == pytest.approx(0.6, abs=1e-3)


def test_a_batch_longer_than_a_step_counts_in_each_step_for_its_part() -> None:
    t = BusyTracker({"generate": 1})
    t.report("generate", 0, 0.0, 1e-9, T0 + 0.5)  # begins 0.5 s into step 1
    t.report("generate", 0, 1.0, 1.0, T0 + 1.5)  # a heartbeat: 1 s in, still running
    assert t.step(T0 + 1.0, go=T0)["busy/generate"] == pytest.approx(0.5)
    assert t.step(T0 + 2.0, go=T0)["busy/generate"] == pytest.approx(1.0)  # running all through step 2
    t.report("generate", 0, 2.0, 0.0, T0 + 2.5)  # ends half-way through step 3
    assert t.step(T0 + 3.0, go=T0)["busy/generate"] == pytest.approx(0.5)
    assert t.step(T0 + 4.0, go=T0)["busy/generate"] == 0.0


def test_a_late_report_never_pushes_a_step_past_one_nor_a_later_step_below_the_truth() -> None:
    t = BusyTracker({"score": 1})
    t.report("score", 0, 0.0, 1e-9, T0 + 0.05)  # a batch begins; its end report is still on the wire
    assert t.step(T0 + 0.1, go=T0)["busy/score"] == pytest.approx(0.5)  # believed running to the step's end
    t.report("score", 0, 0.01, 0.0, T0 + 0.06)  # the end: it ran 10 ms, in step 1
    done = _batch(t, "score", 0, T0 + 0.15, T0 + 0.16, 0.01)
    # step 2 gets exactly its own 10 ms: step 1's over-estimate is not carried into it
    assert t.step(T0 + 0.2, go=T0)["busy/score"] == pytest.approx(0.1)
    assert done == pytest.approx(0.02)


def test_fractions_stay_within_0_and_1_and_are_the_mean_over_workers() -> None:
    t = BusyTracker({"generate": 2})
    _batch(t, "generate", 0, T0, T0 + 1.0, 0.0)  # worker 0 busy the whole step, worker 1 idle
    t.report("generate", 1, 0.0, 0.0, T0 + 0.5)
    assert t.step(T0 + 1.0, go=T0)["busy/generate"] == pytest.approx(0.5)
    # clock jitter between processes: a batch reported slightly longer than the step is clipped
    _batch(t, "generate", 0, T0 + 0.999, T0 + 2.0, 1.0)
    _batch(t, "generate", 1, T0 + 0.998, T0 + 2.0, 0.0)
    assert t.step(T0 + 2.0, go=T0)["busy/generate"] == 1.0


def test_a_restarted_worker_counts_from_zero_without_a_negative_step() -> None:
    t = BusyTracker({"generate": 1})
    done = _batch(t, "generate", 0, T0, T0 + 0.4, 0.0)
    t.report("generate", 0, done + 0.3, 0.3, T0 + 0.8)  # 0.3 s into a batch; then it dies unseen
    assert t.step(T0 + 1.0, go=T0)["busy/generate"] == pytest.approx(0.9)  # believed running to the end
    _batch(t, "generate", 0, T0 + 1.2, T0 + 1.5, 0.0)  # the new process: its total starts at 0
    row = t.step(T0 + 2.0, go=T0)
    assert row["busy/generate"] == pytest.approx(0.3)


def test_a_stage_that_never_reported_is_idle() -> None:
    t = BusyTracker({"source": 1, "eval": 1})
    assert t.step(T0 + 1.0, go=T0) == {"busy/source": 0.0, "busy/eval": 0.0}
