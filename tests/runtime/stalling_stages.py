"""A stage that hangs on purpose, for the stall-detection test: the advantage stage, except that
its third batch blocks the worker's event loop in a long ``time.sleep`` (as a stage calling a
blocking client without ``run_sync`` would)."""

from __future__ import annotations

import time
from typing import Any

from streamrl.runtime.stage import Batch
from streamrl.stages.advantage import AdvantageStage

HANG_S = 120.0  # far past the test's stall timeout: the launcher must stop the run, not this


class HangsOnThirdBatch(AdvantageStage):
    restartable = False
    batches = 0

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        self.batches += 1
        if self.batches == 3:
            time.sleep(HANG_S)  # blocking on purpose
        return await super().process(batch)
