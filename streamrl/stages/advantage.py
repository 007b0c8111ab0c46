"""The advantage stage: calls the config's advantage estimator (``algo.advantage``, a name in
:data:`streamrl.algos.advantages.ADVANTAGES` or ``module:function``) on whole groups of rewards.
Claims whole groups only (``whole_groups: true``), so every estimator sees each group entire."""

from __future__ import annotations

from typing import Any

import torch

from streamrl.algos.advantages import ADVANTAGES
from streamrl.config import ConfigError, RunConfig
from streamrl.runtime.pipeline import NoOptions, PipelineSpec, StageSpec
from streamrl.runtime.stage import Batch, StageContext


class AdvantageStage:
    restartable = True  # stateless between micro-batches: the launcher may restart a dead worker
    Options = NoOptions  # it takes no options; checked when the pipeline loads

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        """Before anything starts (``validate_pipeline``): it claims whole groups."""
        if not spec.whole_groups:
            raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: the advantage stage normalises rewards "
                              "within a group; set whole_groups: true")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        if not ctx.spec.whole_groups:
            raise ValueError("the advantage stage normalises within groups: set whole_groups: true in the pipeline")
        algo = ctx.config.algo
        self.estimator = ADVANTAGES.resolve(algo.advantage)
        self.options = dict(algo.advantage_options)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        rewards = torch.tensor([float(r) for r in batch.columns["reward"]])
        adv = self.estimator(rewards=rewards, group_ids=torch.tensor(batch.groups), **self.options)
        if not isinstance(adv, torch.Tensor) or adv.shape != rewards.shape or not bool(torch.isfinite(adv).all()):
            got = f"shape {tuple(adv.shape)}" if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise ValueError(f"advantage estimator {self.ctx.config.algo.advantage!r} returned {got}; it must return "
                             f"a finite tensor of one advantage per sample, shape {tuple(rewards.shape)}")
        return {"advantage": adv.tolist()}

    async def close(self) -> None:
        pass
