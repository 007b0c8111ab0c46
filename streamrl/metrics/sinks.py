"""Where a run's metric rows go: sinks behind one small interface.

A row is a flat ``{name: number}`` dict with an integer ``step`` (a training row, or an eval row
whose names start with ``eval/``; both may share a step, and eval rows can arrive after later
training rows). :class:`~streamrl.metrics.writer.MetricsWriter` fans each row out to the run's
sinks: ``metrics.jsonl`` always, TensorBoard (``output.tensorboard``) and Weights & Biases
(``output.wandb``) when configured.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from streamrl.config import ConfigError, WandbConfig


class MetricsSink(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class SinkUnavailable(ConfigError):
    """A configured sink cannot start (its package is missing, W&B refuses to log in); says what to
    install or which ``output.*`` option to change. A ConfigError: ``streamrl run`` exits 2 with it."""


def clean(row: dict[str, Any]) -> dict[str, Any]:
    """Non-finite floats as None: strict JSON has no NaN or Infinity."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class JsonlSink:
    """``metrics.jsonl``: one JSON object per line, line-buffered (a crash loses no finished step)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(clean(row)) + "\n")

    def sync(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """TensorBoard event files under ``<run dir>/tensorboard`` (``tensorboard --logdir runs``).

    A row is one event holding all its scalars (a ``Summary`` of many values, as TensorBoard reads
    them), not an event per scalar: each event is a hand-off to the writer's thread and a record
    written, and a row has a few dozen scalars (per scalar, TensorBoard writing was about two fifths
    of the launcher's CPU in a small model's run, docs/benchmarks.md §33)."""

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise SinkUnavailable(f"TensorBoard logging needs tensorboard ({exc}): pip install tensorboard, or set "
                                  "output.tensorboard: false") from None
        self._tb = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self._summary = Summary

    def write(self, row: dict[str, Any]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in _scalars(row).items()]
        if values:
            self._tb._get_file_writer().add_summary(self._summary(value=values), int(row["step"]))

    def close(self) -> None:
        self._tb.close()


#: W&B wants steps that only increase; eval rows come late, so every metric is plotted against
#: this one instead of W&B's own step (define_metric's step_metric).
WANDB_STEP = "trainer/step"


class WandbSink:
    """A Weights & Biases run in ``<run dir>/wandb``: ``mode: offline`` writes it there without any
    network (``wandb sync <run dir>/wandb/offline-run-*`` uploads it later)."""

    def __init__(self, run_dir: Path, config: WandbConfig, run_config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise SinkUnavailable("output.wandb is set but wandb is not installed: pip install wandb, or remove "
                                  "output.wandb") from None
        # no git probing (the run's config says what ran); no console capture: the progress line
        # rewrites itself with \r, which a captured log turns into noise. System stats stay W&B's default.
        settings = wandb.Settings(disable_git=True, console="off", silent=True)
        try:
            # create_new: a W&B run the caller already has open (a notebook's) is left alone
            self.run = wandb.init(project=config.project, entity=config.entity, group=config.group,
                                  tags=list(config.tags) or None, name=run_dir.name, dir=str(run_dir),
                                  mode=config.mode, config=run_config or {}, settings=settings, reinit="create_new")
        except Exception as exc:  # no API key, no network in online mode, a bad entity: all config matters
            raise SinkUnavailable(f"output.wandb: wandb.init failed ({type(exc).__name__}: {exc}); run `wandb login`, "
                                  "or set output.wandb.mode: offline (upload later with `wandb sync`)") from exc
        self.run.define_metric(WANDB_STEP)
        self.run.define_metric("*", step_metric=WANDB_STEP)

    def write(self, row: dict[str, Any]) -> None:
        self.run.log({WANDB_STEP: int(row["step"]), **_scalars(row)})

    def close(self) -> None:
        self.run.finish()
