"""Generation on inference weights the generate stage does not own (both reshard placements).

:class:`ViewRollout` binds a rollout model's parameters, for the length of one call, to zero-copy
views of inference weights held under a lease (:class:`~streamrl.reshard.InferenceWeights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from streamrl.engines.rollout import Generation, TorchRolloutEngine
from streamrl.engines.rollout_engine import RolloutEngine
from streamrl.reshard import InferencePlan, InferenceWeights, local_hf_views
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.common import seed_for_batch, worker_generator

if TYPE_CHECKING:  # transformers' model classes take seconds to import; the launcher imports the stages
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class ViewRollout:
    """A rollout engine whose model computes on inference weights it does not own.

    The model's parameters are emptied at construction; each ``generate`` binds them to zero-copy
    views of one inference rank's weights (held by the caller under a lease) and unbinds them
    before returning, so released weights are never kept alive through the module.
    """

    def __init__(self, ctx: StageContext, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 plan: InferencePlan, inference_rank: int = 0) -> None:
        model.eval()
        self.ctx, self.plan, self.inference_rank = ctx, plan, inference_rank
        self.params = dict(model.named_parameters())
        device = next(iter(self.params.values())).device  # the caller built it on this rank's device
        for p in self.params.values():  # weights come from the reshard: keep no copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        missing = set(self.params) - {p.source for p in plan.pieces[inference_rank]}
        if missing:
            raise ValueError(f"the inference layout lacks parameters {sorted(missing)[:3]} of the rollout model")
        self.engine = TorchRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device)
        self.generator = worker_generator(ctx, self.engine.device)

    def generate(self, tensors: Mapping[str, Tensor], prompts: list[Tensor]) -> list[Generation]:
        views = local_hf_views(tensors, self.plan, self.inference_rank)
        a = self.ctx.config.algo
        try:
            for name, p in self.params.items():  # zero-copy: the model computes on the inference weights
                p.data = views[name]
            return self.engine.generate(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                        top_p=a.top_p, top_k=a.top_k, generator=self.generator)
        finally:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    async def process(self, weights: InferenceWeights, batch: Batch) -> Output:
        """A generate stage's ``process``: completions of the batch's prompts under a shared lease on
        a version new enough for them (waits for it)."""
        need = version_needed(batch, self.ctx.config.algo.max_staleness)
        prompts = batch.columns["prompt_ids"]
        seed_for_batch(self.generator, self.ctx.config.seed, batch)
        async with weights.use(need) as tensors:
            version = weights.version
            assert version is not None
            gens = await self.ctx.run_sync(self.generate, tensors, prompts)
        return generation_output(prompts, gens, version)


class EngineRollout:
    """Generation on a rollout engine that holds its own weights (vLLM), installed by a
    :class:`~streamrl.reshard.WeightReceiver` as the reshard streams them; ``weights`` (no tensors)
    numbers the versions and keeps a generate call and an install apart."""

    def __init__(self, ctx: StageContext, engine: RolloutEngine) -> None:
        self.ctx, self.engine = ctx, engine
        self.generator = worker_generator(ctx, engine.generator_device)

    async def process(self, weights: InferenceWeights, batch: Batch) -> Output:
        a = self.ctx.config.algo
        prompts = batch.columns["prompt_ids"]
        seed_for_batch(self.generator, self.ctx.config.seed, batch)
        async with weights.use(version_needed(batch, a.max_staleness)):
            version = weights.version
            assert version is not None
            gens = await self.ctx.run_sync(self.engine.generate, prompts, max_new_tokens=a.max_new_tokens,
                                           temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                           generator=self.generator)
        return generation_output(prompts, gens, version)


def version_needed(batch: Batch, max_staleness: int) -> int:
    """The oldest policy version allowed to generate ``batch``: its newest prompt's step - max_staleness."""
    steps = batch.columns.get("step")
    return max(int(s) for s in steps) - max_staleness if steps else 0


def generation_output(prompts: list[Tensor], gens: list[Generation], version: int) -> Output:
    """A generate stage's columns, versions and lengths for ``gens``."""
    lengths = [int(p.numel()) + int(g.response_ids.numel()) for p, g in zip(prompts, gens, strict=True)]
    return Output(
        {"response_ids": [g.response_ids for g in gens], "rollout_logprobs": [g.logprobs for g in gens]},
        versions=[version] * len(gens), lengths=lengths,
    )
