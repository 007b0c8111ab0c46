"""Colocated generate + train: R processes each host train worker k and generate worker k.

Pipeline (``pipelines/grpo_colocated.yaml``): ``placement: colocated``, the train stage with
``workers: R`` and the generate stage with ``workers: R`` and ``colocate_with: train``. Each of
the R processes:

- joins a gloo (nccl on CUDA) world of R ranks through a FileStore in
  ``<run_dir>/rendezvous/<train stage>`` (rank = worker index);
- trains in the sharded layout (:class:`~streamrl.reshard.ShardedTrainEngine`: parameters,
  gradients and AdamW moments sharded over the R ranks, gradients reduce-scattered);
- after every optimizer step reshards the new weights into a full inference copy (T = 1: every
  rank generates with the whole model) bucket by bucket, swaps its training state out to the
  host and publishes the version (:class:`~streamrl.reshard.ColocatedPolicy`);
- generates with those inference weights *in place* (the rollout model's parameters are bound
  to zero-copy views of them for the length of one batch), so the process holds one copy of
  the weights for each phase, not one per stage.

Phases alternate on each rank: the train stage claims its share of a step (``batch_size / R``
samples) while the inference weights are still in place, so generation on this rank keeps
feeding the other ranks; an all-reduce of the step's token counts (which every rank needs for
the global normalisation anyway) tells each rank that all R shares were claimed, i.e. all the
generation this step waits for is done. Only then does it swap training back in
(``to_training``) and run its forward/backward passes. Releasing the weights before that could
deadlock: a rank's generator may hold prompts another rank's share still needs.

Only rank 0 serves version numbers to the source (``PolicyPublisher`` with no weights: in this
placement weights never travel through it), reports step metrics and writes the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import anyio

from streamrl.reshard import (
    ColocatedPolicy,
    RankGroups,
    ReshardConfig,
    Resharder,
    Topology,
    TrainLayout,
    local_hf_views,
)
from streamrl.runtime.pipeline import ColocatedTrainOptions, ReshardGenerateOptions, colocated_tensor_parallel
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.common import build_policy
from streamrl.stages.sharded_grpo import (
    GrpoLossFn,
    ShardedGrpoTrainer,
    ViewRollout,
    grpo_micro_batch,
    weights_receiver,
)
from streamrl.stages.tp_generation import STOP_WAIT_S, TensorParallelGeneration

__all__ = ["ColocatedGenerateStage", "ColocatedRank", "ColocatedSetupError", "ColocatedTrainStage",
           "GrpoLossFn", "grpo_micro_batch"]

SHARED_KEY = "colocated_rank"


class ColocatedSetupError(RuntimeError):
    """The colocated train stage of this process could not set up its policy (see its own error)."""


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


def colocated_rank(ctx: StageContext) -> ColocatedRank:
    rank = ctx.shared.get(SHARED_KEY)
    if rank is None:
        rank = ctx.shared[SHARED_KEY] = ColocatedRank()
    return rank


class ColocatedTrainStage(ShardedGrpoTrainer):
    """Sharded GRPO training over the R colocated ranks; hands each version to generation via the reshard.

    Options: ``bucket_bytes`` (reshard bucket cap, bytes, default 64 MiB), ``swap`` (move the
    training state to host memory while generating, default true), ``backend`` (default gloo on
    CPU, nccl on CUDA, hccl on NPU), ``collective_timeout_s`` (how long a rank waits in a collective for the
    others, default 600: covers a whole generation phase).
    """

    placement = "colocated"
    Options = ColocatedTrainOptions

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        shared = colocated_rank(ctx)
        try:
            await super().setup(ctx)
        except BaseException as exc:
            shared.error = f"{type(exc).__name__}: {exc}"
            shared.ready.set()
            raise
        shared.policy, shared.groups = self.policy, self.groups
        shared.ready.set()

    def _world_size(self) -> int:
        return self.R

    def _topology(self) -> Topology:
        self.T = colocated_tensor_parallel(weights_receiver(self.ctx), self.ctx.config.algo.max_staleness)
        return Topology.colocated(TrainLayout(self.R), self.T)

    async def _start_weights(self) -> None:
        resharder = Resharder(self.spec, self.groups, config=ReshardConfig(bucket_bytes=self.bucket_bytes),
                              shard_dtype=self.engine.dtype, inference_dtype=self.engine.dtype,
                              device=self.device)
        # T > 1: the slices stay through the training phase (see streamrl/stages/tp_generation.py)
        assert isinstance(self.options, ColocatedTrainOptions)
        self.policy = ColocatedPolicy(self.engine, resharder, swap_training_state=self.options.swap,
                                      release_weights_in_training=self.T == 1)
        await self.policy.to_inference(0)

    async def _before_train(self) -> dict[str, float]:
        # Only now is all generation this step waits for done (see the module doc): swap training in.
        t0 = time.perf_counter()
        swap_in = await self.policy.to_training()
        return {"swap_in_ms": (time.perf_counter() - t0) * 1e3 if swap_in is not None else 0.0}

    async def _accumulate(self, batch: Batch) -> None:
        # The ranks share devices with generation: the step's micro-batches wait for the swap-in.
        self.pending.append(dict(batch.columns))

    def _reset(self) -> None:
        super()._reset()
        self.pending: list[dict[str, Any]] = []  # this rank's share, trained on once all shares are claimed

    def _train(self, scale: float) -> tuple[dict[str, float], float]:
        for cols in self.pending:
            self.engine.forward_backward(grpo_micro_batch(cols), self.loss_fn, loss_scale=scale)
        stats = self.engine.optimizer_step()
        return self.loss_fn.sums, stats.grad_norm

    async def _hand_over(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        report = await self.policy.to_inference(version)
        swap_out = self.policy.last_swap
        return {
            "reshard_ms": report.total_s * 1e3,
            "swap_out_ms": swap_out.seconds * 1e3 if swap_out is not None else 0.0,
            "to_inference_ms": (time.perf_counter() - t0) * 1e3,
            "reshard_peak_extra_bytes": float(report.peak_extra_bytes),
            "reshard_largest_bucket_bytes": float(report.largest_bucket_bytes),
            "reshard_bucket_bytes_limit": float(report.bucket_bytes_limit or 0),
            "reshard_buckets": float(len(report.buckets)),
            "reshard_received_bytes": float(report.received_bytes),
            "swap_bytes": float(swap_out.bytes) if swap_out is not None else 0.0,
        }

    async def _on_stop(self) -> None:
        if self.T > 1:  # no rank holds the whole model: gather it from the training shards (collective)
            await self.policy.to_training()
            await super()._on_stop()
        # T = 1: close() writes the checkpoint from rank 0's inference copy, no collective needed

    async def close(self) -> None:
        policy = getattr(self, "policy", None)
        if (self.ctx.config.output.checkpoint and policy is not None and self.rank == 0 and self.version > 0
                and not self.checkpoint_saved and self.T == 1 and policy.phase == "inference"):
            # T = 1: rank 0's inference weights are the whole newest version, under HF names as views
            views = local_hf_views(policy.weights.tensors, policy.resharder.plan, 0)
            await self.ctx.run_sync(self._save_checkpoint, views)
        shared = colocated_rank(self.ctx)
        if shared.ready.is_set() and shared.policy is not None:
            with anyio.move_on_after(STOP_WAIT_S + 5):
                await shared.generation_closed.wait()
        await super().close()


class ColocatedGenerateStage:
    """Samples with the inference weights of the colocated train stage in this process.

    Option ``tensor_parallel: T`` (default 1: every rank generates with a whole copy): every T
    consecutive ranks form one inference replica holding one slice each; its TP rank 0 claims and
    the others follow it (see :mod:`streamrl.stages.tp_generation`).
    """

    placement = "colocated"
    Options = ReshardGenerateOptions

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.tp: TensorParallelGeneration | None = None
        self.follows = False
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
        model, tokenizer = build_policy(ctx.config, str(shared.policy.engine.device))
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
            colocated_rank(self.ctx).generation_closed.set()
