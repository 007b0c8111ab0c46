"""The advantage stage: GRPO group normalisation. Claims whole groups only (``whole_groups: true``)."""

from __future__ import annotations

from typing import Any

import torch

from streamrl.algos.grpo import group_advantages
from streamrl.runtime.pipeline import NoOptions
from streamrl.runtime.stage import Batch, StageContext


class AdvantageStage:
    restartable = True  # stateless between micro-batches: the launcher may restart a dead worker
    Options = NoOptions  # it takes no options; checked when the pipeline loads

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        if not ctx.spec.whole_groups:
            raise ValueError("the advantage stage normalises within groups: set whole_groups: true in the pipeline")

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        rewards = torch.tensor([float(r) for r in batch.columns["reward"]])
        adv = group_advantages(rewards, torch.tensor(batch.groups), self.ctx.config.algo.normalize_std)
        return {"advantage": adv.tolist()}

    async def close(self) -> None:
        pass
