"""How a new policy version reaches generation: one small strategy per placement, called by the trainer.

The train stage (:mod:`streamrl.stages.train`) is the same in every placement; it asks its
:class:`HandOver` for the world it joins and calls it at three points of a step:

- ``start(trainer)``: the initial policy (version 0, or a resumed checkpoint's) is available to generation;
- ``before_train()``: every rank has its share of the step; the step's compute comes next;
- ``publish(version)``: the optimizer stepped; make ``version`` available.

============== ================================================ ===========================
placement      publish                                           world
============== ================================================ ===========================
separate       full snapshot (``full_state_dict``, collective)   the R train ranks
               served by rank 0's ``PolicyPublisher``
colocated      allgather-swap into this process's inference      the R train ranks
               weights, training state swapped to the host
disaggregated  bucketed all-gather, slices sent point to point   R train + G generate ranks
               to the generate workers
============== ================================================ ===========================

In every placement rank 0 serves the version numbers on the policy channel (the source's
staleness gate); only ``separate`` sends weights through it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import anyio

from streamrl.reshard import (
    ColocatedPolicy,
    ModelShardingSpec,
    ReshardConfig,
    Resharder,
    ReshardReport,
    Topology,
    TrainLayout,
    WeightSender,
)
from streamrl.runtime.pipeline import (
    PipelineSpec,
    StageSpec,
    class_says,
    colocated_tensor_parallel,
    import_stage_class,
    inference_tensor_parallel,
)
from streamrl.runtime.policy import PolicyPublisher, PolicySnapshot
from streamrl.runtime.stage import StageContext
from streamrl.stages.world import weights_receiver

if TYPE_CHECKING:
    from streamrl.stages.train import TrainOptions, TrainStage

log = logging.getLogger("streamrl.stage.train")

CLOSE_WAIT_S = 10.0  # how long a train rank tries to deliver its close header at shutdown


class WeightSendError(RuntimeError):
    """A train rank could not deliver a policy version to its generation workers."""


class HandOver(Protocol):
    # False: the trainer keeps its micro-batches until every rank has its share (colocated: the
    # devices still generate for the other ranks until then)
    trains_on_arrival: bool
    channel: _VersionNumbers

    @property
    def visible_at(self) -> float:
        """``time.time()`` just before the last published version became visible to generation (0:
        none yet): when the step that made it ended, for its row (:meth:`StageContext.report_step`)."""
        return self.channel.visible_at

    def world_size(self) -> int: ...

    def topology(self) -> Topology | None: ...

    async def start(self, trainer: TrainStage) -> None: ...

    def setup_failed(self, exc: BaseException) -> None:
        """The trainer's set-up raised ``exc`` (before or in ``start``). Default: nothing to tell."""

    async def before_train(self) -> dict[str, float]:
        """Every rank has its share of the step; its compute comes next. Default: nothing to do."""
        return {}

    async def publish(self, version: int) -> dict[str, float]: ...

    async def close(self) -> None: ...


def hand_over_for(ctx: StageContext, options: TrainOptions) -> HandOver:
    placement = ctx.pipeline.placement if ctx.pipeline is not None else "separate"
    if placement == "colocated":
        return ColocatedHandOver(ctx, options)
    if placement == "disaggregated":
        return DisaggregatedHandOver(ctx, options)
    return PublishHandOver(ctx)


def policy_fetched(pipeline: PipelineSpec | None) -> bool:
    """Whether a stage of ``pipeline`` fetches the trainer's published weights: its class says
    ``fetches_policy`` (the generate and agent stages in placement separate, a chain with such a
    link, the eval stage). No pipeline (a stage driven by hand): assume one does."""
    if pipeline is None:
        return True
    return any(class_says(import_stage_class(s.cls), "fetches_policy", s) for s in pipeline.stages)


def disaggregated_topology(train_workers: int, generate: StageSpec) -> Topology:
    """G = T x replicas generation workers; worker j is TP rank j % T of replica j // T."""
    T = inference_tensor_parallel(generate)
    return Topology.disaggregated(TrainLayout(train_workers), T, generate.workers // T)


def reshard_metrics(report: ReshardReport) -> dict[str, float]:
    return {
        "reshard_ms": report.total_s * 1e3,
        "reshard_peak_extra_bytes": float(report.peak_extra_bytes),
        "reshard_largest_bucket_bytes": float(report.largest_bucket_bytes),
        "reshard_bucket_bytes_limit": float(report.bucket_bytes_limit or 0),
        "reshard_buckets": float(len(report.buckets)),
    }


class _VersionNumbers:
    """Rank 0 serves version numbers (and, for ``separate``, the weights) on the policy channel."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.visible_at = 0.0  # see HandOver.visible_at
        self.publisher: PolicyPublisher | None = None
        if ctx.worker == 0:
            # the generators of this host map each version from the run's shared memory
            self.publisher = PolicyPublisher(ctx.weights_endpoint, auth=ctx.server_auth, shm_dir=ctx.shm_dir)
            ctx.tasks.start_soon(self.publisher.serve)  # type: ignore[attr-defined]

    async def announce(self, version: int, snapshot: PolicySnapshot | None = None) -> None:
        """Make ``version`` current (with its weights where ``snapshot`` has them) on rank 0."""
        self.visible_at = time.time()
        if self.publisher is not None:  # (no snapshot: the version's number only)
            await self.publisher.publish(version, snapshot=snapshot)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


class PublishHandOver(HandOver):
    """``separate``: rank 0 publishes each version's full float32 weights; generators fetch them.

    A train stage that generates its own samples (``options.rollout``) publishes only the version
    numbers (for the source), unless another stage of the pipeline says it fetches the weights
    (``fetches_policy``: an eval stage, a generator of its own)."""

    trains_on_arrival = True

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.R = ctx.spec.workers
        self.channel = _VersionNumbers(ctx)
        self.publishes_weights = ctx.spec.options.get("rollout") is None or policy_fetched(ctx.pipeline)

    def world_size(self) -> int:
        return self.R

    def topology(self) -> Topology | None:
        return None

    async def start(self, trainer: TrainStage) -> None:
        self.trainer = trainer  # version 0 is built by every stage itself: nothing to send
        if trainer.version > 0:  # resumed from a checkpoint: generation needs its weights
            await self.publish(trainer.version)

    def _gather(self, version: int) -> PolicySnapshot | None:
        if not self.publishes_weights:  # the version's number only: no stage fetches its weights
            return None
        # collective; rank 0 gets the state, as the live tensors where it holds them whole, and
        # copies it once: into the version's file in the run's shared memory (or to the host)
        state = self.trainer.engine.full_state_dict(copy=False)
        publisher = self.channel.publisher
        return publisher.snapshot(version, state) if publisher is not None else None

    async def publish(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        # the compute thread (the copy needs no event loop); one rank: no collective, so a small
        # model's copy runs on the event loop (StageContext.run_brief)
        snapshot = await self.ctx.run_brief(self._gather, version, local=self.R == 1)
        t1 = time.perf_counter()
        await self.channel.announce(version, snapshot)
        return {"gather_ms": (t1 - t0) * 1e3, "publish_ms": (time.perf_counter() - t1) * 1e3}

    async def close(self) -> None:
        self.channel.close()


def _resharder(trainer: TrainStage, topology: Topology, bucket_bytes: int) -> Resharder:
    """Reads FSDP2's local shards (float32 masters) and writes the rollout's dtype."""
    from streamrl.reshard.fsdp_layout import spec_for_placements  # DTensor: the workers', not the launcher's

    engine = trainer.engine
    # the parameters as the engine's FSDP2 placements hold them (streamrl/reshard/fsdp_layout.py)
    spec, _ = spec_for_placements(ModelShardingSpec.from_model(engine.model), engine.model)
    return Resharder(spec, trainer.groups, config=ReshardConfig(bucket_bytes=bucket_bytes),  # type: ignore[arg-type]
                     shard_dtype=engine.master_dtype, inference_dtype=engine.compute_dtype,
                     device=trainer.device)


class ColocatedHandOver(HandOver):
    """``colocated``: the R processes alternate generation and training; each version is resharded
    into this process's inference weights and the training state goes to the host meanwhile."""

    trains_on_arrival = False

    def __init__(self, ctx: StageContext, options: TrainOptions) -> None:
        self.ctx, self.options = ctx, options
        self.R = ctx.spec.workers
        self.T = colocated_tensor_parallel(weights_receiver(ctx), ctx.config.algo.max_staleness)
        self.channel = _VersionNumbers(ctx)
        self.policy: ColocatedPolicy | None = None

    def world_size(self) -> int:
        return self.R

    def topology(self) -> Topology:
        return Topology.colocated(TrainLayout(self.R, self.options.tensor_parallel), self.T)

    async def start(self, trainer: TrainStage) -> None:
        from streamrl.stages.colocated import colocated_rank, uses_vllm

        resharder = _resharder(trainer, self.topology(), self.options.bucket_bytes)
        stream = uses_vllm(weights_receiver(self.ctx))
        # T > 1: the slices stay through the training phase (see streamrl/stages/tp_generation.py)
        self.policy = ColocatedPolicy(trainer.engine, resharder, swap_training_state=self.options.swap,
                                      release_weights_in_training=self.T == 1, stream_to_engine=stream)
        shared = colocated_rank(self.ctx)
        if stream:
            # The generate stage starts vLLM from the initial weights once the policy is shared, and
            # attaches it; then the first version (0, or a resumed checkpoint's) streams into it.
            shared.policy, shared.groups = self.policy, trainer.groups
            shared.ready.set()
            timeout_s = self.ctx.config.resources.start_timeout_s
            with anyio.move_on_after(timeout_s):
                await shared.engine_attached.wait()
            if not shared.engine_attached.is_set():
                raise TimeoutError(f"the colocated generate stage's vLLM engine did not start within "
                                   f"resources.start_timeout_s ({timeout_s:g} s); raise it for a large model or "
                                   f"a slow machine (the generate stage's log says how far it got)")
        await self.policy.to_inference(trainer.version)  # 0, or a resumed checkpoint's
        if trainer.version > 0:
            await self.channel.announce(trainer.version)
        shared.policy, shared.groups = self.policy, trainer.groups
        shared.ready.set()

    def setup_failed(self, exc: BaseException) -> None:
        from streamrl.stages.colocated import colocated_rank

        shared = colocated_rank(self.ctx)
        shared.error = f"{type(exc).__name__}: {exc}"
        shared.ready.set()

    async def before_train(self) -> dict[str, float]:
        # Only now is all generation this step waits for done (every rank has its share): swap in.
        assert self.policy is not None
        t0 = time.perf_counter()
        swap_in = await self.policy.to_training()
        return {"swap_in_ms": (time.perf_counter() - t0) * 1e3 if swap_in is not None else 0.0}

    async def publish(self, version: int) -> dict[str, float]:
        assert self.policy is not None
        t0 = time.perf_counter()
        report = await self.policy.to_inference(version)
        swap_out = self.policy.last_swap
        await self.channel.announce(version)
        return {
            **reshard_metrics(report),
            "swap_out_ms": swap_out.seconds * 1e3 if swap_out is not None else 0.0,
            "to_inference_ms": (time.perf_counter() - t0) * 1e3,
            "reshard_received_bytes": float(report.received_bytes),
            "swap_bytes": float(swap_out.bytes) if swap_out is not None else 0.0,
        }

    async def close(self) -> None:
        from streamrl.stages.colocated import colocated_rank
        from streamrl.stages.tp_generation import STOP_WAIT_S

        self.channel.close()
        shared = colocated_rank(self.ctx)
        if shared.ready.is_set() and shared.policy is not None:
            # the generate stage computes over the process group until its STOP: destroy it after
            with anyio.move_on_after(STOP_WAIT_S + 5):
                await shared.generation_closed.wait()


class DisaggregatedHandOver(HandOver):
    """``disaggregated``: the train group sends each version, bucket by bucket, to G generate workers."""

    trains_on_arrival = True

    def __init__(self, ctx: StageContext, options: TrainOptions) -> None:
        self.ctx, self.options = ctx, options
        self.R = ctx.spec.workers
        self.generate = weights_receiver(ctx)
        self.channel = _VersionNumbers(ctx)
        self.sender: WeightSender | None = None

    def world_size(self) -> int:
        return self.R + self.generate.workers

    def topology(self) -> Topology:
        return disaggregated_topology(self.R, self.generate)

    async def start(self, trainer: TrainStage) -> None:
        self.groups = trainer.groups
        self.sender = WeightSender(trainer.engine, _resharder(trainer, self.topology(), self.options.bucket_bytes))
        # In the background: the generation workers may take version 0 only after the start barrier
        # (TP followers serve their leader's commands from then on), and set-up must not wait for them.
        self.initial_sent = anyio.Event()
        self.ctx.tasks.start_soon(self._send_initial, trainer.version)  # type: ignore[attr-defined]

    async def _send_initial(self, version: int) -> None:
        await self._send(version)  # 0, or a resumed checkpoint's
        if version > 0:
            await self.channel.announce(version)
        self.initial_sent.set()

    async def _send(self, version: int) -> ReshardReport:
        assert self.sender is not None
        try:
            return await self.sender.send(version)
        except RuntimeError as exc:  # gloo/nccl: a peer closed the connection or timed out
            workers = ", ".join(f"{self.generate.name} worker {r - self.R} (world rank {r})"
                                for r in self.groups.weight_destinations)
            raise WeightSendError(f"sending policy version {version} to {workers} failed (did it exit? see its "
                                  f"log): {exc}") from exc

    async def publish(self, version: int) -> dict[str, float]:
        await self.initial_sent.wait()  # (long done: version 0 generated this step's first samples)
        t0 = time.perf_counter()
        report = await self._send(version)
        await self.channel.announce(version)
        return {
            **reshard_metrics(report),
            "send_ms": (time.perf_counter() - t0) * 1e3,  # includes waiting for a receiver's lease
            "reshard_sent_bytes": float(report.sent_bytes),
        }

    async def close(self) -> None:
        self.channel.close()
        if self.sender is not None:
            try:  # releases the generation workers' receivers (their close waits for this)
                with anyio.fail_after(CLOSE_WAIT_S):
                    await self.sender.close()
            except Exception as exc:  # a generation worker already gone: nothing left to release
                log.warning("could not send the close header to every generation worker: %s", exc)
