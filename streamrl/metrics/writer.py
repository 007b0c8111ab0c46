"""Per-step metrics to the run's sinks (``metrics.jsonl``, TensorBoard, W&B) and ``reward_curve.png``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from streamrl.config import WandbConfig
from streamrl.metrics.sinks import JsonlSink, MetricsSink, SinkUnavailable, TensorBoardSink, WandbSink, clean

log = logging.getLogger("streamrl.metrics")


class MetricsWriter:
    """Fans each row out to the sinks. JSONL always; a sink that fails (W&B's service dying, a
    full disk under TensorBoard) is dropped with one warning and the run goes on: metrics.jsonl
    still holds everything."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, wandb: WandbConfig | None = None,
                 run_config: dict[str, Any] | None = None, purge_step: int | None = None) -> None:
        """``purge_step``: a resumed run's first new step; TensorBoard hides the interrupted run's
        events from there on (they are written again)."""
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        self.sinks: dict[str, MetricsSink] = {"jsonl": JsonlSink(self.path)}
        if tensorboard:
            try:
                self.sinks["tensorboard"] = TensorBoardSink(run_dir / "tensorboard", purge_step=purge_step)
            except SinkUnavailable as exc:  # optional: say so once, keep going
                log.warning("%s", exc)
        if wandb is not None:
            self.sinks["wandb"] = WandbSink(run_dir, wandb, run_config)  # asked for: its absence is an error

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(clean(row))
        for name, sink in list(self.sinks.items()):
            try:
                sink.write(row)
            except Exception as exc:
                if name == "jsonl":
                    raise  # the run's record of itself: failing to write it is the run's failure
                log.warning("metrics sink %s failed (%s: %s); dropped, metrics.jsonl goes on", name,
                            type(exc).__name__, exc)
                self._close(name, self.sinks.pop(name))

    def sync(self) -> None:
        """metrics.jsonl to disk (fsync): what is written so far survives a crash of the machine."""
        jsonl = self.sinks["jsonl"]
        assert isinstance(jsonl, JsonlSink)
        jsonl.sync()

    def close(self) -> None:
        for name, sink in list(self.sinks.items()):
            self._close(name, sink)
        self.sinks.clear()

    @staticmethod
    def _close(name: str, sink: MetricsSink) -> None:
        try:
            sink.close()
        except Exception as exc:
            log.warning("closing metrics sink %s failed: %s", name, exc)


def plot_reward_curve(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Mean reward per step (with ±std band); None when matplotlib is missing or no steps ran."""
    from streamrl.metrics.report import plot_reward

    return plot_reward(rows, path, title=title)
