"""The reference stage: logprobs of the response tokens under the initial (frozen) policy."""

from __future__ import annotations

from typing import Any

from streamrl.engines.logprob import LogprobEngine
from streamrl.runtime.pipeline import NoOptions
from streamrl.runtime.stage import Batch, StageContext
from streamrl.stages.common import build_policy


class ReferenceStage:
    restartable = True  # stateless between micro-batches: the launcher may restart a dead worker
    Options = NoOptions  # it takes no options; checked when the pipeline loads
    uses_model_and_task = True  # the pre-run checks load the run's model (streamrl.runtime.prerun)

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        model, _ = build_policy(ctx.config, ctx.device)
        model.eval().requires_grad_(False)
        self.engine = LogprobEngine(model, device=ctx.device)  # no optimizer: the reference is frozen

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        logp = await self.ctx.run_sync(self.engine.logprobs, batch.columns["prompt_ids"],
                                       batch.columns["response_ids"], self.ctx.config.algo.temperature)
        return {"ref_logprobs": logp}

    async def close(self) -> None:
        pass
