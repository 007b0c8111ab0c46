"""The in-process reward backend (``backend: inprocess``): calls the reward function directly.

Same ``score`` signature and result type as :class:`~streamrl.rewards.client.RewardClient`, so the
score stage switches backends by configuration. Sync functions run in worker threads so the stage's
event loop keeps streaming; at most ``max_concurrency`` batches are scored at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import anyio
import msgspec

from streamrl.rewards.function import RewardFunction
from streamrl.rewards.latency import LatencyWindow
from streamrl.rewards.protocol import RewardSample, Score, normalise_score
from streamrl.rewards.results import (
    OnSampleError,
    RewardConfigError,
    RewardError,
    RewardResult,
    apply_sample_error_policy,
    validate_policies,
)


class InProcessStatistics(msgspec.Struct, frozen=True):
    batches: int
    samples: int
    sample_errors: int
    defaulted_samples: int
    in_flight: int
    latency_p50_ms: float | None
    latency_p99_ms: float | None


class InProcessRewardBackend:
    """Score samples by calling ``function`` (``module:function``, a callable or a RewardFunction)."""

    #: RewardResult.source for scores made here.
    SOURCE = "inprocess"

    def __init__(
        self,
        function: str | Callable[..., Any] | RewardFunction,
        *,
        max_concurrency: int = 4,
        on_sample_error: OnSampleError = "fail",
        default_score: Score = 0.0,
    ) -> None:
        if max_concurrency < 1:
            raise RewardConfigError(f"max_concurrency={max_concurrency}; need at least 1 concurrent batch")
        validate_policies(None, on_sample_error, default_score)
        if isinstance(function, str):
            function = RewardFunction.from_spec(function)
        elif not isinstance(function, RewardFunction):
            function = RewardFunction(function)
        self.function = function
        self.max_concurrency = max_concurrency
        self.on_sample_error = on_sample_error
        self.default_score = normalise_score(default_score)
        # Event-loop objects are made on first use: they belong to the loop that runs them.
        self._slots: anyio.Semaphore | None = None
        self._threads: anyio.CapacityLimiter | None = None
        self._closed = False
        self._in_flight = 0
        self._latency = LatencyWindow()
        self._counts = {"batches": 0, "samples": 0, "sample_errors": 0, "defaulted_samples": 0}

    async def __aenter__(self) -> InProcessRewardBackend:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def score(self, samples: Sequence[RewardSample]) -> list[RewardResult]:
        """One result per sample, in order (see RewardClient.score)."""
        if self._closed:
            raise RewardError("InProcessRewardBackend is closed")
        for sample in samples:
            if not isinstance(sample, RewardSample):
                raise TypeError(f"score() takes RewardSample objects, got {type(sample).__name__}")
        if self._slots is None or self._threads is None:
            self._slots = anyio.Semaphore(self.max_concurrency)
            self._threads = anyio.CapacityLimiter(self.max_concurrency)
        self._in_flight += 1
        try:
            async with self._slots:
                started = time.perf_counter()
                replies = await self.function.score(list(samples), limiter=self._threads)
                self._latency.add(time.perf_counter() - started)
        finally:
            self._in_flight -= 1
        results = [
            RewardResult(sample_id=r.id, score=r.score, error=r.error, source=self.SOURCE) for r in replies
        ]
        self._counts["batches"] += 1
        return apply_sample_error_policy(results, self.on_sample_error, self.default_score, self._counts)

    def statistics(self) -> InProcessStatistics:
        return InProcessStatistics(
            in_flight=self._in_flight,
            latency_p50_ms=self._latency.percentile_ms(50),
            latency_p99_ms=self._latency.percentile_ms(99),
            **self._counts,
        )

    async def aclose(self) -> None:
        self._closed = True
