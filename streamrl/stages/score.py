"""The score stage: reward each completion with the task's rule (or ``options.reward``,
a ``module:function`` with the signature of :class:`streamrl.tasks.base.RewardFn`)."""

from __future__ import annotations

import inspect
from typing import Any

from streamrl.runtime.stage import Batch, StageContext
from streamrl.stages.common import build_task, build_tokenizer
from streamrl.tasks.base import batch_reward
from streamrl.tasks.registry import load_reward_fn


class ScoreStage:
    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.tokenizer = build_tokenizer(ctx.config)
        spec = ctx.options.get("reward")
        self.fn: Any = load_reward_fn(spec) if spec else build_task(ctx.config, self.tokenizer).reward
        self.is_async = inspect.iscoroutinefunction(self.fn)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        cols = batch.columns
        ids = [t.tolist() for t in cols["response_ids"]]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
        if self.is_async:
            rewards = [float(await self.fn(p, r, i, a)) for p, r, i, a in
                       zip(cols["prompt"], texts, ids, cols["answer"], strict=True)]
        else:
            rewards = await self.ctx.run_sync(batch_reward, self.fn, cols["prompt"], texts, ids, cols["answer"])
        return {"reward": [float(r) for r in rewards]}

    async def close(self) -> None:
        pass
