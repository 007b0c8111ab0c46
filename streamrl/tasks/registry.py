"""Tasks by name: ``get_task("digits-max", n_digits=3)``.

Built-ins: digits-max, digits-last, digits-sum, digits-reverse (``streamrl.tasks.digits``) and
``jsonl`` (``path=`` a prompt file, ``reward=`` a built-in task name or "module:function").
``register_task`` adds a user's own factory.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from streamrl.tasks import digits
from streamrl.tasks.base import RewardFn, Task, TaskOptionError
from streamrl.tasks.dataset import DatasetTask, load_prompts_jsonl


class UnknownTaskError(KeyError):
    """No task of that name; the message suggests the closest names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


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


def _bind(name: str, factory: Callable[..., Task], options: Mapping[str, Any]) -> None:
    signature = inspect.signature(factory)
    try:
        signature.bind(**options)
    except TypeError as exc:
        accepted = [p for p in signature.parameters if p != "self"]
        raise TaskOptionError(f"task {name!r}: {exc}; accepted options: {accepted}") from exc


def check_task(name: str, options: Mapping[str, Any], tokenizer: Any = None) -> Task | None:
    """Find what is wrong with task ``name`` and its ``options`` before a run starts.

    A built-in digits task (or a registered one) is built as the source stage will build it
    (cheap) and returned. ``jsonl`` checks its options only and returns None: reading its rows is
    the caller's (``check_prompts_jsonl``, bounded). ``tokenizer`` is set by streamrl from the model,
    never by the config."""
    factory = _FACTORIES.get(name)
    if factory is None:
        get_task(name)  # raises UnknownTaskError with the did-you-mean
    assert factory is not None
    if "tokenizer" in options:
        raise TaskOptionError(f"task {name!r}: option 'tokenizer' is set by streamrl from the model (model.path "
                              "or the built-in character tokenizer); remove it from task.options")
    _bind(name, factory, options)
    if name != "jsonl":
        extra = {"tokenizer": tokenizer} if name.startswith("digits") and tokenizer is not None else {}
        return factory(**options, **extra)
    path, reward = options.get("path"), options.get("reward")
    if not isinstance(path, str) or not path:
        raise TaskOptionError(f"task 'jsonl': option path must be the prompt file's path (a string), got {path!r}")
    if not isinstance(reward, str) or not reward:
        raise TaskOptionError(f"task 'jsonl': option reward must be a built-in task name (e.g. digits-reverse) or "
                              f"'module:function', got {reward!r}")
    if reward == "jsonl":
        raise TaskOptionError("task 'jsonl': option reward 'jsonl' has no reward rule of its own; name a built-in "
                              f"task ({', '.join(n for n in task_names() if n != 'jsonl')}) or 'module:function'")
    try:
        load_reward_fn(reward)
    except UnknownTaskError as exc:
        raise TaskOptionError(f"task 'jsonl': option reward: {exc}, or 'module:function'") from None
    label = options.get("name")
    if label is not None and not isinstance(label, str):
        raise TaskOptionError(f"task 'jsonl': option name must be a string, got {label!r}")
    return None


def get_task(name: str, **options: Any) -> Task:
    """Build the task ``name`` with ``options`` (its factory's keyword arguments)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        close = difflib.get_close_matches(name, _FACTORIES, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownTaskError(f"unknown task {name!r}{hint} (known tasks: {', '.join(task_names())})")
    _bind(name, factory, options)
    return factory(**options)
