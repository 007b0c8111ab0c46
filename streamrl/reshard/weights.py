"""A generation rank's inference weights, as numbered policy versions that stages can await.

Readers (generation) take a shared lease with ``async with weights.use(min_version)``; the
updater (a colocated reshard or a disaggregated receive) takes the exclusive side with
``async with weights.update()`` and calls :meth:`InferenceWeights.publish` before leaving. A
reader therefore never sees a half-written version, and an update waits for the forward passes
in flight to finish. Waiting is the only thing that blocks: everything runs on the event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from math import prod

import anyio
import torch


class WeightsUnavailableError(RuntimeError):
    """The weights were released (colocated training phase) or never filled."""


class VersionError(ValueError):
    """A policy version that does not move forward."""


@dataclass(frozen=True)
class WeightsStatistics:
    version: int | None
    readers: int  # shared leases held now
    waiting_readers: int
    updating: bool
    updates: int  # versions published so far
    allocated_bytes: int  # bytes of inference weights held now (0 when released)


class InferenceWeights:
    """Per-rank inference weights (``shapes`` from an :class:`~streamrl.reshard.spec.InferencePlan`)."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, ...]],
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        inference_rank: int = 0,
        tensor_parallel: int = 1,
    ) -> None:
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.inference_rank = inference_rank
        self.tensor_parallel = tensor_parallel
        self._tensors: dict[str, torch.Tensor] | None = None
        self._version: int | None = None
        self._last_version: int | None = None
        self._readers = 0
        self._waiting_readers = 0
        self._writer = False
        self._writers_waiting = 0
        self._updates = 0
        self._changed = anyio.Condition()

    # -- non-blocking ---------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The published version, or None while released / before the first publish."""
        return self._version

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._tensors is None:
            raise WeightsUnavailableError(
                "inference weights are released (colocated training phase) or not filled yet; "
                "await use(min_version) or wait_version(v) first"
            )
        return self._tensors

    def statistics(self) -> WeightsStatistics:
        allocated = 0 if self._tensors is None else sum(prod(s) for s in self.shapes.values())
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return WeightsStatistics(
            self._version,
            self._readers,
            self._waiting_readers,
            self._writer,
            self._updates,
            allocated * itemsize,
        )

    def publish(self, version: int) -> None:
        """Mark the weights just written as ``version``; call inside :meth:`update`."""
        if not self._writer:
            raise RuntimeError("publish() must be called inside `async with weights.update()`")
        if self._last_version is not None and version <= self._last_version:
            raise VersionError(
                f"policy version {version} does not follow the last published {self._last_version}"
            )
        self._version = self._last_version = version
        self._updates += 1

    def release(self) -> None:
        """Free the weights (colocated training phase); call inside :meth:`update`."""
        if not self._writer:
            raise RuntimeError("release() must be called inside `async with weights.update()`")
        self._tensors = None
        self._version = None

    # -- blocking -------------------------------------------------------------------------------
    async def wait_version(self, version: int, timeout_s: float | None = None) -> int:
        """Wait until a version >= ``version`` is published; returns the published version.

        Raises TimeoutError after ``timeout_s`` seconds (None: wait as long as it takes).
        """
        with anyio.fail_after(timeout_s):
            async with self._changed:
                while self._version is None or self._version < version:
                    await self._changed.wait()
                return self._version

    @asynccontextmanager
    async def use(self, min_version: int) -> AsyncIterator[Mapping[str, torch.Tensor]]:
        """Shared lease on a published version >= ``min_version`` (generation holds it per forward)."""
        async with self._changed:
            self._waiting_readers += 1
            try:
                # writers first: a waiting update must not starve behind a stream of readers
                while (
                    self._writer
                    or self._writers_waiting
                    or self._version is None
                    or self._version < min_version
                ):
                    await self._changed.wait()
            finally:
                self._waiting_readers -= 1
            self._readers += 1
        try:
            yield self.tensors
        finally:
            with anyio.CancelScope(shield=True):
                async with self._changed:
                    self._readers -= 1
                    self._changed.notify_all()

    @asynccontextmanager
    async def update(self) -> AsyncIterator[dict[str, torch.Tensor]]:
        """Exclusive access for writing a new version; allocates the weights if released."""
        async with self._changed:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    await self._changed.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            if self._tensors is None:
                # zeros, not empty: vocab padding rows are never written and must read as 0
                self._tensors = {
                    name: torch.zeros(shape, dtype=self.dtype, device=self.device)
                    for name, shape in self.shapes.items()
                }
            yield self._tensors
        finally:
            with anyio.CancelScope(shield=True):
                async with self._changed:
                    self._writer = False
                    self._changed.notify_all()
