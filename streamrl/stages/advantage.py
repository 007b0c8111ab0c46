"""The advantage stage: calls the config's advantage estimator (``algo.advantage``, a name in
:data:`streamrl.algos.advantages.ADVANTAGES` or ``module:function``) on whole groups of rewards.
Claims whole groups only (``whole_groups: true``), so every estimator sees each group entire.

With ``algo.loss.kl_in: reward`` and ``kl_coef`` > 0 it first takes the KL penalty from each
reward (:func:`streamrl.algos.grpo.kl_reward_penalty`), reading ``ref_logprobs`` and
``rollout_logprobs``; the trainer then adds no KL to the loss.

A per-token estimator (one that names ``values``, e.g. ``gae``: PPO) also reads the critic's
``values`` column (per-token tensors, pipelines/ppo.yaml's value stage) and writes per-token
``advantage`` tensors and the critic's targets, ``returns``. The KL-in-reward penalty stays
sequence-level: it comes off the reward, which GAE places on the last response token."""

from __future__ import annotations

from typing import Any

import torch

from streamrl.algos.advantages import ADVANTAGES, takes_values
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
        if takes_values(ADVANTAGES.resolve(cfg.algo.advantage)):
            writes_values = any("values" in s.writes for s in pipeline.stages)
            if not writes_values:
                raise ConfigError(f"{pipeline.where}: algo.advantage: {cfg.algo.advantage} needs a critic (per-token "
                                  "values) but no stage writes 'values'; use pipelines/ppo.yaml (value and critic "
                                  "stages), or a group estimator such as grpo")
            missing = [c for c in ("values",) if c not in spec.reads] + [c for c in ("returns",)
                                                                            if c not in spec.writes]
            if missing:
                raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: algo.advantage: {cfg.algo.advantage} reads "
                                  "'values' and writes 'advantage' and 'returns' (the critic's targets); add "
                                  f"{missing} to its reads / writes, as pipelines/ppo.yaml does")
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
        self.per_token = takes_values(self.estimator)

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
        group_ids = torch.tensor(batch.groups)
        if self.per_token:
            return self._per_token(rewards, group_ids, batch.columns["values"])
        adv = self.estimator(rewards=rewards, group_ids=group_ids, **self.options)
        if not isinstance(adv, torch.Tensor) or adv.shape != rewards.shape or not bool(torch.isfinite(adv).all()):
            got = f"shape {tuple(adv.shape)}" if isinstance(adv, torch.Tensor) else type(adv).__name__
            raise ValueError(f"advantage estimator {self.ctx.config.algo.advantage!r} returned {got}; it must return "
                             f"a finite tensor of one advantage per sample, shape {tuple(rewards.shape)}")
        return {"advantage": adv.tolist()}

    def _per_token(self, rewards: torch.Tensor, group_ids: torch.Tensor, values: list[torch.Tensor]
                   ) -> dict[str, list[Any]]:
        """A per-token estimator: (advantages, returns), one tensor [R_i] each per sample."""
        out = self.estimator(rewards=rewards, group_ids=group_ids, values=values, **self.options)
        name = self.ctx.config.algo.advantage
        if not (isinstance(out, tuple) and len(out) == 2 and all(len(o) == len(values) for o in out)):
            raise ValueError(f"advantage estimator {name!r} takes values, so it must return (advantages, returns), "
                             f"two lists of {len(values)} per-token tensors")
        for column, tensors in zip(("advantages", "returns"), out, strict=True):
            for i, (t, v) in enumerate(zip(tensors, values, strict=True)):
                if not isinstance(t, torch.Tensor) or t.shape != v.shape or not bool(torch.isfinite(t).all()):
                    raise ValueError(f"advantage estimator {name!r}: {column}[{i}] must be a finite tensor shaped "
                                     f"like its values {tuple(v.shape)}")
        advantages, returns = out
        adv = torch.cat(list(advantages)) if advantages else torch.zeros(0)
        if adv.numel():
            self.ctx.report_metrics({"advantage_abs_mean": float(adv.abs().mean()),
                                     "value_mean": float(torch.cat(list(values)).mean())})
        return {"advantage": [a.to(torch.float32) for a in advantages],
                "returns": [r.to(torch.float32) for r in returns]}

    async def close(self) -> None:
        pass

