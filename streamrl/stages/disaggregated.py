"""Disaggregated generate + train: a train group of R processes sends each policy version, bucket by
bucket, to G separate generation workers.

Pipeline (``pipelines/grpo_disaggregated.yaml``): ``placement: disaggregated``, the train stage with
``workers: R`` and the generate stage with ``workers: G`` and ``weights_from: train``. All R + G
processes join one torch.distributed world through a FileStore in
``<run_dir>/rendezvous/<train stage>``: train worker k is world rank k, generate worker j is world
rank R + j (``Topology.disaggregated(TrainLayout(R), T=1, replicas=G)``: each generation worker holds
a whole inference copy, fed by train rank j mod R).

Train side, per step (:class:`DisaggregatedTrainStage`):

- each micro-batch of this rank's share is trained on *as it arrives* (forward/backward into the
  sharded gradients, unnormalised): the train processes hold no generation, so nothing makes them
  wait for the whole step; this overlaps training with the generation of the step's later
  micro-batches;
- once every rank has its share (the all-reduce of the step's counts), the summed gradients are
  scaled to the step's mean (``optimizer_step(grad_scale=...)``) and AdamW steps on the shards;
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
import time

import anyio
import msgspec
import torch.distributed as dist

from streamrl.reshard import (
    ModelShardingSpec,
    ReshardConfig,
    Resharder,
    ReshardReport,
    Topology,
    TrainLayout,
    WeightReceiver,
    WeightSender,
)
from streamrl.runtime.pipeline import (
    ReshardGenerateOptions,
    ReshardTrainOptions,
    StageSpec,
    inference_tensor_parallel,
)
from streamrl.runtime.stage import Batch, Output, StageContext
from streamrl.stages.common import build_policy
from streamrl.stages.sharded_grpo import (
    ShardedGrpoTrainer,
    ViewRollout,
    default_backend,
    grpo_micro_batch,
    join_world,
    rank_device,
    weights_receiver,
)
from streamrl.stages.tp_generation import TensorParallelGeneration

log = logging.getLogger("streamrl.stage.disaggregated")

CLOSE_WAIT_S = 10.0  # how long a train rank tries to deliver its close header at shutdown


class WeightSendError(RuntimeError):
    """A train rank could not deliver a policy version to its generation workers."""


def _topology(train_workers: int, generate: StageSpec) -> Topology:
    # G = T x replicas generation workers; worker j is TP rank j % T of replica j // T
    T = inference_tensor_parallel(generate)
    return Topology.disaggregated(TrainLayout(train_workers), T, generate.workers // T)


class DisaggregatedTrainStage(ShardedGrpoTrainer):
    """Sharded GRPO training over R ranks that sends each version to the generation workers.

    Options: ``bucket_bytes`` (reshard bucket cap, bytes, default 64 MiB; the generation workers read
    it from here), ``backend`` (default gloo on CPU, nccl on CUDA, hccl on NPU), ``collective_timeout_s`` (how
    long a rank waits in a collective or a weight send, default 600).
    """

    placement = "disaggregated"

    def _world_size(self) -> int:
        return self.R + weights_receiver(self.ctx).workers

    def _topology(self) -> Topology:
        return _topology(self.R, weights_receiver(self.ctx))

    async def _start_weights(self) -> None:
        resharder = Resharder(self.spec, self.groups, config=ReshardConfig(bucket_bytes=self.bucket_bytes),
                              shard_dtype=self.engine.dtype, inference_dtype=self.engine.dtype,
                              device=self.device)
        self.sender = WeightSender(self.engine, resharder)
        # In the background: the generation workers may take version 0 only after the start barrier
        # (TP followers serve their leader's commands from then on), and set-up must not wait for them.
        self.initial_sent = anyio.Event()
        self.ctx.tasks.start_soon(self._send_initial)  # type: ignore[attr-defined]

    async def _send_initial(self) -> None:
        await self._send(0)
        self.initial_sent.set()

    async def _send(self, version: int) -> ReshardReport:
        try:
            return await self.sender.send(version)
        except RuntimeError as exc:  # gloo/nccl: a peer closed the connection or timed out
            generation = weights_receiver(self.ctx).name
            workers = ", ".join(f"{generation} worker {r - self.R} (world rank {r})"
                                for r in self.groups.weight_destinations)
            raise WeightSendError(f"sending policy version {version} to {workers} failed (did it exit? see its "
                                  f"log): {exc}") from exc

    async def _accumulate(self, batch: Batch) -> None:
        # Train now, unnormalised: the step's denominator is applied to the summed gradients at the step.
        await self.ctx.run_sync(self.engine.forward_backward, grpo_micro_batch(batch.columns), self.loss_fn)

    def _train(self, scale: float) -> tuple[dict[str, float], float]:
        stats = self.engine.optimizer_step(grad_scale=scale)
        return self.loss_fn.sums, stats.grad_norm

    async def _hand_over(self, version: int) -> dict[str, float]:
        await self.initial_sent.wait()  # (long done: version 0 generated this step's first samples)
        t0 = time.perf_counter()
        report = await self._send(version)
        return {
            "reshard_ms": report.total_s * 1e3,
            "send_ms": (time.perf_counter() - t0) * 1e3,  # includes waiting for a receiver's lease
            "reshard_peak_extra_bytes": float(report.peak_extra_bytes),
            "reshard_largest_bucket_bytes": float(report.largest_bucket_bytes),
            "reshard_bucket_bytes_limit": float(report.bucket_bytes_limit or 0),
            "reshard_buckets": float(len(report.buckets)),
            "reshard_sent_bytes": float(report.sent_bytes),
        }

    async def close(self) -> None:
        sender = getattr(self, "sender", None)
        if sender is not None:
            try:  # releases the generation workers' receivers (their close waits for this)
                with anyio.fail_after(CLOSE_WAIT_S):
                    await sender.close()
            except Exception as exc:  # a generation worker already gone: nothing left to release
                log.warning("could not send the close header to every generation worker: %s", exc)
        if (self.ctx.config.output.checkpoint and not self.checkpoint_saved and self.R == 1
                and getattr(self, "version", 0) > 0):
            # one rank holds the whole model: no collective needed to write the newest version
            await self.ctx.run_sync(self._save_checkpoint, self.engine.full_state_dict())
        await super().close()


class DisaggregatedGenerateStage:
    """Samples with the newest policy version received from the train group (``weights_from``).

    Option ``tensor_parallel: T`` (default 1): every T consecutive workers form one inference replica
    holding one slice each; its TP rank 0 claims and the others follow it (see
    :mod:`streamrl.stages.tp_generation`).
    """

    placement = "disaggregated"
    Options = ReshardGenerateOptions

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.receiver: WeightReceiver | None = None
        self.tp: TensorParallelGeneration | None = None
        self.follows = False
        if ctx.pipeline is None or ctx.spec.weights_from is None:
            raise ValueError(f"stage {ctx.spec.name!r} needs `weights_from: <the disaggregated train stage>`")
        train = ctx.pipeline.stage(ctx.spec.weights_from)
        R, G = train.workers, ctx.spec.workers
        topology = _topology(R, ctx.spec)
        # the receiver's bucket plan must be the sender's: both read the train stage's options, through
        # the same type and defaults (checked when the pipeline loads)
        train_options = msgspec.convert(train.options, ReshardTrainOptions)
        bucket_bytes = train_options.bucket_bytes
        timeout_s = train_options.collective_timeout_s
        # A generate loop can end (its input is exhausted) while training still runs a few steps and
        # sends their versions; close() takes them for as long as the train group may take a step.
        self.close_wait_s = timeout_s
        backend = train_options.backend or default_backend(ctx.device)
        device = rank_device(ctx.device, R + ctx.worker, R + G, backend)  # generate worker j = world rank R + j
        model, tokenizer = build_policy(ctx.config, device)
        spec = ModelShardingSpec.from_config(model.config)
        groups = await join_world(ctx, train.name, R + ctx.worker, R + G, topology, backend=backend,
                                  timeout_s=timeout_s, device=device)
        dtype = next(model.parameters()).dtype
        resharder = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=bucket_bytes), shard_dtype=dtype,
                              inference_dtype=dtype, device=device)
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
