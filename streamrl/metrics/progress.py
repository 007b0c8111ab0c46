"""Live progress: one rewritten status line on a terminal, plain log lines otherwise.

The ETA is the time to the step cap (``algo.steps``) at the mean time per step so far, counted
from the start of training (a row's ``elapsed_s``: set-up is not a step). With ``algo.stop_reward``
the run may stop sooner, when a step reaches that reward, which cannot be foreseen: the line then
shows the step cap's ETA as an upper bound, ``ETA ≤ 4:10 (step cap)``; without it, ``ETA 4:10
(step cap)``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _fmt_eta(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    def __init__(self, total_steps: int, mode: str = "auto", stream: TextIO | None = None,
                 line_every_s: float = 2.0, *, stop_reward: float | None = None) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "tty" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total = total_steps
        self.stop_reward = stop_reward  # the run may stop before total_steps: the ETA is a bound
        self.t0 = time.monotonic()
        self.line_every_s = line_every_s
        self._last_line = 0.0
        self._dirty = False

    def message(self, text: str) -> None:
        if self.mode == "none":
            return
        if self._dirty:
            self.stream.write("\n")
            self._dirty = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def update(self, row: dict[str, Any]) -> None:
        if self.mode == "none":
            return
        step = int(row["step"])
        elapsed = float(row.get("elapsed_s", time.monotonic() - self.t0))
        line = (f"step {step}/{self.total}  reward {row.get('reward_mean', float('nan')):.3f}"
                f"  loss {row.get('loss', float('nan')):+.4f}  {row.get('samples_per_s', 0.0):.0f} samples/s"
                f"  {row.get('tokens_per_s', 0.0):.0f} tok/s  elapsed {_fmt_eta(elapsed)}  {self.eta(step, elapsed)}")
        if self.mode == "tty":
            self.stream.write("\r\x1b[2K" + line)
            self.stream.flush()
            self._dirty = True
        elif time.monotonic() - self._last_line >= self.line_every_s or step in (1, self.total):
            self.stream.write(line + "\n")
            self.stream.flush()
            self._last_line = time.monotonic()

    def eta(self, step: int, elapsed_s: float) -> str:
        """What the line says of the time left after ``step`` steps in ``elapsed_s`` of training."""
        left = (self.total - step) * elapsed_s / step if step > 0 else float("inf")
        bound = "≤ " if self.stop_reward is not None else ""
        return f"ETA {bound}{_fmt_eta(max(left, 0.0))} (step cap)"

    def close(self) -> None:
        if self._dirty:
            self.stream.write("\n")
            self.stream.flush()
            self._dirty = False
