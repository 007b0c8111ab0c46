"""The generate stage: sample completions with the built-in torch rollout engine.

Before each micro-batch it makes sure it holds a policy version new enough for the samples'
step (step - max_staleness), fetching the newest published weights when there are newer ones.
Writes ``response_ids`` and ``rollout_logprobs`` and tags each sample with the version used.

Sampling is reproducible per micro-batch when the stage reads ``sample_key``: each micro-batch's
generator is seeded from the run's seed and its first sample's key, so a sample drawn again after
a restart or a resume (same weights, same batch) gets the same tokens, on whichever worker.
Without ``sample_key`` one generator per worker runs through the whole run.
"""

from __future__ import annotations

import torch

from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.runtime.pipeline import NoOptions
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.common import build_policy, seed_for_batch


class GenerateStage:
    Options = NoOptions  # it takes no options; checked when the pipeline loads
    restartable = True  # no state beyond the weights it fetches again: the launcher may restart a dead worker

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        model, tok = build_policy(ctx.config, ctx.device)
        model.eval()
        self.engine = TorchRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, ctx.device)
        self.version = 0
        seed = ctx.config.seed * 1000 + 17 * ctx.worker + 1
        self.generator = torch.Generator(device=self.engine.device).manual_seed(seed)
        self.weight_s = 0.0

    async def process(self, batch: Batch) -> Output:
        a = self.ctx.config.algo
        need = max(int(s) for s in batch.columns["step"]) - a.max_staleness if "step" in batch.columns else 0
        version, state = await self.ctx.policy.fetch(self.version, need)
        if state is not None:
            await self.ctx.run_sync(self.engine.load_state_dict, state)
            self.version = version
        seed_for_batch(self.generator, self.ctx.config.seed, batch)
        gens = await self.ctx.run_sync(
            self.engine.generate, batch.columns["prompt_ids"], max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, generator=self.generator,
        )
        lengths = [int(p.numel()) + int(g.response_ids.numel()) for p, g in zip(batch.columns["prompt_ids"], gens,
                                                                                 strict=True)]
        return Output(
            {"response_ids": [g.response_ids for g in gens], "rollout_logprobs": [g.logprobs for g in gens]},
            versions=[self.version] * len(gens), lengths=lengths,
        )

    async def close(self) -> None:
        pass
