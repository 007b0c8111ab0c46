"""The filter stage: DAPO's dynamic sampling. Drops every group whose rewards are all equal.

Such a group (all solved or all failed) has zero advantage under a group baseline, so it teaches
nothing and only dilutes the step. The stage claims whole groups after scoring and discards the
uniform ones from the run through the dock (no later stage gets them, docs/dock-protocol.md
§5.6). The source sees the dock's discard count and generates more prompts, so every optimizer
step still trains on ``prompts_per_step x group_size`` samples, all of informative groups
(:mod:`streamrl.stages.source`, ``algo.dynamic_sampling``).

It writes ``dropped_rewards``: the first sample it keeps in a micro-batch carries the rewards of
the samples it dropped since it last kept one (the others carry ``[]``). The train stage adds
them to its step's ``reward_mean`` (and counts them as ``dropped_samples``), so the reward a run
reports, and stops on with ``algo.stop_reward``, is the policy's over everything it generated,
not only over the groups it learned from. It reports ``kept_fraction`` (samples kept / judged,
since the start) as a stage metric.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from streamrl.config import ConfigError, RunConfig
from streamrl.runtime.pipeline import NoOptions, PipelineSpec, StageSpec
from streamrl.runtime.stage import Batch, Output, StageContext


def uniform_groups(rewards: list[float], groups: list[int]) -> set[int]:
    """The group ids whose rewards are all equal (a group of one included: it has no contrast)."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups, strict=True):
        by_group[g].append(r)
    return {g for g, rs in by_group.items() if max(rs) == min(rs)}


class FilterStage:
    Options = NoOptions  # it takes no options; checked when the pipeline loads
    restartable = True  # only its metrics carry over between micro-batches: the launcher may restart it
    discards = True  # drops samples from the run: the source generates more (streamrl.stages.source)

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        """Before anything starts (``validate_pipeline``): whole groups, and the source told to make up
        for what it drops."""
        at = f"{pipeline.where}: stage {spec.name!r}"
        if not spec.whole_groups:
            raise ConfigError(f"{at}: the filter judges a group by all its rewards; set whole_groups: true")
        if not cfg.algo.dynamic_sampling.enabled:
            raise ConfigError(f"{at}: the filter drops groups, so the source must generate more than one round of "
                              "prompts per step: set algo.dynamic_sampling.enabled: true (preset: dapo does)")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.carried: list[float] = []  # rewards dropped since the last kept sample
        self.judged = 0
        self.kept = 0

    async def process(self, batch: Batch) -> Output:
        rewards = [float(r) for r in batch.columns["reward"]]
        uniform = uniform_groups(rewards, batch.groups)
        discard = [g in uniform for g in batch.groups]
        self.carried.extend(r for r, drop in zip(rewards, discard, strict=True) if drop)
        dropped: list[Any] = []
        for drop in discard:
            if not drop and self.carried:
                dropped.append(self.carried)
                self.carried = []
            else:
                dropped.append([])
        self.judged += len(rewards)
        self.kept += discard.count(False)
        self.ctx.report_metrics({"kept_fraction": self.kept / self.judged})
        return Output({"dropped_rewards": dropped}, discard=discard)

    async def close(self) -> None:
        pass
