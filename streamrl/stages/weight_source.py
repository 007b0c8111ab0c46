"""Where a generating stage's policy versions come from: one small strategy per placement.

The generation side of :mod:`streamrl.stages.handover`. The generate stage
(:mod:`streamrl.stages.generate`) and the agent stage (:mod:`streamrl.stages.agent`) are the same in
every placement; each asks :func:`weight_source_for` for its :class:`WeightSource` and samples
inside ``async with source.hold(need) as rollout``: ``rollout`` generates with one policy version
``>= need`` (``rollout.version``), which no install replaces until the block ends.

============== ============================================= ==========================================
placement      source (the pipeline says it)                  a new version arrives
============== ============================================= ==========================================
separate       :class:`FetchedWeights` (neither link):        a background task fetches it from the
               the rollout engine (built-in or vLLM) holds    train stage's ``PolicyPublisher`` as soon
               its own copy                                   as it is published and installs it
                                                              between blocks
colocated      :class:`ColocatedWeights`                      the train stage of this process reshards
               (``colocate_with: train``): zero-copy views    it in (``to_inference``); ``hold`` takes a
               of this process's inference weights            shared lease on it
disaggregated  :class:`ReceivedWeights`                       a background task receives it bucket by
               (``weights_from: train``): zero-copy views     bucket from the train group
               of the weights received from the train group   (``WeightReceiver``) under the lease's
                                                              exclusive side
(any)          :class:`TrainerWeights` (a link of the train   the train stage's own optimizer step:
               stage's ``options.rollout``): the train         generation and training take turns in
               engine's module itself, or a copy of it         one task, so no version changes under a
                                                              generation
============== ============================================= ==========================================

In both reshard placements ``engine: vllm`` (T = 1) keeps vLLM's own weights instead of views (the
buckets stream into its ``load_weights``), and ``tensor_parallel: T > 1`` makes every T workers one
inference group (:mod:`streamrl.stages.tp_generation`): its rank 0 holds and generates, the other
ranks follow it (``follows``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from streamrl.config import ConfigError
from streamrl.engines.options import GenerateOptions
from streamrl.engines.rollout import Generation, TorchRolloutEngine
from streamrl.engines.rollout_engine import EngineRollout, RolloutEngine
from streamrl.metrics.trace import tracer
from streamrl.reshard import (
    InferencePlan,
    InferenceWeights,
    ModelShardingSpec,
    ReshardConfig,
    Resharder,
    WeightReceiver,
    local_hf_views,
)
from streamrl.runtime.pipeline import PipelineSpec, StageSpec
from streamrl.runtime.policy import PolicyTimeout
from streamrl.runtime.stage import Batch, StageContext
from streamrl.stages.colocated import ColocatedSetupError, colocated_rank
from streamrl.stages.common import build_policy, open_rollout_engine
from streamrl.stages.tp_generation import STOP_WAIT_S, TensorParallelGeneration

if TYPE_CHECKING:  # transformers' model classes take seconds to import; the launcher imports the stages
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("streamrl.stage.weights")


def version_needed(batch: Batch, max_staleness: int) -> int:
    """The oldest policy version allowed to generate ``batch``: its newest prompt's step - max_staleness."""
    steps = batch.columns.get("step")
    return max(int(s) for s in steps) - max_staleness if steps else 0


class Rollout(Protocol):
    """What ``WeightSource.hold`` yields: generation with one policy version (call it in a thread)."""

    version: int

    def generate(self, prompts: list[Tensor], *, max_new_tokens: int, temperature: float, top_p: float,
                 top_k: int, generator: torch.Generator | None,
                 streams: Sequence[tuple[int, int]] | None = None) -> list[Generation]: ...


class WeightSource(Protocol):
    """A generating worker's policy versions (see the module doc). ``setup`` builds the worker's
    model and engine; afterwards ``tokenizer``, ``max_positions``, ``generator_device`` and
    ``engine_name`` describe them, and ``follows`` says the worker follows its TP rank 0."""

    follows: bool
    tokenizer: PreTrainedTokenizerBase
    max_positions: int | None
    generator_device: torch.device | str
    engine_name: str

    async def setup(self) -> None: ...

    def hold(self, need: int) -> Any:
        """``async with source.hold(need) as rollout``: a :class:`Rollout` on a version ``>= need``
        (waits for one) that no install replaces until the block ends."""
        ...

    async def wait_installed(self, need: int) -> None:
        """Until a version ``>= need`` is installed, where the source installs versions as they come
        (placement separate); at once elsewhere (``hold`` waits). The generate stage awaits it before
        its batch's busy time begins: waiting for the trainer is not work."""
        ...

    async def follow(self) -> None: ...

    async def close(self) -> None: ...


def fetches_weights(spec: StageSpec) -> bool:
    """Placement separate (neither link, :func:`check_weight_links`): the worker holds no state beyond the weights it fetches
    again, so the launcher may restart it; a reshard placement's worker is a rank of a
    torch.distributed world and is not restartable."""
    return spec.colocate_with is None and spec.weights_from is None


def check_weight_links(spec: StageSpec, pipeline: PipelineSpec) -> None:
    """A generating stage's link to the train stage fits the pipeline's placement (checked when the
    pipeline loads; :func:`weight_source_for` relies on it)."""
    at = f"{pipeline.where}: stage {spec.name!r}"
    if pipeline.placement == "separate" and spec.colocate_with is not None:
        raise ConfigError(f"{at} colocate_with: {spec.colocate_with!r} generates on the weights of the train stage in "
                          "its process, which works only with `placement: colocated` at the top of the pipeline, "
                          "which says 'separate'")
    if pipeline.placement == "colocated" and spec.colocate_with is None:
        raise ConfigError(f"{at}: in placement colocated the policy's weights are only in the train stage's "
                          "processes: add `colocate_with: <the train stage>` to it")
    if pipeline.placement == "disaggregated" and spec.weights_from is None:
        raise ConfigError(f"{at}: in placement disaggregated the train group sends the policy's weights to the "
                          "stage that says `weights_from: <the train stage>`; there is one already, so this one "
                          "would get none: generate in that stage (more workers), or use placement separate")


def weight_source_for(ctx: StageContext, options: GenerateOptions) -> WeightSource:
    """The source of the pipeline's placement (see the module doc and :func:`check_weight_links`),
    or the train stage's own weights for a link of its ``options.rollout``."""
    if TRAINER_POLICY in ctx.shared:
        return TrainerWeights(ctx, options)
    placement = ctx.pipeline.placement if ctx.pipeline is not None else "separate"
    if placement == "colocated":
        return ColocatedWeights(ctx, options)
    if placement == "disaggregated":
        return ReceivedWeights(ctx, options)
    return FetchedWeights(ctx, options)


# -- rollouts -----------------------------------------------------------------------------------------
class ViewEngine:
    """The built-in engine computing on inference weights it does not own.

    The model's parameters are emptied at construction; each ``generate`` binds them to zero-copy
    views of one inference rank's weights (held by the caller under a lease) and unbinds them
    before returning, so released weights are never kept alive through the module.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, plan: InferencePlan,
                 inference_rank: int = 0) -> None:
        model.eval()
        self.plan, self.inference_rank = plan, inference_rank
        self.params = dict(model.named_parameters())
        device = next(iter(self.params.values())).device  # the caller built it on this rank's device
        for p in self.params.values():  # weights come from the reshard: keep no copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        missing = set(self.params) - {p.source for p in plan.pieces[inference_rank]}
        if missing:
            raise ValueError(f"the inference layout lacks parameters {sorted(missing)[:3]} of the rollout model")
        self.engine = TorchRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device)

    def generate(self, tensors: Mapping[str, Tensor], prompts: list[Tensor], **sampling: Any) -> list[Generation]:
        views = local_hf_views(tensors, self.plan, self.inference_rank)
        try:
            for name, p in self.params.items():  # zero-copy: the model computes on the inference weights
                p.data = views[name]
            return self.engine.generate(prompts, **sampling)
        finally:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


class ViewRollout:
    def __init__(self, engine: ViewEngine, tensors: Mapping[str, Tensor], version: int) -> None:
        self.engine, self.tensors, self.version = engine, tensors, version

    def generate(self, prompts: list[Tensor], **sampling: Any) -> list[Generation]:
        return self.engine.generate(self.tensors, prompts, **sampling)


# -- in the train stage ------------------------------------------------------------------------------
TRAINER_POLICY = "trainer_policy"  # ctx.shared key: the TrainerPolicy of a train stage with options.rollout


@dataclass
class TrainerPolicy:
    """What a train stage that generates its own samples (``options.rollout``,
    :mod:`streamrl.stages.train`) lends its generate link: a built-in rollout engine on the policy
    it trains, and that policy's version. The train stage sets ``version`` after each optimizer step
    (and copies the weights in first where the engine holds a copy); it runs its links and its
    training in one task, so no step lands under a generation."""

    engine: TorchRolloutEngine
    tokenizer: PreTrainedTokenizerBase
    max_positions: int | None
    version: int


class TrainerWeights:
    """A generate link of the train stage's ``options.rollout``: the train stage's policy, current by
    construction (the stage generates a step's samples with the version it is about to train)."""

    follows = False
    engine_name = "builtin (the train stage's weights)"

    def __init__(self, ctx: StageContext, options: GenerateOptions) -> None:
        # options.engine is builtin: the train stage's check_spec refused any other before the run
        self.ctx = ctx
        self.policy: TrainerPolicy = ctx.shared[TRAINER_POLICY]

    async def setup(self) -> None:
        policy = self.policy
        self.tokenizer, self.max_positions = policy.tokenizer, policy.max_positions
        self.generator_device = policy.engine.generator_device

    async def wait_installed(self, need: int) -> None:
        return  # hold checks it: nothing to wait for

    @asynccontextmanager
    async def hold(self, need: int) -> AsyncIterator[Rollout]:
        version = self.policy.version
        if version < need:
            # the source puts a step's prompts one version early at most, and the train stage
            # claims them in order after the step before: this would be a claiming fault
            raise RuntimeError(f"{self.ctx.spec.name}: a batch needs policy version {need}, but the train stage "
                               f"is at version {version}")
        yield EngineRollout(self.policy.engine, version)

    async def follow(self) -> None:
        raise AssertionError("a link of the train stage follows no one")

    async def close(self) -> None:
        return  # the train stage owns the engine


# -- separate ---------------------------------------------------------------------------------------
class FetchedWeights:
    """Placement separate: the worker's own rollout engine, fed by the train stage's ``PolicyPublisher``.

    A background task, started by the first ``hold``, installs each version as soon as the trainer
    publishes it (``_prefetch``), so that a synchronous run (``max_staleness: 0``) starts generating
    the step's prompts, claimed while the step before trained, once the install is done. ``hold``
    waits until a version ``>= need`` is installed; installs and generations exclude each other
    (one lock), so no install lands under a generation. Should no publisher answer (a pipeline
    without a trainer), the task stops and ``hold`` asks the publisher itself; a failed install
    fails the worker, as it did in ``hold``. Reports ``weight_install_s`` (the last install) as a
    stage metric.
    """

    follows = False

    def __init__(self, ctx: StageContext, options: GenerateOptions) -> None:
        self.ctx, self.options = ctx, options
        self.engine: RolloutEngine | None = None
        self.version = 0
        self._lock = anyio.Lock()
        self._prefetching = False
        self._installed = anyio.Event()  # set (and replaced) at each install and when the prefetch stops
        self._prefetch_scope: anyio.CancelScope | None = None

    async def setup(self) -> None:
        ctx = self.ctx
        model, self.tokenizer = build_policy(ctx.config, ctx.device)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.engine = await ctx.run_sync(open_rollout_engine, ctx, self.options.engine, self.options.vllm, model,
                                         self.tokenizer, ctx.device)
        del model  # the vLLM engine holds its own copy; the built-in one keeps a reference
        self.engine_name = self.engine.name
        self.generator_device = self.engine.generator_device
        ctx.report_metrics({"engine_startup_s": self.engine.startup_s})

    async def _install(self, version: int, state: Mapping[str, Tensor]) -> None:
        """Install ``state`` as ``version`` (the caller holds the lock)."""
        assert self.engine is not None
        started = time.perf_counter()
        # a small model's install (a copy in this process) runs on the event loop: run_brief
        await self.ctx.run_brief(self.engine.load_weights, state.items(), local=self.engine.load_weights_is_local)
        self.version = version
        ended = time.perf_counter()
        # on the busy report of the batch waiting for this version: no message on the way to it
        self.ctx.report_metrics({"weight_install_s": ended - started}, defer=True)
        tracer().complete("install weights", "policy", started, ended, "policy", version=version)
        tracer().counter("policy version", version)

    def _wake(self) -> None:
        self._installed.set()
        self._installed = anyio.Event()

    async def _prefetch(self, scope: anyio.CancelScope) -> None:
        # The only user of the policy subscriber while it runs (one DEALER: concurrent requests
        # would take each other's replies). One long poll asks for the next version's weights, so
        # a synchronous run's generators have them one round trip after the publish, not two (a
        # wait for the number, then a fetch). A version that comes during a generation stays
        # mapped until the lock is free: its file is not rewritten while this worker has not said
        # it is done with it (WeightsRequest.done), so that costs the publisher a file, not bytes.
        policy = self.ctx.policy
        with scope:
            try:
                while True:
                    version, state = await policy.fetch(self.version, self.version + 1)
                    async with self._lock:
                        if state is not None and version > self.version:
                            await self._install(version, state)
                        # installed (copied into the engine): unmapped now, so the next request
                        # tells the publisher it may write a later version into the file
                        state = None
                    self._wake()
            except PolicyTimeout as exc:  # no publisher answers: hold() asks for itself from now on
                self.ctx.log.info("%s[%d]: no weights prefetch (%s: %s); each batch asks the publisher itself",
                                  self.ctx.spec.name, self.ctx.worker, type(exc).__name__, exc)
            finally:
                self._prefetching = False
                self._wake()

    async def wait_installed(self, need: int) -> None:
        tasks = getattr(self.ctx, "tasks", None)  # the worker's task group (absent: a stage driven by hand)
        if self._prefetch_scope is None and tasks is not None:
            # started by the first batch, once the run has started: the publisher serves by then,
            # however long the trainer took to set up
            self._prefetch_scope = anyio.CancelScope()
            self._prefetching = True
            tasks.start_soon(self._prefetch, self._prefetch_scope)
        while self._prefetching and self.version < need:
            await self._installed.wait()

    @asynccontextmanager
    async def hold(self, need: int) -> AsyncIterator[Rollout]:
        assert self.engine is not None
        await self.wait_installed(need)
        async with self._lock:
            if not self._prefetching:
                version, state = await self.ctx.policy.fetch(self.version, need)
                if state is not None:
                    await self._install(version, state)
                state = None  # not held across the generation: its file's mapping goes now
            yield EngineRollout(self.engine, self.version)

    async def follow(self) -> None:
        raise AssertionError("a worker of placement separate follows no one")

    async def close(self) -> None:
        if self._prefetch_scope is not None:
            self._prefetch_scope.cancel()
        if self.engine is not None:
            async with self._lock:  # after an install in flight (a thread cannot be cancelled)
                await self.ctx.run_sync(self.engine.close)


# -- both reshard placements ------------------------------------------------------------------------
class _LeasedWeights:
    """Inference weights another party installs (``InferenceWeights``), generated with under a
    shared lease: views for the built-in engine, the versions' numbers only for vLLM (which holds
    the weights itself), or a TP group's slice."""

    follows = False

    def __init__(self, ctx: StageContext, options: GenerateOptions) -> None:
        self.ctx, self.options = ctx, options
        self.weights: InferenceWeights | None = None
        self.view: ViewEngine | None = None
        self.engine: RolloutEngine | None = None  # vLLM
        self.tp: TensorParallelGeneration | None = None

    def _describe(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.max_positions = getattr(model.config, "max_position_embeddings", None)

    def _ready(self) -> None:
        """After setup: the device the stage's sampling generator lives on, and the engine's name."""
        if self.tp is not None:
            self.follows = not self.tp.leader
            self.generator_device, self.engine_name = self.tp.engine.device, "builtin (tensor parallel)"
        elif self.engine is not None:
            self.generator_device, self.engine_name = self.engine.generator_device, self.engine.name
        else:
            assert self.view is not None
            self.generator_device, self.engine_name = self.view.engine.device, "builtin"

    async def _open_vllm(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, device: str, *,
                         sleep_mode: bool) -> RolloutEngine:
        # vLLM keeps its own weights: the reshard's buckets stream into it. Its engine core runs in a
        # process of its own: this process's default torch.distributed group is the reshard world,
        # and vLLM's worker would make its own.
        ctx = self.ctx
        engine = await ctx.run_sync(open_rollout_engine, ctx, "vllm", self.options.vllm, model, tokenizer, device,
                                    separate_process=True, sleep_mode=sleep_mode)
        ctx.log.info("%s[%d]: vllm rollout engine ready in %.1f s", ctx.spec.name, ctx.worker, engine.startup_s)
        ctx.report_metrics({"engine_startup_s": engine.startup_s})
        return engine

    async def wait_installed(self, need: int) -> None:
        return  # installed by another party: hold waits for it

    @asynccontextmanager
    async def hold(self, need: int) -> AsyncIterator[Rollout]:
        if self.tp is not None:
            async with self.tp.hold(need) as rollout:
                yield rollout
            return
        assert self.weights is not None
        # waits until a new enough version is installed (colocated: through the training phase)
        async with self.weights.use(need) as tensors:
            version = self.weights.version
            assert version is not None
            if self.view is not None:
                yield ViewRollout(self.view, tensors, version)
            else:
                assert self.engine is not None
                yield EngineRollout(self.engine, version)


class ColocatedWeights(_LeasedWeights):
    """Placement colocated: the inference weights the train stage of this process reshards into
    after every optimizer step (:class:`~streamrl.reshard.ColocatedPolicy`). ``engine: vllm``
    attaches the engine to the policy instead, which streams each version into it."""

    async def setup(self) -> None:
        ctx = self.ctx
        shared = colocated_rank(ctx)
        with anyio.fail_after(ctx.config.resources.start_timeout_s):
            await shared.ready.wait()
        if shared.policy is None or shared.groups is None:
            raise ColocatedSetupError(f"the colocated train stage {ctx.spec.colocate_with!r} of this process failed "
                                      f"to set up: {shared.error}")
        self.policy = policy = shared.policy
        # on the train stage's device: this process is one rank of the reshard world
        device = str(policy.engine.device)
        model, tokenizer = build_policy(ctx.config, device)
        self._describe(model, tokenizer)
        self.weights = policy.weights
        if policy.stream_to_engine:
            self.engine = await self._open_vllm(model, tokenizer, device, sleep_mode=True)
            del model
            policy.attach_engine(self.engine)  # type: ignore[arg-type]
            shared.engine_attached.set()
        elif policy.resharder.topology.inference.tensor_parallel == 1:
            self.view = ViewEngine(model, tokenizer, policy.resharder.plan, 0)
        else:
            self.tp = TensorParallelGeneration(ctx, shared.groups, policy.weights, model, tokenizer)
        self._ready()

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


class ReceivedWeights(_LeasedWeights):
    """Placement disaggregated: the versions the train group sends (``weights_from``).

    All R train and G generate processes form one torch.distributed world through a FileStore in
    ``<run_dir>/rendezvous/<train stage>``: generate worker j is world rank R + j, fed by train
    rank j mod R. A background task receives each version (``WeightReceiver``) under the exclusive
    side of the lease, so never under a running forward pass: with ``max_staleness >= 1`` the
    sender may wait for the generation in flight.

    Shutdown: the train stage's ``close`` sends every generation worker the close header; ``close``
    here waits for it (``WeightReceiver.wait_closed``) before it destroys the process group, so no
    receive is left blocked in gloo. If the trainer died instead, it skips the destroy and exits
    (the header wait runs in a daemon thread).
    """

    receiver: WeightReceiver | None = None

    async def setup(self) -> None:
        # imported here: the train stage's module imports this one's (through the agent stage)
        from streamrl.stages.handover import disaggregated_topology
        from streamrl.stages.train import TrainOptions
        from streamrl.stages.world import default_backend, join_world, rank_device

        ctx = self.ctx
        assert ctx.pipeline is not None and ctx.spec.weights_from is not None
        train = ctx.pipeline.stage(ctx.spec.weights_from)
        R, G = train.workers, ctx.spec.workers
        topology = disaggregated_topology(R, ctx.spec)
        # the receiver's bucket plan must be the sender's: both read the train stage's options, through
        # the same type and defaults (checked when the pipeline loads)
        train_options = msgspec.convert(train.options, TrainOptions)
        timeout_s = train_options.collective_timeout_s
        # A generate loop can end (its input is exhausted) while training still runs a few steps and
        # sends their versions; close() takes them for as long as the train group may take a step.
        self.close_wait_s = timeout_s
        backend = train_options.backend or default_backend(ctx.device)
        device = rank_device(ctx.device, R + ctx.worker, R + G, backend)  # generate worker j = world rank R + j
        model, tokenizer = build_policy(ctx.config, device)
        self._describe(model, tokenizer)
        spec = ModelShardingSpec.from_model(model)
        if self.options.engine == "vllm":
            self.engine = await self._open_vllm(model, tokenizer, device, sleep_mode=False)
        groups = await join_world(ctx, train.name, R + ctx.worker, R + G, topology, backend=backend,
                                  timeout_s=timeout_s, device=device)
        # the sender's bucket plan is over its float32 master shards; the wire and these weights carry
        # the rollout's dtype (the cast happens in the sender's slice copy)
        resharder = Resharder(spec, groups, config=ReshardConfig(bucket_bytes=train_options.bucket_bytes),
                              shard_dtype=torch.float32, inference_dtype=next(model.parameters()).dtype,
                              device=device)
        tasks = ctx.tasks  # type: ignore[attr-defined]
        if self.engine is not None:
            del model
            self.receiver = WeightReceiver(resharder, engine=self.engine)
            tasks.start_soon(self.receiver.run)
        else:
            self.receiver = WeightReceiver(resharder)
            if topology.inference.tensor_parallel == 1:
                self.view = ViewEngine(model, tokenizer, resharder.plan, 0)
                tasks.start_soon(self.receiver.run)
            else:
                self.tp = TensorParallelGeneration(ctx, groups, self.receiver.weights, model, tokenizer)
                if self.tp.leader:  # the followers install each version when the leader says so
                    tasks.start_soon(self.receiver.run, self.tp.announce)
        self.weights = self.receiver.weights
        self._ready()

    async def follow(self) -> None:
        assert self.tp is not None and self.receiver is not None
        await self.tp.follow(self.receiver.receive)

    async def close(self) -> None:
        try:
            await self._close_channel()
        finally:
            if self.engine is not None:
                await self.ctx.run_sync(self.engine.close)

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
