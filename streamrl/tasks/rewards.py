"""The built-in tasks' rewards as plain functions, for `streamrl reward-server`:

    streamrl reward-server streamrl.tasks.rewards:digits_max --bind tcp://127.0.0.1:5555

They score exactly like the in-process score stage does for the same task.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from streamrl.tasks.base import Task
from streamrl.tasks.registry import get_task


@cache
def _task(name: str) -> Task:
    return get_task(name)


def digits_max(prompt: str, response: str, answer: str, response_ids: Sequence[int] = (), **_: Any) -> float:
    return _task("digits-max").reward(prompt, response, list(response_ids), str(answer))


def digits_reverse(prompt: str, response: str, answer: str, response_ids: Sequence[int] = (), **_: Any) -> float:
    return _task("digits-reverse").reward(prompt, response, list(response_ids), str(answer))
