"""The generate stage: sample completions of the batch's prompts with the live policy, in every placement.

``options.engine``: ``builtin`` (the torch engine, default) or ``vllm`` (``options.vllm`` holds its
settings; :mod:`streamrl.engines.vllm_engine`). Where the policy's versions come from is the
stage's :class:`~streamrl.stages.weight_source.WeightSource`, chosen by the pipeline's links:

- no link (placement ``separate``): the stage's own engine, fed by the train stage's publisher;
- ``colocate_with: train`` (placement ``colocated``): the inference weights the train stage of
  the same process reshards into after every step;
- ``weights_from: train`` (placement ``disaggregated``): the versions the train group sends it.

Each micro-batch is generated inside ``source.hold(need)``, with a version no older than the
samples' step - ``algo.max_staleness`` (waiting for one), and each sample is tagged with it.
Writes ``response_ids`` and ``rollout_logprobs``. ``options.tensor_parallel: T > 1`` (reshard
placements) makes every T workers one inference replica: its rank 0 claims and generates, the
others follow it (:mod:`streamrl.stages.tp_generation`).

Sampling is reproducible per micro-batch when the stage reads ``sample_key``: each micro-batch's
generator is seeded from the run's seed and its first sample's key, so a sample drawn again after
a restart or a resume (same weights, same batch) gets the same tokens, on whichever worker.
Without ``sample_key`` one generator per worker runs through the whole run.
"""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
from torch import Tensor

from streamrl.config import ConfigError, RunConfig
from streamrl.engines.options import GenerateOptions, check_engine_available
from streamrl.engines.rollout import Generation
from streamrl.runtime.pipeline import PipelineSpec, StageSpec
from streamrl.runtime.stage import Batch, GiveBack, Output, StageContext
from streamrl.stages.common import seed_for_batch, source_runs_ahead, worker_generator
from streamrl.stages.weight_source import (
    WeightSource,
    check_weight_links,
    fetches_weights,
    version_needed,
    weight_source_for,
)

GENERATED_COLUMNS = ("response_ids", "rollout_logprobs")  # what process() returns, per sample


class GenerateStage:
    Options = GenerateOptions  # checked when the pipeline loads
    generates = True  # the pre-run checks fit prompt + completion to the model (streamrl.runtime.prerun)
    uses_model_and_task = True

    restartable = staticmethod(fetches_weights)  # placement separate only: see fetches_weights
    fetches_policy = staticmethod(fetches_weights)  # the trainer's published weights (placement separate)

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        opts = msgspec.convert(options, GenerateOptions)
        check_engine_available(opts.engine)  # a missing engine package is refused before any worker starts
        if opts.engine == "vllm" and opts.tensor_parallel != 1:
            raise ValueError(f"engine: vllm takes whole weights (tensor_parallel: 1); tensor_parallel: "
                             f"{opts.tensor_parallel} is the built-in engine's own TP. vLLM's tensor parallelism is "
                             "vllm.tensor_parallel_size (accelerators)")

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        at = f"{pipeline.where}: stage {spec.name!r}"
        if "prompt_ids" not in spec.reads:
            raise ConfigError(f"{at} reads {spec.reads}: the generate stage samples from the prompts' tokens; add "
                              "prompt_ids to its reads")
        if sorted(spec.writes) != sorted(GENERATED_COLUMNS):
            raise ConfigError(f"{at} writes {spec.writes}: the generate stage writes {list(GENERATED_COLUMNS)}, "
                              "no more and no less")
        check_weight_links(spec, pipeline)
        T = msgspec.convert(spec.options, GenerateOptions).tensor_parallel
        if T > 1 and fetches_weights(spec):
            raise ConfigError(f"{at} options.tensor_parallel={T} splits the model over "
                              "the workers of a reshard placement (colocate_with or weights_from a train stage); in "
                              "placement separate every worker holds the whole model: use workers: N instead")

    @staticmethod
    def claims_one_step(spec: StageSpec) -> bool:
        """Placement separate (the stage's own engine, fed by the publisher): each claim takes one
        step's prompts (without dynamic sampling), so the source may put a step's prompts before
        their version is out (:mod:`streamrl.stages.source`)."""
        return fetches_weights(spec)

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.weights: WeightSource = weight_source_for(ctx, msgspec.convert(ctx.options, GenerateOptions))
        await self.weights.setup()
        # one step's prompts a claim where the source puts them ahead of their version
        self.claims_one_reserve = source_runs_ahead(ctx.config, ctx.pipeline)
        self.follows = self.weights.follows  # a TP follower computes what its rank 0 claims
        self.generator = worker_generator(ctx, self.weights.generator_device)
        ctx.log.info("%s[%d]: %s rollout engine ready", ctx.spec.name, ctx.worker, self.weights.engine_name)

    async def wait_ready_for(self, batch: Batch) -> None:
        """Before the batch's busy time: its policy version installed (the prompts come before it is
        out: synchronous, while the step before trains). Where it has not come within a lease TTL
        and a second, the batch goes back to the dock (:class:`GiveBack`): the version may wait on
        an older step whose samples a worker that died held, back in the dock by then and ahead
        of this batch (a restarted worker can claim a newer step before they come back)."""
        need = version_needed(batch, self.ctx.config.algo.max_staleness)
        give_back_s = self.ctx.config.resources.dock.lease_ttl_s + 1.0
        with anyio.move_on_after(give_back_s):
            await self.weights.wait_installed(need)
            return
        raise GiveBack(f"policy version {need} not installed within {give_back_s:.0f} s")

    async def process(self, batch: Batch) -> Output:
        a = self.ctx.config.algo
        prompts = batch.columns["prompt_ids"]
        seed_for_batch(self.generator, self.ctx.config.seed, batch)
        async with self.weights.hold(version_needed(batch, a.max_staleness)) as rollout:
            gens = await self.ctx.run_sync(
                rollout.generate, prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                top_p=a.top_p, top_k=a.top_k, generator=self.generator)
        return generation_output(prompts, gens, rollout.version)

    async def follow(self) -> None:
        await self.weights.follow()

    async def close(self) -> None:
        weights = getattr(self, "weights", None)
        if weights is not None:  # close() runs after a failed setup too
            await weights.close()


def generation_output(prompts: list[Tensor], gens: list[Generation], version: int) -> Output:
    """A generate stage's columns, versions and lengths for ``gens``."""
    lengths = [int(p.numel()) + int(g.response_ids.numel()) for p, g in zip(prompts, gens, strict=True)]
    return Output(
        {"response_ids": [g.response_ids for g in gens], "rollout_logprobs": [g.logprobs for g in gens]},
        versions=[version] * len(gens), lengths=lengths,
    )
