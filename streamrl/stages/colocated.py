"""Colocated generate + train: R processes each host train worker k and generate worker k.

Pipeline (``pipelines/grpo_colocated.yaml``): ``placement: colocated``, the train stage with
``workers: R`` and the generate stage with ``workers: R`` and ``colocate_with: train``. Each of
the R processes:

- joins a gloo (nccl on CUDA) world of R ranks through a FileStore in
  ``<run_dir>/rendezvous/<train stage>`` (rank = worker index);
- trains with torch FSDP2 (the one train stage, :mod:`streamrl.stages.train`: parameters,
  gradients and AdamW moments sharded over the R ranks);
- after every optimizer step reshards the new weights into a full inference copy (T = 1: every
  rank generates with the whole model) bucket by bucket, swaps its training state out to the
  host and publishes the version (:class:`~streamrl.reshard.ColocatedPolicy`);
- generates with those inference weights *in place* (the rollout model's parameters are bound
  to zero-copy views of them for the length of one batch), so the process holds one copy of
  the weights for each phase, not one per stage.

With ``options.engine: vllm`` (T = 1) the process instead runs a vLLM engine (its engine core in a
child process: this process's default torch.distributed group is the train world, and vLLM's
worker makes its own), and each version's gathered buckets stream into its ``load_weights`` as
they complete; vLLM holds the only inference copy. It sleeps through the training phase where the
platform supports it (accelerators); on CPU vLLM refuses sleep mode, so there the swap covers
the trainer only.

Phases alternate on each rank: the train stage claims its share of a step (``batch_size / R``
samples) while the inference weights are still in place, so generation on this rank keeps
feeding the other ranks; an all-reduce of the step's token counts (which every rank needs for
the global normalisation anyway) tells each rank that all R shares were claimed, i.e. all the
generation this step waits for is done. Only then does it swap training back in
(``to_training``) and run its forward/backward passes. Releasing the weights before that could
deadlock: a rank's generator may hold prompts another rank's share still needs.

The train side of this is :class:`streamrl.stages.handover.ColocatedHandOver`; this module holds
the generate stage and what the two stages of one process share (:class:`ColocatedRank`).
Only rank 0 serves version numbers to the source (``PolicyPublisher`` with no weights: in this
placement weights never travel through it) and reports step metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
import msgspec
from msgspec import Meta

from streamrl.engines.options import EngineName, VllmOptions, check_engine_available
from streamrl.reshard import ColocatedPolicy, RankGroups
from streamrl.runtime.pipeline import StageSpec
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.common import build_policy, open_rollout_engine
from streamrl.stages.tp_generation import STOP_WAIT_S, TensorParallelGeneration
from streamrl.stages.view_rollout import EngineRollout, ViewRollout

__all__ = ["STOP_WAIT_S", "ColocatedGenerateStage", "ColocatedRank", "ColocatedSetupError", "colocated_rank",
           "uses_vllm"]

SHARED_KEY = "colocated_rank"


class ColocatedSetupError(RuntimeError):
    """The colocated train stage of this process could not set up its policy (see its own error)."""


class ReshardGenerateOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the generate stage of placements colocated and disaggregated
    (streamrl.stages.colocated:ColocatedGenerateStage, streamrl.stages.disaggregated:DisaggregatedGenerateStage)."""

    tensor_parallel: Annotated[int, Meta(description=(
        "T: workers per inference replica (the built-in engine's own tensor parallelism); the train stage "
        "reads it too"))] = 1
    engine: Annotated[EngineName, Meta(description=(
        "Disaggregated only: builtin, or vllm fed by the reshard's bucket stream (T = 1; vLLM's own tensor "
        "parallelism is vllm.tensor_parallel_size). Colocated generation runs the built-in engine"))] = "builtin"
    vllm: Annotated[VllmOptions, Meta(description="vLLM engine settings (engine: vllm)")] = VllmOptions()


@dataclass
class ColocatedRank:
    """What the stages of one colocated process share (``ctx.shared[SHARED_KEY]``)."""

    ready: anyio.Event = field(default_factory=anyio.Event)
    policy: ColocatedPolicy | None = None
    groups: RankGroups | None = None
    error: str | None = None
    # set by the generate stage's close: the train stage destroys the process group only after it
    # (a TP generation group computes over it until its STOP)
    generation_closed: anyio.Event = field(default_factory=anyio.Event)
    # engine: vllm: set once the generate stage has attached its engine to the policy
    engine_attached: anyio.Event = field(default_factory=anyio.Event)


def uses_vllm(generate: StageSpec) -> bool:
    """Whether the colocated generate stage runs vLLM (its options' ``engine``)."""
    return msgspec.convert(generate.options, ReshardGenerateOptions).engine == "vllm"


def colocated_rank(ctx: StageContext) -> ColocatedRank:
    rank = ctx.shared.get(SHARED_KEY)
    if rank is None:
        rank = ctx.shared[SHARED_KEY] = ColocatedRank()
    return rank


class ColocatedGenerateStage:
    """Samples with the inference weights of the colocated train stage in this process.

    Option ``tensor_parallel: T`` (default 1: every rank generates with a whole copy): every T
    consecutive ranks form one inference replica holding one slice each; its TP rank 0 claims and
    the others follow it (see :mod:`streamrl.stages.tp_generation`).
    """

    placement = "colocated"
    Options = ReshardGenerateOptions
    generates = True  # the pre-run checks fit prompt + completion to the model (streamrl.runtime.prerun)
    uses_model_and_task = True

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        opts = msgspec.convert(options, ReshardGenerateOptions)
        check_engine_available(opts.engine)
        if opts.engine == "vllm" and opts.tensor_parallel != 1:
            raise ValueError(f"engine: vllm takes whole weights (tensor_parallel: 1); tensor_parallel: "
                             f"{opts.tensor_parallel} runs on the built-in engine only (engine: builtin), or use "
                             "vLLM's own options.vllm.tensor_parallel_size on accelerators")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.tp: TensorParallelGeneration | None = None
        self.follows = False
        self.engine = None  # before anything can fail: close() runs after a failed setup too
        if ctx.spec.colocate_with is None:
            raise ValueError(f"stage {ctx.spec.name!r} needs `colocate_with: <the colocated train stage>`")
        shared = colocated_rank(ctx)
        with anyio.fail_after(ctx.config.resources.start_timeout_s):
            await shared.ready.wait()
        if shared.policy is None or shared.groups is None:
            raise ColocatedSetupError(f"the colocated train stage {ctx.spec.colocate_with!r} of this process failed "
                                      f"to set up: {shared.error}")
        self.policy = shared.policy
        # on the train stage's device: this process is one rank of the reshard world
        device = str(shared.policy.engine.device)
        model, tokenizer = build_policy(ctx.config, device)
        if shared.policy.stream_to_engine:
            opts = msgspec.convert(ctx.options, ReshardGenerateOptions)
            # the engine core in its own process: this one's default process group is the train world
            self.engine = await ctx.run_sync(open_rollout_engine, ctx, "vllm", opts.vllm, model, tokenizer, device,
                                             separate_process=True, sleep_mode=True)
            del model
            ctx.log.info("%s[%d]: vllm rollout engine ready in %.1f s", ctx.spec.name, ctx.worker,
                         self.engine.startup_s)
            ctx.report_metrics({"engine_startup_s": self.engine.startup_s})
            shared.policy.attach_engine(self.engine)  # type: ignore[arg-type]
            shared.engine_attached.set()
            self.rollout = EngineRollout(ctx, self.engine)
            return
        if shared.policy.resharder.topology.inference.tensor_parallel == 1:
            self.rollout = ViewRollout(ctx, model, tokenizer, shared.policy.resharder.plan, 0)
            return
        self.tp = TensorParallelGeneration(ctx, shared.groups, shared.policy.weights, model, tokenizer)
        self.follows = not self.tp.leader

    async def process(self, batch: Batch) -> Output:
        if self.tp is not None:
            return await self.tp.process(batch)
        # waits through the training phase (weights released) until a new enough version is resharded in
        return await self.rollout.process(self.policy.weights, batch)

    async def follow(self) -> None:
        assert self.tp is not None
        await self.tp.follow()

    async def close(self) -> None:
        try:
            if self.tp is not None:
                if self.tp.leader:
                    await self.tp.stop()
                else:
                    await self.tp.follow_until_stopped()
        finally:
            if self.engine is not None:
                # the train stage may be installing a version into it: let that finish first
                with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_WAIT_S):
                    await self.policy.detach_engine()
                self.engine.close()
            colocated_rank(self.ctx).generation_closed.set()
