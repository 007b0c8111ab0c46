"""A run's metrics as the launcher gathers them: one row per optimizer step (the trainer's
figures, each stage's ``busy/<stage>`` fraction, the stages' own metrics, restarts), one row
per evaluation, written to ``metrics.jsonl`` and the configured sinks (TensorBoard, W&B) and
shown by the progress line."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from streamrl.config import RunConfig
from streamrl.metrics.busy import BusyTracker
from streamrl.metrics.progress import Progress
from streamrl.metrics.stage_figures import StageFigures
from streamrl.metrics.writer import MetricsWriter
from streamrl.runtime.pipeline import PipelineSpec


class RunMetrics:
    """Step and eval rows of one launch, and the stage figures they are made of.

    Supervision feeds it the workers' events: ``busy`` (cumulative seconds in ``process()`` per
    stage worker, from ``StageBusy``, for the status page's rates) and ``busy_tracker`` (the same
    reports with when they were measured, from which each row's ``busy/<stage>`` is computed),
    ``samples`` (samples processed, same source),
    ``stage_figures`` (``StageMetrics``, joined to the rows by when they were measured), ``restarts``, and every ``StepReport`` / ``EvalReport``
    through :meth:`on_step` / :meth:`on_eval`.
    """

    def __init__(self, cfg: RunConfig, pipeline: PipelineSpec, run_dir: Path, progress: Progress,
                 train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]],
                 resumed_at: int | None) -> None:
        self.cfg = cfg
        self.pipeline = pipeline
        self.progress = progress
        self.train_rows = train_rows  # a resumed run's rows up to its checkpoint come first
        self.eval_rows = eval_rows
        self.metrics = MetricsWriter(run_dir, tensorboard=cfg.output.tensorboard, wandb=cfg.output.wandb,
                                     run_config=msgspec.to_builtins(cfg),
                                     purge_step=resumed_at + 1 if resumed_at is not None else None)
        self.busy: dict[tuple[str, int], float] = {}
        self.samples: dict[tuple[str, int], int] = {}
        self.stage_figures = StageFigures()
        self.restarts: dict[str, int] = {}  # "<stage>-<worker>" process name -> times it was restarted
        self.busy_tracker = BusyTracker({s.name: s.workers for s in pipeline.stages})
        self.t_go = 0.0  # monotonic time of Go (training started)
        self.t_go_wall = 0.0  # the same moment on the wall clock, which the workers' reports use
        self.t_progress = 0.0  # the last optimizer step (or Go)
        self.time_to_target: float | None = None
        self._last_elapsed = 0.0  # the previous training row's elapsed_s

    def go(self) -> None:
        """Training starts now: step times and elapsed_s count from here."""
        self.t_go = self.t_progress = time.monotonic()
        self.t_go_wall = time.time()

    def on_step(self, step: int, metrics: dict[str, float], measured_at: float = 0.0, *,
                durable: bool = False) -> None:
        """One step's row to every sink; ``durable``: metrics.jsonl is fsynced before this returns
        (the trainer commits a checkpoint of this step only after that: a crash of the machine, not
        only of the launcher, then leaves no checkpoint ahead of the rows)."""
        now = time.monotonic()
        self.t_progress = now
        # elapsed_s: from Go to the end of the step as the trainer measured it (not when its report
        # arrived here, which can lag on a loaded machine), so that a row's elapsed_s and its
        # busy/<stage> fractions share one window: busy seconds = fraction x the gap in elapsed_s.
        ended = measured_at or time.time()
        busy = self.busy_tracker.step(ended, go=self.t_go_wall)
        elapsed = max(ended - self.t_go_wall, self._last_elapsed)
        self._last_elapsed = elapsed
        row: dict[str, Any] = {"step": step, **metrics, "elapsed_s": round(elapsed, 4), **busy}
        for (stage, k), values in sorted(self.stage_figures.until(ended).items()):
            for name, v in values.items():
                key = f"{stage}/{name}" if self.pipeline.stage(stage).workers == 1 else f"{stage}/{k}/{name}"
                row[key] = v
        for name, n in sorted(self.restarts.items()):
            row[f"restarts/{name}"] = n
        target = self.cfg.algo.stop_reward
        if target is not None and self.time_to_target is None and metrics.get("reward_mean", -1e9) >= target:
            self.time_to_target = elapsed
        self.train_rows.append(row)
        self.metrics.write(row)
        if durable:
            self.metrics.sync()
        self.progress.update(row)

    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation of policy version ``step``: a row of its own (no training figures)."""
        row: dict[str, Any] = {"step": step, **{f"eval/{k}": v for k, v in metrics.items()},
                               "elapsed_s": round(time.monotonic() - self.t_go, 4)}
        self.eval_rows.append(row)
        self.metrics.write(row)
        shown = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "@" in k)  # mean@k, pass@k
        self.progress.message(f"streamrl: eval of version {step}: {shown}")

    def close(self) -> None:
        self.metrics.close()
