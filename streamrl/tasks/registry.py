"""Tasks by name: ``get_task("digits-max", n_digits=3)``.

Built-ins: digits-max, digits-last, digits-sum, digits-reverse (``streamrl.tasks.digits``) and
``jsonl`` (``path=`` a prompt file, ``reward=`` a built-in task name or "module:function").
``register_task`` adds a user's own factory.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streamrl.tasks import digits
from streamrl.tasks.base import RewardFn, Task
from streamrl.tasks.dataset import DatasetTask, load_prompts_jsonl


class UnknownTaskError(KeyError):
    """No task of that name; the message suggests the closest names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class TaskOptionError(TypeError):
    """A task option is unknown or has the wrong value."""


def load_reward_fn(spec: str) -> RewardFn:
    """A reward function from a built-in task name or a "module:function" import path."""
    if ":" not in spec:
        task = get_task(spec)
        return task.reward
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskOptionError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise TaskOptionError(f"reward {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def _jsonl_task(path: str | Path, reward: str | RewardFn, name: str | None = None) -> DatasetTask:
    reward_fn = load_reward_fn(reward) if isinstance(reward, str) else reward
    return DatasetTask(name or f"jsonl:{Path(path).name}", load_prompts_jsonl(path), reward_fn)


_FACTORIES: dict[str, Callable[..., Task]] = {
    "digits-max": digits.digits_max,
    "digits-last": digits.digits_last,
    "digits-sum": digits.digits_sum,
    "digits-reverse": digits.digits_reverse,
    "jsonl": _jsonl_task,
}


def task_names() -> list[str]:
    return sorted(_FACTORIES)


def register_task(name: str, factory: Callable[..., Task], *, replace: bool = False) -> None:
    """Make ``get_task(name, **options)`` call ``factory(**options)``."""
    if name in _FACTORIES and not replace:
        raise ValueError(f"task {name!r} is already registered; pass replace=True to override it")
    _FACTORIES[name] = factory


def get_task(name: str, **options: Any) -> Task:
    """Build the task ``name`` with ``options`` (its factory's keyword arguments)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        close = difflib.get_close_matches(name, _FACTORIES, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownTaskError(f"unknown task {name!r}{hint} (known tasks: {', '.join(task_names())})")
    signature = inspect.signature(factory)
    try:
        signature.bind(**options)
    except TypeError as exc:
        accepted = [p for p in signature.parameters if p != "self"]
        raise TaskOptionError(f"task {name!r}: {exc}; accepted options: {accepted}") from exc
    return factory(**options)
