"""Run outputs: metrics.jsonl (one line per step, written at once), TensorBoard events, the reward curve,
and the progress line."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from streamrl.metrics.progress import Progress
from streamrl.metrics.writer import MetricsWriter, plot_reward_curve

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rows(n: int) -> list[dict[str, float]]:
    return [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.05, "loss": -0.01 * s, "busy/train": 0.5}
            for s in range(1, n + 1)]


def test_metrics_jsonl_is_written_line_by_line(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=False)
    try:
        for k, row in enumerate(_rows(3), start=1):
            writer.write(row)
            # visible before close: a crash loses no finished step
            lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
            assert len(lines) == k and json.loads(lines[-1]) == row
    finally:
        writer.close()
    assert writer.rows == _rows(3)
    assert not (tmp_path / "tensorboard").exists()


def test_non_finite_values_become_null(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 1, "loss": math.nan, "kl": math.inf, "reward_mean": 0.5})
    writer.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())  # strict JSON: no NaN/Infinity literals
    assert row == {"step": 1, "loss": None, "kl": None, "reward_mean": 0.5}


def test_tensorboard_events_hold_every_scalar(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, tensorboard=True)
    for row in _rows(4):
        writer.write(row)
    writer.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) >= {"reward_mean", "reward_std", "loss", "busy/train"}
    rewards = acc.Scalars("reward_mean")
    assert [e.step for e in rewards] == [1, 2, 3, 4]
    assert [round(e.value, 5) for e in rewards] == [0.1, 0.2, 0.3, 0.4]


def test_reward_curve_png(tmp_path: Path) -> None:
    path = plot_reward_curve(_rows(5), tmp_path / "reward_curve.png", title="t")
    assert path == tmp_path / "reward_curve.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert plot_reward_curve([{"step": 1, "loss": 0.1}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_progress_modes() -> None:
    silent = io.StringIO()
    p = Progress(10, "none", stream=silent)
    p.message("hello")
    p.update({"step": 1, "reward_mean": 0.5})
    p.close()
    assert silent.getvalue() == ""

    lines = io.StringIO()
    p = Progress(3, "lines", stream=lines, line_every_s=3600)
    p.message("start")
    for row in _rows(3):
        p.update(row)
    p.close()
    out = lines.getvalue().splitlines()
    # the first and last steps are always shown; in between at most one line per line_every_s
    assert out[0] == "start" and out[1].startswith("step 1/3") and out[-1].startswith("step 3/3")
    assert len(out) == 3 and "reward 0.300" in out[-1]

    tty = io.StringIO()
    p = Progress(2, "tty", stream=tty)
    p.update(_rows(1)[0])
    p.message("note")  # a message breaks the rewritten line first
    p.update(_rows(2)[1])
    p.close()
    text = tty.getvalue()
    assert text.count("\r\x1b[2K") == 2 and "\nnote\n" in text and text.endswith("\n")


def test_the_eta_says_what_it_is_toward() -> None:
    """To the step cap, from training time (a row's elapsed_s: set-up is not a step); with a reward
    stop the run may end sooner, which cannot be foreseen, so the cap's ETA is an upper bound."""
    capped = io.StringIO()
    p = Progress(100, "lines", stream=capped)
    p.update({"step": 10, "reward_mean": 0.2, "elapsed_s": 20.0})  # 2 s per step: 90 steps to go
    assert "elapsed 0:20  ETA 3:00 (step cap)" in capped.getvalue()
    assert p.eta(100, 200.0) == "ETA 0:00 (step cap)"

    bounded = io.StringIO()
    p = Progress(100, "lines", stream=bounded, stop_reward=0.9)
    p.update({"step": 10, "reward_mean": 0.2, "elapsed_s": 20.0})
    assert "ETA ≤ 3:00 (step cap)" in bounded.getvalue()
    assert p.eta(0, 0.0) == "ETA ≤ ? (step cap)"  # no step yet: nothing to go by
