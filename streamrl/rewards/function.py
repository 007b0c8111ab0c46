"""Calling a user's reward function: loading ``module:function``, the per-sample and batched
contracts, sync and async, and turning every failure into a per-sample error instead of a crash.

Per-sample contract (the default)::

    def reward(prompt: str, response: str, **metadata) -> float | dict[str, float]

It also receives ``prompt_ids`` / ``response_ids`` (lists of token ids) when the sample carries them.
Only the keyword arguments the function's signature accepts are passed, so ``def f(response, answer)``
works for samples whose metadata holds ``answer`` (and other metadata keys are not forced on it).

Batched contract, marked with :func:`batched`::

    @batched
    def reward(prompts: list[str], responses: list[str], *, prompt_ids, response_ids, metadata)
        -> list[float | dict[str, float] | Exception]

``metadata`` is a list of per-sample dicts; ``prompt_ids``/``response_ids`` are lists (entries None
when a sample has none). Returning an Exception instance for an entry marks just that sample failed.
Either kind may be ``async def``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio

from streamrl.rewards.protocol import RewardSample, SampleResult, check_score, normalise_score
from streamrl.rewards.results import RewardFunctionLoadError

_BATCHED_ATTRIBUTE = "__streamrl_batched__"
#: Sample fields passed as keyword arguments; a metadata key of the same name would be ambiguous.
_SAMPLE_FIELDS = ("prompt", "response", "prompt_ids", "response_ids")
#: Error strings go over the wire and into logs: keep them readable, not a megabyte of repr.
_MAX_ERROR_CHARS = 2000

F = TypeVar("F", bound=Callable[..., Any])


def batched(function: F) -> F:
    """Mark a reward function as batched: called once per batch with lists (see module docstring)."""
    setattr(function, _BATCHED_ATTRIBUTE, True)
    return function


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Import ``module:attribute`` (the attribute may be dotted: ``module:obj.method``)."""
    module_name, sep, attribute_path = spec.partition(":")
    if not sep or not module_name or not attribute_path:
        raise RewardFunctionLoadError(
            f"reward function {spec!r} is not of the form 'module:function' (e.g. 'my_rewards:exact_match')"
        )
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardFunctionLoadError(
            f"cannot import module {module_name!r} for reward function {spec!r}: {type(exc).__name__}: {exc}. "
            "Is it on PYTHONPATH (or in the current directory)?"
        ) from exc
    for part in attribute_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise RewardFunctionLoadError(
                f"module {module_name!r} has no attribute {attribute_path!r} (reward function {spec!r})"
            ) from exc
    if not callable(target):
        raise RewardFunctionLoadError(f"reward function {spec!r} is a {type(target).__name__}, not callable")
    return target


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[: _MAX_ERROR_CHARS - 3] + "..."


def _result(sample_id: int, value: object) -> SampleResult:
    """A SampleResult from whatever the function returned for one sample."""
    if isinstance(value, BaseException):
        return SampleResult(id=sample_id, error=_error_text(value))
    problem = check_score(value)
    if problem is not None:
        return SampleResult(id=sample_id, error=f"reward function returned an invalid score: {problem}")
    return SampleResult(id=sample_id, score=normalise_score(value))  # type: ignore[arg-type]


class RewardFunction:
    """A user's reward function with its calling convention worked out once, at load time."""

    def __init__(self, function: Callable[..., Any], *, name: str | None = None) -> None:
        self.function = function
        self.name = name or getattr(function, "__qualname__", repr(function))
        self.is_batched = bool(getattr(function, _BATCHED_ATTRIBUTE, False))
        self.is_async = _is_async_callable(function)
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):  # builtins without a signature: pass everything
            parameters = ()
            self._accepts_any_keyword = True
        else:
            self._accepts_any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
        self._keywords = frozenset(
            p.name
            for p in parameters
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        )

    @classmethod
    def from_spec(cls, spec: str) -> RewardFunction:
        return cls(load_reward_function(spec), name=spec)

    def _filter(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self._accepts_any_keyword:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self._keywords}

    def _sample_kwargs(self, sample: RewardSample) -> dict[str, Any]:
        metadata = sample.metadata or {}  # never None after construction; "or" for the type checker
        clashes = [k for k in metadata if k in _SAMPLE_FIELDS]
        if clashes:
            raise ValueError(f"metadata keys {clashes} clash with sample fields; rename them in metadata")
        kwargs: dict[str, Any] = {"prompt": sample.prompt, "response": sample.response}
        if sample.prompt_ids is not None:
            kwargs["prompt_ids"] = sample.prompt_ids
        if sample.response_ids is not None:
            kwargs["response_ids"] = sample.response_ids
        kwargs.update(metadata)
        return self._filter(kwargs)

    def _batch_kwargs(self, samples: Sequence[RewardSample]) -> dict[str, Any]:
        return self._filter(
            {
                "prompts": [s.prompt for s in samples],
                "responses": [s.response for s in samples],
                "prompt_ids": [s.prompt_ids for s in samples],
                "response_ids": [s.response_ids for s in samples],
                "metadata": [s.metadata or {} for s in samples],
            }
        )

    def _batch_results(self, samples: Sequence[RewardSample], values: object) -> list[SampleResult]:
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            problem = f"batched reward function returned {type(values).__name__}; expected a list"
            return [SampleResult(id=s.id, error=problem) for s in samples]
        if len(values) != len(samples):
            problem = f"batched reward function returned {len(values)} scores for {len(samples)} samples"
            return [SampleResult(id=s.id, error=problem) for s in samples]
        return [_result(s.id, v) for s, v in zip(samples, values, strict=True)]

    # -- calling ------------------------------------------------------------------------------------

    def score_sync(self, samples: Sequence[RewardSample]) -> list[SampleResult]:
        """Score a batch with a sync function, in the calling thread. Never raises for the function."""
        if self.is_async:
            raise TypeError(f"{self.name} is async; use `await score(...)`")
        if self.is_batched:
            try:
                values = self.function(**self._batch_kwargs(samples))
            except Exception as exc:
                return [SampleResult(id=s.id, error=_error_text(exc)) for s in samples]
            return self._batch_results(samples, values)
        results = []
        for sample in samples:
            try:
                value: object = self.function(**self._sample_kwargs(sample))
            except Exception as exc:
                value = exc
            results.append(_result(sample.id, value))
        return results

    async def score(
        self, samples: Sequence[RewardSample], *, limiter: anyio.CapacityLimiter | None = None
    ) -> list[SampleResult]:
        """Score a batch. Sync functions run in a worker thread (bounded by ``limiter``) so the
        caller's event loop keeps serving heartbeats; the function raising only fails its samples."""
        if not self.is_async:
            return await anyio.to_thread.run_sync(self.score_sync, samples, limiter=limiter)
        if self.is_batched:
            try:
                values = await self.function(**self._batch_kwargs(samples))
            except Exception as exc:
                return [SampleResult(id=s.id, error=_error_text(exc)) for s in samples]
            return self._batch_results(samples, values)
        results: list[SampleResult | None] = [None] * len(samples)

        async def one(index: int, sample: RewardSample) -> None:
            try:
                value: object = await self.function(**self._sample_kwargs(sample))
            except Exception as exc:
                value = exc
            results[index] = _result(sample.id, value)

        # Samples of one batch run concurrently: an async reward usually waits on I/O (a model server).
        async with anyio.create_task_group() as group:
            for index, sample in enumerate(samples):
                group.start_soon(one, index, sample)
        return [r for r in results if r is not None]


def _is_async_callable(function: Callable[..., Any]) -> bool:
    while isinstance(function, functools.partial):
        function = function.func
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
        getattr(function, "__call__", None)  # noqa: B004 - callable objects with an async __call__
    )
