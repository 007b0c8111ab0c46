"""Disaggregated generate + train: a train group of R processes sends each policy version, bucket by
bucket, to G separate generation workers.

Pipeline (``pipelines/grpo_disaggregated.yaml``): ``placement: disaggregated``, the train stage with
``workers: R`` and the generate stage with ``workers: G`` and ``weights_from: train``. All R + G
processes join one torch.distributed world through a FileStore in
``<run_dir>/rendezvous/<train stage>``: train worker k is world rank k, generate worker j is world
rank R + j (``Topology.disaggregated(TrainLayout(R), T=1, replicas=G)``: each generation worker holds
a whole inference copy, fed by train rank j mod R).

Train side, per step (the one train stage with :class:`streamrl.stages.handover.DisaggregatedHandOver`):

- each micro-batch of this rank's share is trained on *as it arrives* (FSDP2 forward/backward into
  the sharded gradients, unnormalised): the train processes hold no generation, so nothing makes
  them wait for the whole step; this overlaps training with the generation of the step's later
  micro-batches;
- once every rank has its share, ``engine.step()`` divides the summed gradients by the step's
  count summed over the ranks and AdamW steps on the shards;
- ``WeightSender.send(v)``: the train group all-gathers bucket by bucket (peak extra memory: one
  bucket) and each rank sends its generation workers their slices, point to point;
- rank 0 publishes the version number for the source's staleness gate (no weights: they never
  travel through the dock or the ``PolicyPublisher`` in this placement).

Generation side (:class:`DisaggregatedGenerateStage`): a background task receives versions
(``WeightReceiver``) into versioned :class:`~streamrl.reshard.InferenceWeights`; ``process`` holds a
shared lease on a version new enough for the batch's prompts and generates on zero-copy views of it.
A new version is installed under the exclusive side of the lease, so never under a running forward
pass: with ``max_staleness >= 1`` the sender may wait for the generation batch in flight.

Shutdown: the train stage's ``close`` sends every generation worker the close header; a generation
worker's ``close`` waits for it (``WeightReceiver.wait_closed``) before it destroys the process group,
so no receive is left blocked in gloo. If the trainer died instead, the generation worker skips the
destroy and exits (the header wait runs in a daemon thread).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from streamrl.engines.options import check_engine_available
from streamrl.engines.rollout_engine import RolloutEngine
from streamrl.reshard import ModelShardingSpec, ReshardConfig, Resharder, WeightReceiver
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.colocated import ReshardGenerateOptions
from streamrl.stages.common import build_policy, open_rollout_engine
from streamrl.stages.handover import disaggregated_topology
from streamrl.stages.tp_generation import TensorParallelGeneration
from streamrl.stages.train import TrainOptions
from streamrl.stages.view_rollout import EngineRollout, ViewRollout
from streamrl.stages.world import default_backend, join_world, rank_device

log = logging.getLogger("streamrl.stage.disaggregated")

CLOSE_WAIT_S = 10.0  # how long a train rank tries to deliver its close header at shutdown


class DisaggregatedGenerateStage:
    """Samples with the newest policy version received from the train group (``weights_from``).

    Option ``tensor_parallel: T`` (default 1): every T consecutive workers form one inference replica
    holding one slice each; its TP rank 0 claims and the others follow it (see
    :mod:`streamrl.stages.tp_generation`).
    """

    placement = "disaggregated"
    Options = ReshardGenerateOptions
    generates = True  # the pre-run checks fit prompt + completion to the model (streamrl.runtime.prerun)
    uses_model_and_task = True

    @staticmethod
    def check_options(options: dict[str, Any]) -> None:
        opts = msgspec.convert(options, ReshardGenerateOptions)
        if opts.engine == "vllm" and opts.tensor_parallel != 1:
            raise ValueError(f"engine: vllm takes whole weights (tensor_parallel: 1); tensor_parallel: "
                             f"{opts.tensor_parallel} is the built-in engine's own TP. vLLM's tensor parallelism is "
                             "vllm.tensor_parallel_size (accelerators)")
        check_engine_available(opts.engine)

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.receiver: WeightReceiver | None = None
        self.tp: TensorParallelGeneration | None = None
        self.follows = False
        if ctx.pipeline is None or ctx.spec.weights_from is None:
            raise ValueError(f"stage {ctx.spec.name!r} needs `weights_from: <the disaggregated train stage>`")
        train = ctx.pipeline.stage(ctx.spec.weights_from)
        R, G = train.workers, ctx.spec.workers
        topology = disaggregated_topology(R, ctx.spec)
        # the receiver's bucket plan must be the sender's: both read the train stage's options, through
        # the same type and defaults (checked when the pipeline loads)
        train_options = msgspec.convert(train.options, TrainOptions)
        bucket_bytes = train_options.bucket_bytes
        timeout_s = train_options.collective_timeout_s
        # A generate loop can end (its input is exhausted) while training still runs a few steps and
        # sends their versions; close() takes them for as long as the train group may take a step.
        self.close_wait_s = timeout_s
        backend = train_options.backend or default_backend(ctx.device)
        device = rank_device(ctx.device, R + ctx.worker, R + G, backend)  # generate worker j = world rank R + j
        model, tokenizer = build_policy(ctx.config, device)
        spec = ModelShardingSpec.from_model(model)
        opts = msgspec.convert(ctx.options, ReshardGenerateOptions)
        self.engine: RolloutEngine | None = None
        if opts.engine == "vllm":
            # vLLM keeps its own weights: the reshard's buckets stream into it, no inference copy here.
            # Its engine core runs in a process of its own: this process's default torch.distributed
            # group is the reshard world, and vLLM's worker would make its own.
            self.engine = await ctx.run_sync(open_rollout_engine, ctx, "vllm", opts.vllm, model, tokenizer,
                                             device, separate_process=True)
            ctx.log.info("%s[%d]: vllm rollout engine ready in %.1f s", ctx.spec.name, ctx.worker,
                         self.engine.startup_s)
            ctx.report_metrics({"engine_startup_s": self.engine.startup_s})
        groups = await join_world(ctx, train.name, R + ctx.worker, R + G, topology, backend=backend,
                                  timeout_s=timeout_s, device=device)
        # the sender's bucket plan is over its float32 master shards; the wire and these weights carry
        # the rollout's dtype (the cast happens in the sender's slice copy)
        resharder = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=bucket_bytes),
                              shard_dtype=torch.float32, inference_dtype=next(model.parameters()).dtype,
                              device=device)
        if self.engine is not None:
            self.receiver = WeightReceiver(resharder, engine=self.engine)
            self.rollout: ViewRollout | EngineRollout = EngineRollout(ctx, self.engine)
            ctx.tasks.start_soon(self.receiver.run)  # type: ignore[attr-defined]
            return
        self.receiver = WeightReceiver(resharder)
        if topology.inference.tensor_parallel == 1:
            self.rollout = ViewRollout(ctx, model, tokenizer, resharder.plan, 0)
            ctx.tasks.start_soon(self.receiver.run)  # type: ignore[attr-defined]
            return
        self.tp = TensorParallelGeneration(ctx, groups, self.receiver.weights, model, tokenizer)
        self.follows = not self.tp.leader
        if self.tp.leader:  # the followers install each version when the leader says so
            ctx.tasks.start_soon(self.receiver.run, self.tp.announce)  # type: ignore[attr-defined]

    async def process(self, batch: Batch) -> Output:
        assert self.receiver is not None
        if self.tp is not None:
            return await self.tp.process(batch)
        # waits until the train group has sent a new enough version
        return await self.rollout.process(self.receiver.weights, batch)

    async def follow(self) -> None:
        assert self.tp is not None and self.receiver is not None
        await self.tp.follow(self.receiver.receive)

    async def close(self) -> None:
        try:
            await self._close_channel()
        finally:
            if getattr(self, "engine", None) is not None:
                await self.ctx.run_sync(self.engine.close)  # type: ignore[union-attr]

    async def _close_channel(self) -> None:
        if not dist.is_initialized():
            return
        name, worker = self.ctx.spec.name, self.ctx.worker
        receiver, tp = self.receiver, self.tp
        if receiver is None:
            dist.destroy_process_group()
            return
        # Take every version the train group still sends, until it closes the channel (its close
        # follows its last step); only then stop a TP group's followers, which install on the
        # leader's word.
        if tp is not None and not tp.leader and not await tp.follow_until_stopped(receiver.receive,
                                                                                   self.close_wait_s):
            log.warning("%s[%d]: no STOP from TP rank 0 within %.0f s; leaving the process group", name, worker,
                        self.close_wait_s)
            return
        closed = await receiver.wait_closed(self.close_wait_s, tp.announce if tp is not None and tp.leader else None)
        if tp is not None and tp.leader:
            await tp.stop()
        if not closed:
            # the trainer never closed the channel (it failed): a receive may still be blocked in
            # gloo, and destroying the group under it could hang; the process exit cleans up
            log.warning("%s[%d]: no close from the train group within %.0f s (%d versions received); "
                        "leaving the process group", name, worker, self.close_wait_s, receiver.installed)
            return
        log.info("%s[%d]: weight channel closed after %d versions", name, worker, receiver.installed)
        dist.destroy_process_group()
