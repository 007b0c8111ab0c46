"""Tasks by name: ``get_task("digits-max", n_digits=3)``.

Built-ins: digits-max, digits-last, digits-sum, digits-reverse (``streamrl.tasks.digits``),
digits-calc (digits-sum with a calculator tool, for the agent stage: ``streamrl.tasks.calculator``),
``dataset`` (``path=`` a JSONL / JSON / Parquet file or a datasets directory, ``reward=`` a named
reward, a weighted mapping of them, or "module:function"; :func:`streamrl.tasks.dataset.dataset_task`)
and ``jsonl`` (JSONL files only).
``register_task`` adds a user's own factory.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from streamrl.config import did_you_mean
from streamrl.rewards.named import NAMED_REWARDS, RewardSpecError, WeightedReward, check_weights
from streamrl.tasks import calculator, digits
from streamrl.tasks.base import RewardFn, Task, TaskOptionError
from streamrl.tasks.dataset import DatasetTask, check_dataset_task, dataset_task, load_prompts_jsonl


class UnknownTaskError(KeyError):
    """No task of that name; the message suggests the closest names."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def load_reward_fn(spec: str | Mapping[str, float]) -> RewardFn:
    """A reward function from a named reward (``math``, ``format``: :mod:`streamrl.rewards.named`),
    a built-in task name, a ``"module:function"`` import path, or a mapping of those to weights
    (a :class:`~streamrl.rewards.named.WeightedReward`)."""
    if isinstance(spec, Mapping):
        try:
            weights = check_weights(spec)
            parts = {_component_name(name): (load_reward_fn(name), w) for name, w in weights.items()}
            return WeightedReward(parts)
        except RewardSpecError as exc:
            raise TaskOptionError(f"reward {dict(spec)!r}: {exc}") from None
    if not isinstance(spec, str) or not spec:
        raise TaskOptionError(f"reward must be a reward name ({', '.join(reward_names())}), 'module:function', or "
                              f"a mapping of them to weights, e.g. {{math: 1.0, format: 0.1}}; got {spec!r}")
    if spec in NAMED_REWARDS:
        return _import_function(NAMED_REWARDS[spec], spec)
    if ":" not in spec:
        if spec not in _FACTORIES or spec in ("jsonl", "dataset"):
            raise TaskOptionError(f"unknown reward {spec!r}{did_you_mean(spec, reward_names())}; or give "
                                  "'module:function'")
        return get_task(spec).reward
    return _import_function(spec, spec)


def reward_names() -> list[str]:
    """The names a reward spec may use without an import path."""
    return sorted({*NAMED_REWARDS, *(n for n in _FACTORIES if n not in ("jsonl", "dataset"))})


def _component_name(spec: str) -> str:
    """A weighted reward's key for a component: its name, or the function's name of an import path."""
    return spec.rpartition(":")[2] if ":" in spec else spec


def _import_function(path: str, spec: str) -> RewardFn:
    from streamrl.runtime.pipeline import import_object

    try:
        fn = import_object(path, "reward", form="module:function", must_call=True)
    except ValueError as exc:
        raise TaskOptionError(str(exc).replace(f"reward {path!r}", f"reward {spec!r}", 1)) from None
    return fn  # type: ignore[no-any-return]


def _jsonl_task(path: str | Path, reward: str | RewardFn, name: str | None = None) -> DatasetTask:
    reward_fn = load_reward_fn(reward) if isinstance(reward, str) else reward
    return DatasetTask(name or f"jsonl:{Path(path).name}", load_prompts_jsonl(path), reward_fn)


_FACTORIES: dict[str, Callable[..., Task]] = {
    "digits-max": digits.digits_max,
    "digits-last": digits.digits_last,
    "digits-sum": digits.digits_sum,
    "digits-reverse": digits.digits_reverse,
    "digits-calc": calculator.digits_calc,
    "jsonl": _jsonl_task,
    "dataset": dataset_task,
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
    if name == "dataset":
        _check_reward_option(name, options.get("reward"))
        if factory is dataset_task:  # reads the rows now (bounded), with the errors the source stage would give
            return check_dataset_task(**options)
        return factory(**options)
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


def _check_reward_option(task: str, reward: object) -> None:
    """``reward`` of a dataset task resolves (named, weighted, task name or import path)."""
    if reward is None:
        raise TaskOptionError(f"task {task!r}: option reward is required: a reward name ({', '.join(reward_names())}), "
                              "'module:function', or weights, e.g. {math: 1.0, format: 0.1}")
    load_reward_fn(reward)  # type: ignore[arg-type]  # its errors name what is wrong


def get_task(name: str, **options: Any) -> Task:
    """Build the task ``name`` with ``options`` (its factory's keyword arguments)."""
    factory = _FACTORIES.get(name)
    if factory is None:
        close = difflib.get_close_matches(name, _FACTORIES, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownTaskError(f"unknown task {name!r}{hint} (known tasks: {', '.join(task_names())})")
    _bind(name, factory, options)
    return factory(**options)
