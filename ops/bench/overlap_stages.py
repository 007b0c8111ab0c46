"""Stages for ops/bench/streaming_overlap.py: a source of empty samples and stages that sleep."""

from __future__ import annotations

from typing import Any

import anyio

from streamrl.runtime.stage import Batch, Output, StageContext


class CountingSource:
    async def setup(self, ctx: StageContext) -> None:
        self.left = int(ctx.options["micro_batches"])
        self.size = int(ctx.options["micro_batch"])
        self.produced = 0

    async def produce(self) -> Output | None:
        if self.left == 0:
            return None
        self.left -= 1
        ids = list(range(self.produced, self.produced + self.size))
        self.produced += self.size
        return Output({"x0": ids})

    async def close(self) -> None:
        pass


class SleepStage:
    """Sleeps ``options.sleep_s`` per micro-batch (a stand-in for compute that does not contend for
    the CPU), then copies its input column to its output column."""

    async def setup(self, ctx: StageContext) -> None:
        self.sleep_s = float(ctx.options["sleep_s"])
        self.src = ctx.spec.reads[0]
        self.dst = ctx.spec.writes[0] if ctx.spec.writes else None

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        await anyio.sleep(self.sleep_s)
        return {self.dst: batch.columns[self.src]} if self.dst else {}

    async def close(self) -> None:
        pass
