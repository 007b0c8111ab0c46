"""A stage's own figures join the row of the step they were measured in (streamrl.metrics.stage_figures).

The figures and rows are given their measuring times here (what StageMetrics and StepReport carry),
so the cases are exact: figures that reach the launcher before the row of the step before them (the
next step's chain running while the trainer still sends its row), figures merged by name, and a
worker whose figures pile up while no row comes.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from streamrl.config import load_config
from streamrl.metrics.progress import Progress
from streamrl.metrics.stage_figures import StageFigures
from streamrl.runtime.prerun import load_pipeline
from streamrl.runtime.run_metrics import RunMetrics

T0 = 1_000_000.0  # wall-clock seconds


def test_figures_measured_after_a_step_ended_wait_for_the_next_row_even_when_they_arrive_first() -> None:
    f = StageFigures()
    f.report("advantage", 0, {"advantage_abs_mean": 1.0}, T0 + 0.01)  # step 1's batch
    # step 2's batch was measured after step 1 ended (at T0 + 0.02) but arrives before its row
    f.report("advantage", 0, {"advantage_abs_mean": 2.0}, T0 + 0.03)
    assert f.until(T0 + 0.02) == {("advantage", 0): {"advantage_abs_mean": 1.0}}
    assert f.until(T0 + 0.04) == {("advantage", 0): {"advantage_abs_mean": 2.0}}


def test_names_reported_at_different_times_merge_and_stay_until_reported_again() -> None:
    f = StageFigures()
    f.report("generate", 1, {"engine_startup_s": 3.0}, T0)
    f.report("generate", 1, {"weight_install_s": 0.1}, T0 + 1)
    f.report("score", 0, {"latency_p50_ms": 4.0}, T0 + 1.5)
    assert f.until(T0 + 2) == {("generate", 1): {"engine_startup_s": 3.0, "weight_install_s": 0.1},
                               ("score", 0): {"latency_p50_ms": 4.0}}
    f.report("generate", 1, {"weight_install_s": 0.2}, T0 + 2.5)
    assert f.until(T0 + 3)[("generate", 1)] == {"engine_startup_s": 3.0, "weight_install_s": 0.2}
    assert f.until(T0 + 3)[("score", 0)] == {"latency_p50_ms": 4.0}  # no new report: the last value stays


def test_a_worker_that_reports_while_no_row_comes_keeps_a_bounded_queue() -> None:
    f = StageFigures(max_waiting=4)
    for n in range(10):  # measured after the step that ends at T0: all wait, the oldest merge in early
        f.report("source", 0, {"groups_made": float(n)}, T0 + 1 + n)
    assert len(f._waiting[("source", 0)]) == 4
    assert f.current == {("source", 0): {"groups_made": 5.0}}  # the six oldest, merged
    assert f.until(T0 + 100) == {("source", 0): {"groups_made": 9.0}}


def test_a_figure_without_a_time_counts_as_measured_when_it_arrives() -> None:
    f = StageFigures()
    f.report("score", 0, {"retries": 1.0})
    assert f.until(T0) == {}  # T0 is long past
    assert f.until(time.time() + 1) == {("score", 0): {"retries": 1.0}}


def test_a_rows_stage_figures_are_those_measured_before_its_step_ended(tmp_path: Path) -> None:
    cfg = load_config({}, ["algo.steps=3", "output.progress=none", "output.tensorboard=false",
                           "pipeline=pipelines/grpo.yaml"])  # an advantage stage of its own
    pipeline = load_pipeline(cfg)
    metrics = RunMetrics(cfg, pipeline, tmp_path, Progress(3, "none", io.StringIO()), [], [], None)
    metrics.t_go_wall = T0
    metrics.stage_figures.report("advantage", 0, {"advantage_abs_mean": 0.5}, T0 + 0.01)
    metrics.stage_figures.report("advantage", 0, {"advantage_abs_mean": 0.7}, T0 + 0.03)  # the next step's
    metrics.on_step(1, {"loss": 0.1}, T0 + 0.02)
    metrics.on_step(2, {"loss": 0.2}, T0 + 0.04)
    metrics.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["advantage/advantage_abs_mean"] for r in rows] == [0.5, 0.7]
