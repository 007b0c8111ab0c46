"""The generate stage (placement ``separate``): sample completions with the stage's rollout engine.

``options.engine``: ``builtin`` (the torch engine, default) or ``vllm`` (``options.vllm`` holds its
settings; :mod:`streamrl.engines.vllm_engine`). Both sit behind
:class:`~streamrl.engines.rollout_engine.RolloutEngine`; this stage does not know which it drives.

Before each micro-batch it makes sure it holds a policy version new enough for the samples'
step (step - max_staleness), fetching the newest published weights when there are newer ones and
installing them in the engine in place. Writes ``response_ids`` and ``rollout_logprobs`` and tags
each sample with the version used. Reports ``engine_startup_s`` once and ``weight_install_s`` (the
last install) as stage metrics.

Sampling is reproducible per micro-batch when the stage reads ``sample_key``: each micro-batch's
generator is seeded from the run's seed and its first sample's key, so a sample drawn again after
a restart or a resume (same weights, same batch) gets the same tokens, on whichever worker.
Without ``sample_key`` one generator per worker runs through the whole run.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from streamrl.engines.options import GenerateOptions, check_engine_available
from streamrl.metrics.trace import tracer
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.common import build_policy, open_rollout_engine, seed_for_batch, worker_generator
from streamrl.stages.view_rollout import generation_output, version_needed


class GenerateStage:
    Options = GenerateOptions  # checked when the pipeline loads
    generates = True  # the pre-run checks fit prompt + completion to the model (streamrl.runtime.prerun)
    uses_model_and_task = True
    restartable = True  # no state beyond the weights it fetches again: the launcher may restart a dead worker

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        """A missing engine package is refused before any worker starts."""
        check_engine_available(msgspec.convert(options, GenerateOptions).engine)

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        opts = msgspec.convert(ctx.options, GenerateOptions)
        model, tok = build_policy(ctx.config, ctx.device)
        self.engine = await ctx.run_sync(open_rollout_engine, ctx, opts.engine, opts.vllm, model, tok, ctx.device)
        del model  # the vLLM engine holds its own copy; the built-in one keeps a reference
        ctx.log.info("%s[%d]: %s rollout engine ready in %.1f s", ctx.spec.name, ctx.worker, self.engine.name,
                     self.engine.startup_s)
        ctx.report_metrics({"engine_startup_s": self.engine.startup_s})
        self.version = 0
        self.generator = worker_generator(ctx, self.engine.generator_device)

    async def process(self, batch: Batch) -> Output:
        a = self.ctx.config.algo
        version, state = await self.ctx.policy.fetch(self.version, version_needed(batch, a.max_staleness))
        if state is not None:
            started = time.perf_counter()
            await self.ctx.run_sync(self.engine.load_weights, state.items())
            self.version = version
            ended = time.perf_counter()
            self.ctx.report_metrics({"weight_install_s": ended - started})
            tracer().complete("install weights", "policy", started, ended, "policy", version=version)
            tracer().counter("policy version", version)
        seed_for_batch(self.generator, self.ctx.config.seed, batch)
        prompts = batch.columns["prompt_ids"]
        gens = await self.ctx.run_sync(
            self.engine.generate, prompts, max_new_tokens=a.max_new_tokens,
            temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, generator=self.generator,
        )
        return generation_output(prompts, gens, self.version)

    async def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            await self.ctx.run_sync(engine.close)
