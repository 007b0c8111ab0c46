"""Per-step metrics to ``metrics.jsonl``, TensorBoard event files and ``reward_curve.png``."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("streamrl.metrics")


class MetricsWriter:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a", buffering=1)  # line-buffered: a crash loses no finished step
        self.rows: list[dict[str, Any]] = []
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except ImportError as exc:  # tensorboard not installed: say so once, keep going
                log.warning("TensorBoard logging off (%s); pip install tensorboard", exc)

    def write(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.rows.append(clean)
        self._file.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            step = int(row.get("step", len(self.rows)))
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None:
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def plot_reward_curve(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Mean reward per step (with ±std band); None when matplotlib is missing or no steps ran."""
    steps = [r["step"] for r in rows if r.get("reward_mean") is not None]
    if not steps:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("reward_curve.png skipped: pip install matplotlib")
        return None
    mean = [r["reward_mean"] for r in rows if r.get("reward_mean") is not None]
    std = [r.get("reward_std") or 0.0 for r in rows if r.get("reward_mean") is not None]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, mean, color="tab:blue", label="mean reward")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                    [m + s for m, s in zip(mean, std, strict=True)], color="tab:blue", alpha=0.15, label="± std")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title(title or "reward per step")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
