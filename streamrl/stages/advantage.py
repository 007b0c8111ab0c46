"""The advantage stage: calls the config's advantage estimator (``algo.advantage``, a name in
:data:`streamrl.algos.advantages.ADVANTAGES` or ``module:function``) on whole groups of rewards.
Claims whole groups only (``whole_groups: true``), so every estimator sees each group entire.

With ``algo.loss.kl_in: reward`` and ``kl_coef`` > 0 it first takes the KL penalty from each
reward (:func:`streamrl.algos.grpo.kl_reward_penalty`), reading ``ref_logprobs`` and
``rollout_logprobs``; the trainer then adds no KL to the loss."""

from __future__ import annotations

from typing import Any

import torch

from streamrl.algos.advantages import ADVANTAGES
from streamrl.algos.grpo import kl_reward_penalty
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
        if cfg.algo.loss.kl_in_reward:
            missing = [c for c in ("ref_logprobs", "rollout_logprobs") if c not in spec.reads]
            if missing:
                raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: algo.loss.kl_in: reward takes the KL "
                                  f"penalty from the reward here, so this stage must read {missing}: add them to "
                                  "its reads (pipelines/grpo_kl_reward.yaml does)")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        if not ctx.spec.whole_groups:
            raise ValueError("the advantage stage normalises within groups: set whole_groups: true in the pipeline")
        algo = ctx.config.algo
        self.estimator = ADVANTAGES.resolve(algo.advantage)
        self.options = dict(algo.advantage_options)
        self.kl_in_reward = ctx.config.algo.loss.kl_in_reward

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        rewards = torch.tensor([float(r) for r in batch.columns["reward"]])
        if self.kl_in_reward:
            loss = self.ctx.config.algo.loss
            penalty = torch.tensor([
                kl_reward_penalty(rollout, ref, loss.kl_coef, loss.kl_estimator)
                for rollout, ref in zip(batch.columns["rollout_logprobs"], batch.columns["ref_logprobs"], strict=True)
            ])
            rewards = rewards - penalty
            self.ctx.report_metrics({"kl_penalty_mean": float(penalty.mean())})
        adv = self.estimator(rewards=rewards, group_ids=torch.tensor(batch.groups), **self.options)
        if not isinstance(adv, torch.Tensor) or adv.shape != rewards.shape or not bool(torch.isfinite(adv).all()):
            got = f"shape {tuple(adv.shape)}" if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise ValueError(f"advantage estimator {self.ctx.config.algo.advantage!r} returned {got}; it must return "
                             f"a finite tensor of one advantage per sample, shape {tuple(rewards.shape)}")
        return {"advantage": adv.tolist()}

    async def close(self) -> None:
        pass

