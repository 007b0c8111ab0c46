"""A digits-max reward that takes a while per call, so a server always has work in flight."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from streamrl.tasks.rewards import digits_max


def digits_max_slow(prompt: str, response: str, answer: str, response_ids: Sequence[int] = (), **_: Any) -> float:
    time.sleep(0.002)
    return digits_max(prompt, response, answer, response_ids)
