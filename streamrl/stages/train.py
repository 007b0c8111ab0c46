"""The train stage: GRPO/PPO clipped objective on torch FSDP2 over the stage's R workers, every placement.

Each of the R workers (``workers: R``; R = 1 is the default) is one rank of an FSDP2 mesh
(:class:`~streamrl.engines.fsdp.FSDPTrainEngine`, any Hugging Face causal LM) and claims its own
share of every step, ``batch_size / R`` samples, in micro-batches of the same sizes on every rank
(each forward/backward is a collective, so every rank runs the same number of them). A step:

    for each micro-batch of my share:          # as the dock hands it over
        engine.accumulate(micro_batch)          # forward + backward, unnormalised sum
    engine.step()                               # counts summed over ranks, divide, clip, AdamW
    hand_over.publish(version + 1)              # how the version reaches generation

Normalisation is exact across ranks: the engine backpropagates sums and divides by the step's
token / sequence count summed over the ranks, so R ranks give the update one rank gives on the
same samples. With ``algo.dynamic_sampling.token_budget`` a step's size varies instead: every
replica claims micro-batches of the same size, and after each one the ranks sum the step's
response tokens (one all-reduce) and step together once it reaches the budget, so the shares stay
equal across ranks and every sample still lands in exactly one step.

With ``options.rollout`` (``pipelines/grpo_sync.yaml``) the stage makes its samples itself: it
claims the source's prompts, runs its rollout links on each micro-batch in this process (generate,
score, advantage, as a chain stage's links: :mod:`streamrl.stages.chain`), the generate link on the
module it trains, then trains on them. A synchronous step then crosses no process boundary between
generation and training: one worker, ``max_staleness: 0``, the built-in engine.

The placement decides only the hand-over (:mod:`streamrl.stages.handover`): ``separate``
publishes full snapshots on the policy channel, ``colocated`` reshards into this process's
inference weights and swaps the training state out, ``disaggregated`` streams buckets to
separate generation workers. In the colocated placement the micro-batches wait until every
rank has its share (generation on this rank may still feed the others) and train then.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import msgspec
import torch
import torch.distributed as dist
from msgspec import Meta

from streamrl.config import ConfigError, RunConfig
from streamrl.engines.samples import samples_from_columns
from streamrl.engines.schedule import lr_scheduler
from streamrl.metrics.trace import tracer
from streamrl.reshard import DaemonCall
from streamrl.runtime.checkpoints import (
    ResumeFrom,
    RunState,
    TrainedKeys,
    commit_sealed,
    partial_dir,
    rng_state,
    seal,
    set_rng_state,
    start_partial,
    write_json,
)
from streamrl.runtime.host_memory import MAX_MMAP_THRESHOLD, set_mmap_threshold
from streamrl.runtime.pipeline import PipelineSpec, StageSpec, class_says, import_stage_class
from streamrl.runtime.stage import Batch, ClaimSize, StageContext, StopRun
from streamrl.stages.chain import ChainOptions, ChainStage, link_specs
from streamrl.stages.common import StepTally, build_policy, source_runs_ahead, step_claim
from streamrl.stages.handover import HandOver, hand_over_for
from streamrl.stages.replica import ReplicaChannel
from streamrl.stages.weight_source import TRAINER_POLICY, TrainerPolicy
from streamrl.stages.world import default_backend, join_world, rank_device

T = TypeVar("T")
log = logging.getLogger("streamrl.stage.train")

STOP_WAIT_S = 10.0  # how long a TP leader tries to release its followers when stopped from outside


class TrainOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the train stage (streamrl.stages.train:TrainStage): torch FSDP2 over the
    stage's workers (streamrl/engines/fsdp.py), and how each version reaches generation."""

    tensor_parallel: Annotated[int, Meta(description=(
        "Train tensor parallelism: workers per model replica (DTensor); data parallel = workers / this"))] = 1
    activation_checkpointing: Annotated[bool, Meta(description=(
        "Recompute each decoder layer in backward: less memory, about 1/3 more compute"))] = False
    cpu_offload: Annotated[bool, Meta(description=(
        "Keep sharded parameters, gradients and AdamW moments in host memory (FSDP2 CPUOffloadPolicy)"))] = False
    bucket_bytes: Annotated[int, Meta(description=(
        "Placements colocated and disaggregated: reshard bucket cap (bytes), the peak transient memory of one "
        "reshard per rank"))] = 64 * 2**20
    swap: Annotated[bool, Meta(description=(
        "Placement colocated: move the training state to host memory while generating"))] = True
    collective_timeout_s: Annotated[float, Meta(description=(
        "Seconds a rank waits in a collective for the others"))] = 600.0
    backend: Annotated[str | None, Meta(description=(
        "torch.distributed backend (gloo, nccl, hccl); null: gloo on CPU, nccl on CUDA, hccl on NPU"))] = None
    mmap_threshold_bytes: Annotated[int | None, Meta(description=(
        "Host memory (glibc): serve every allocation of at least this many bytes from its own mapping, "
        "returned to the OS when freed, e.g. 1048576. Lowers the worker's peak resident memory by the "
        "C heap's fragmentation, for page faults on every such allocation (slower on small models); "
        "null keeps the workers' default (blocks below 32 MiB from a heap that keeps freed memory for the next "
        "step, streamrl.runtime.host_memory). Figures: docs/benchmarks.md §15, §44"))] = None
    rollout: Annotated[ChainOptions | None, Meta(description=(
        "Make the samples in this process: {links: [...]} as a chain stage's (generate, score, advantage), run on "
        "each claimed micro-batch of prompts before training on it, the generate link on the module this stage "
        "trains. A synchronous step then has no hand-over between processes (pipelines/grpo_sync.yaml). One "
        "worker, algo.max_staleness 0, the built-in engine; the stage reads the prompts' columns"))] = None


# torch.distributed backends and the device kind each needs
_BACKENDS = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


class TrainStage:
    """Options (:class:`TrainOptions`): ``activation_checkpointing``,
    ``cpu_offload`` (the engine); ``bucket_bytes``, ``swap``, ``collective_timeout_s``, ``backend``
    (the world and the hand-over); ``mmap_threshold_bytes`` (the worker's C heap)."""

    Options = TrainOptions  # checked when the pipeline loads
    publishes_policy = True  # worker 0 serves the policy channel (streamrl.runtime.pipeline.is_trainer)
    uses_model_and_task = True  # the pre-run checks load the run's model and task (streamrl.runtime.prerun)

    @staticmethod
    def generates(spec: StageSpec) -> bool:
        """With ``options.rollout``: the pre-run checks then fit prompt + completion to the model."""
        return spec.options.get("rollout") is not None

    @staticmethod
    def claims_one_step(spec: StageSpec) -> bool:
        """With ``options.rollout`` each claim takes one step's prompts, so the source puts a step's
        prompts while the step before trains (:func:`streamrl.stages.common.source_runs_ahead`)."""
        return spec.options.get("rollout") is not None

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        """Before anything starts (``validate_pipeline``): the options' values, sample keys for
        checkpoints, and how every step's samples split over the workers and their worlds."""
        at = f"{pipeline.where}: stage {spec.name!r}"
        opts = msgspec.convert(spec.options, TrainOptions)  # its schema is checked already
        _check_option_values(opts, f"{at} options")
        if cfg.output.checkpoint_every and cfg.algo.max_staleness > 0 and "sample_key" not in spec.reads:
            # without keys a checkpoint cannot say which samples in flight it has trained on
            raise ConfigError(f"{pipeline.where}: output.checkpoint_every with algo.max_staleness > 0 needs the train "
                              "stage to read 'sample_key' (and the source to write it), so that a resume neither "
                              "repeats nor loses a sample: add sample_key to both, as pipelines/grpo.yaml does")
        if cfg.algo.dynamic_sampling.enabled and "sample_key" not in spec.reads:
            # a step's samples are no longer one source step: only their keys say which were trained
            raise ConfigError(f"{at}: algo.dynamic_sampling needs the train stage to read 'sample_key' (and the "
                              "source to write it), as pipelines/dapo.yaml does")
        tp, batch = opts.tensor_parallel, cfg.batch_size
        if spec.workers % tp:
            raise ConfigError(f"{at}: options.tensor_parallel={tp} must divide workers={spec.workers} (each "
                              "model replica is tensor_parallel workers)")
        if tp > 1 and pipeline.placement == "disaggregated":
            raise ConfigError(f"{at}: options.tensor_parallel={tp}: train tensor parallelism is built for "
                              "placement separate and colocated, not disaggregated; set it to 1")
        replicas = spec.workers // tp
        if batch % replicas:
            over = f"workers={spec.workers}" if tp == 1 else f"{replicas} model replicas (workers / tensor_parallel)"
            raise ConfigError(f"{at}: algo.prompts_per_step x algo.group_size = {batch} samples per step must "
                              f"divide evenly over its {over}; change one of them")
        if spec.workers > 1 and cfg.resources.launch == "inprocess":
            raise ConfigError(f"{at}: workers={spec.workers} train as one torch.distributed group, one process "
                              "each; it needs resources.launch: processes or ray (not inprocess)")
        if pipeline.placement != "separate" and pipeline.weights_receiver(spec.name) is None:
            link = "colocate_with" if pipeline.placement == "colocated" else "weights_from"
            raise ConfigError(f"{at}: no stage says `{link}: {spec.name}`, so its policy versions reach no "
                              f"generate stage; add `{link}: {spec.name}` to the generate stage")
        _check_reshard_world(pipeline, spec, cfg, at)
        if opts.rollout is not None:
            _check_rollout(spec, pipeline, cfg, at)

    @classmethod
    def step_samples(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> int:
        """Samples of each step one worker claims: its model replica's share."""
        tp = msgspec.convert(spec.options, TrainOptions).tensor_parallel
        return cfg.batch_size // (spec.workers // tp)

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        try:
            await self._setup(ctx)
        except BaseException as exc:
            hand_over = getattr(self, "hand_over", None)
            if hand_over is not None:
                hand_over.setup_failed(exc)  # colocated: the generate stage of this process waits for it
            raise

    async def _setup(self, ctx: StageContext) -> None:
        # the engine is the workers' alone: the launcher imports this module only for its checks
        from torch.distributed.device_mesh import DeviceMesh

        from streamrl.engines.fsdp import FSDPOptions, FSDPTrainEngine

        cfg, a = ctx.config, ctx.config.algo
        self.R, self.rank = ctx.spec.workers, ctx.worker
        if cfg.batch_size % self.R:
            raise ValueError(f"prompts_per_step x group_size = {cfg.batch_size} samples per step must divide "
                             f"evenly over the train stage's workers={self.R}")
        self.options = msgspec.convert(ctx.options, TrainOptions)
        if self.options.mmap_threshold_bytes is not None:  # before the model's first allocation
            set_mmap_threshold(self.options.mmap_threshold_bytes)
        # R = replicas x tp; the tp ranks of a replica train on the same samples (streamrl/stages/replica.py)
        self.tp = self.options.tensor_parallel
        self.per_rank = cfg.batch_size // (self.R // self.tp)
        self.follows = self.rank % self.tp != 0  # the runtime then runs follow() instead of claiming
        self.channel: ReplicaChannel | None = None
        self._receiving: DaemonCall[tuple[dict[str, list[Any]], list[int]] | None] | None = None
        self.hand_over: HandOver = hand_over_for(ctx, self.options)
        backend = self.options.backend or default_backend(ctx.device)
        world_size = self._world_size()
        self.device = rank_device(ctx.device, self.rank, world_size, backend)  # train worker k = world rank k
        self.groups = await join_world(ctx, ctx.spec.name, self.rank, world_size, self.hand_over.topology(),
                                       backend=backend, timeout_s=self.options.collective_timeout_s,
                                       device=self.device)
        model, self.tokenizer = build_policy(cfg, self.device, for_training=True)
        options = FSDPOptions(dtype=cfg.model.dtype, tensor_parallel=self.tp,
                              activation_checkpointing=self.options.activation_checkpointing,
                              cpu_offload=self.options.cpu_offload)

        # the train ranks' group (checkpoints are collective among them): the world, except when
        # the disaggregated placement's generate workers are in it too
        self.train_group: dist.ProcessGroup | None = None

        def build() -> FSDPTrainEngine:  # collective (the mesh, the sharding): in a thread
            mesh = None  # separate, colocated: the world is the train group, the engine meshes all of it
            if world_size > self.R:
                # disaggregated: the generate workers follow in the world; mesh the train ranks only
                # (local synchronisation: the generate ranks take no part in creating the group)
                group = dist.new_group(list(range(self.R)), use_local_synchronization=True)
                self.train_group = group
                mesh = DeviceMesh.from_group(group, torch.device(self.device).type, mesh_dim_names=("dp",))
            return FSDPTrainEngine(model, lr=a.lr, betas=(a.betas[0], a.betas[1]), weight_decay=a.weight_decay,
                                   max_grad_norm=a.max_grad_norm, device=self.device, mesh=mesh, options=options)

        self.engine = await ctx.run_sync(build)
        self.lr_schedule = lr_scheduler(self.engine.optimizer, a)  # stepped after each optimizer step
        if self.tp > 1:
            tp_mesh = self.engine.tp_mesh
            assert tp_mesh is not None
            self.channel = ReplicaChannel(tp_mesh.get_group(), self.rank - self.rank % self.tp)
        self.loss_config = msgspec.structs.replace(a.loss, temperature=a.temperature,
                                                   norm_tokens=a.loss.norm_tokens or a.max_new_tokens)
        self.version = 0
        self.with_keys = "sample_key" in ctx.spec.reads  # which samples a checkpoint has trained on
        self.dynamic_sampling = a.dynamic_sampling.enabled
        self.token_budget = a.dynamic_sampling.token_budget  # response tokens per step over the ranks; 0: per_rank samples
        self.trained = TrainedKeys()
        self.repeated_samples = 0  # samples trained on more than once (sample_key): must stay 0
        if ctx.resume is not None:
            await ctx.run_sync(self._load, ctx.resume)
        await self.hand_over.start(self)  # the initial policy: version 0, or the checkpoint's
        self.rollout: ChainStage | None = None
        self.policy: TrainerPolicy | None = None
        chain = rollout_spec(ctx.spec)
        if chain is not None:
            await self._setup_rollout(ctx, chain)
        self._reset()
        self.t_step = time.monotonic()

    async def _setup_rollout(self, ctx: StageContext, chain: StageSpec) -> None:
        """``options.rollout``: a built-in rollout engine on the policy this stage trains (the module
        itself where the engine trains it unwrapped in float32, else a copy installed after each step), lent to
        the generate link; the links as a chain of this process."""
        import dataclasses

        from streamrl.engines.rollout import TorchRolloutEngine

        # on the trained module itself where every forward computes on its parameters (each update is
        # then the next generation's policy); on a copy where they are DTensor shards or cast per forward
        self.copies_policy = not self.engine.forwards_on_its_parameters
        model, tokenizer = (build_policy(ctx.config, self.device) if self.copies_policy
                            else (self.engine.model, self.tokenizer))
        rollout = TorchRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, self.device)
        self.policy = TrainerPolicy(rollout, tokenizer, getattr(model.config, "max_position_embeddings", None),
                                    self.version)
        if self.copies_policy:
            await ctx.run_sync(self._install_policy)
        ctx.shared[TRAINER_POLICY] = self.policy
        # one step's prompts a claim where the source puts them ahead (always, without dynamic sampling)
        self.claims_one_reserve = source_runs_ahead(ctx.config, ctx.pipeline)
        # Claimed and fetched while the micro-batch before trains (the runtime's prefetching loop, for
        # a stage without claim_size): every claim is the micro-batch or the rest of one step's
        # prompts (one reserve), so no claim spans two steps, and its prompts are generated once the
        # step before has trained, with the version they need.
        self.claim_size = None  # type: ignore[assignment]
        # its ack is not waited for: the next batch (the next step's prompts) is the critical path
        self.acks_in_background = True
        self.rollout = ChainStage()
        await self.rollout.setup(dataclasses.replace(ctx, spec=chain))
        self.rollout_reads = chain.reads

    def _install_policy(self) -> None:
        """Where the rollout engine holds a copy: the current weights into it."""
        assert self.policy is not None
        self.policy.engine.load_state_dict(self.engine.full_state_dict(copy=False))

    def _world_size(self) -> int:
        return self.hand_over.world_size()

    def _load(self, resume: ResumeFrom) -> None:
        """Continue from a checkpoint (collective): weights, AdamW, LR schedule, RNG, version."""
        from streamrl.engines.checkpoint import load_checkpoint

        path, st = Path(resume.path), resume.state
        load_checkpoint(self.engine, path / "train", self.train_group)
        self.lr_schedule.load_state_dict(st.lr_schedule)
        rng = path / "rng" / f"train-{self.rank}.json"
        if rng.is_file():  # a resume at another world size: the new ranks keep their seeds
            set_rng_state(msgspec.json.decode(rng.read_bytes()))
        self.version = st.version
        self.trained = TrainedKeys(st.trained_below, st.trained_extra)
        log.info("train[%d]: resumed from %s at version %d", self.rank, path, self.version)

    def _train_barrier(self) -> None:
        if self.R > 1:
            dist.barrier(group=self.train_group)

    def _save(self, reason: str) -> None:
        """A resumable checkpoint of this version, sealed under its ``.partial`` name (collective
        among the train ranks; between steps). Rank 0 commits it once the launcher has recorded
        the step (:meth:`_commit`)."""
        from streamrl.engines.checkpoint import save_checkpoint

        cfg = self.ctx.config
        run_dir = self.ctx.run_dir
        if self.rank == 0:
            start_partial(run_dir, self.version)
        self._train_barrier()  # the directory exists before anyone writes into it
        partial = partial_dir(run_dir, self.version)
        write_json(partial / "rng" / f"train-{self.rank}.json", rng_state())
        save_checkpoint(self.engine, partial / "train", self.train_group)
        self._train_barrier()  # every rank's shards are written
        if self.rank != 0:
            return
        state = RunState(version=self.version, batch_size=cfg.batch_size, group_size=cfg.algo.group_size,
                         trained_below=self.trained.below, trained_extra=self.trained.sorted_extra(),
                         lr_schedule=self.lr_schedule.state_dict(), train_ranks=self.R, saved_at=time.time(),
                         reason=reason)
        seal(run_dir, self.version, state)

    async def _commit(self) -> None:
        """Rank 0, after reporting the step with ``record``: rename the sealed checkpoint into
        place once the launcher has the step's row in metrics.jsonl. A launcher killed before that
        leaves only the ``.partial`` directory (a resume ignores it), so a resume never starts from
        a step whose row is missing: every step's row is in metrics.jsonl exactly once."""
        # Shielded: at the run's end another rank's StopRun can make the launcher send Stop while
        # this waits; the answer still comes (the wait after a Stop is bounded: RECORDED_AFTER_STOP_S)
        with anyio.CancelScope(shield=True):
            if not await self.ctx.wait_recorded(self.version):
                log.warning("train[%d]: the run stopped before the launcher recorded step %d; its checkpoint "
                            "stays uncommitted", self.rank, self.version)
                return
            await self.ctx.run_sync(commit_sealed, self.ctx.run_dir, self.version,
                                    self.ctx.config.output.keep_checkpoints)

    def _record_trained(self, keys: list[int]) -> None:
        """The samples of the step just taken (every rank's share; collective over the dp ranks)."""
        B = self.ctx.config.batch_size
        if not self.with_keys:  # synchronous (checked): step v trained exactly source step v - 1
            self.trained.add_range((self.version - 1) * B, self.version * B)
            return
        t = torch.tensor(keys, dtype=torch.int64)
        if self.engine.dp_size > 1:  # every dp rank holds per_rank keys: equal sizes
            parts = [torch.empty_like(t) for _ in range(self.engine.dp_size)]
            dist.all_gather(parts, t, group=self.engine.dp_mesh.get_group())
            t = torch.cat(parts)
        got = t.tolist()
        # a sample trained twice (it should never happen: the dock leases each once, a resume skips
        # what the checkpoint trained) is counted where everyone sees it: the metrics
        repeated = sum(1 for k in got if k in self.trained) + len(got) - len(set(got))
        if repeated:
            log.error("train: %d samples of step %d were trained on before", repeated, self.version)
        self.repeated_samples += repeated
        self.trained.add(got)
        a = self.ctx.config.algo
        if self.dynamic_sampling and a.max_staleness == 0 and got:
            # Synchronous dynamic sampling: the step ends once the filter has judged every group the
            # source made and the last wave was kept whole (streamrl.stages.source), so every key up to
            # the end of the newest group trained here is consumed: trained, or dropped by the filter.
            self.trained.add_range(self.trained.below, (max(got) // a.group_size + 1) * a.group_size)

    def _reset(self) -> None:
        self.tally = StepTally()
        self.pending: list[dict[str, Any]] = []  # colocated: this rank's share, trained once all shares are in

    def claim_size(self) -> ClaimSize:
        # every rank claims the same sizes in the same order, so every rank runs the same number
        # of forward/backward collectives per step
        # (a token budget: micro-batches of the same size until the step's tokens reach it)
        remaining = self.per_rank if self.token_budget else self.per_rank - self.tally.consumed
        return step_claim(self.ctx.spec.micro_batch, remaining, self.version, self.ctx.config.algo.max_staleness)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        if self.rollout is not None:
            # the samples made here: the prompts' columns and what the links wrote, at the
            # version that generated them (this stage's own)
            out = await self.rollout.process(Batch(batch.samples, {c: batch.columns[c] for c in self.rollout_reads}))
            await self._take({**batch.columns, **out.columns}, list(out.versions or batch.versions))
            return {}
        if self.channel is not None:  # the replica's other ranks train on it too
            await self.ctx.run_sync(self.channel.send, batch.columns, list(batch.versions))
        await self._take(dict(batch.columns), list(batch.versions))
        return {}

    async def follow(self) -> None:
        """A TP follower: train on what the replica's rank 0 claims until the run stops (the
        same step figures make every rank raise StopRun at the same step) or it says stop."""
        assert self.channel is not None
        channel = self.channel
        while True:
            # kept across a cancellation (the launcher's Stop): close() waits for the same receive
            if self._receiving is None:
                self._receiving = DaemonCall(channel.receive, "streamrl-train-replica")
            received = await self._receiving.wait()
            self._receiving = None
            if received is None:
                return
            await self._take(*received)

    async def _take(self, cols: dict[str, Any], versions: list[int]) -> None:
        if self.hand_over.trains_on_arrival:
            await self.ctx.run_sync(self._accumulate, cols)
        else:
            self.pending.append(cols)
        self.tally.add(cols, versions, self.version)
        if self.token_budget:
            # every rank takes one micro-batch per round, so every rank is in this all-reduce as often
            (tokens,) = await self._reduced([float(self.tally.loss_tokens)])
            if tokens >= self.token_budget:
                await self._step()
        elif self.tally.consumed >= self.per_rank:
            await self._step()

    def _accumulate(self, cols: dict[str, Any]) -> None:
        """Forward + backward of one micro-batch (collective)."""
        a = self.ctx.config.algo
        if a.old_logprobs == "recompute":
            cols["old_logprobs"] = self.engine.logprobs(cols["prompt_ids"], cols["response_ids"], a.temperature)
        self.engine.accumulate(samples_from_columns(cols), self.loss_config)

    async def _over_dp(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, a call collective over the dp ranks: in the compute thread where there is a
        collective to wait for, here where there is none (one dp rank: a thread hop would cost more
        than the call)."""
        if self.engine.dp_size == 1:
            return fn(*args)
        return await self.ctx.run_sync(fn, *args)

    async def _reduced(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
        """``values`` reduced over the dp ranks (:meth:`_all_reduce`)."""
        return await self._over_dp(self._all_reduce, values, op)

    def _all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.engine.dp_size > 1:  # the tp ranks of a replica hold the same samples: dp only
            dist.all_reduce(t, op=op, group=self.engine.dp_mesh.get_group())
        return t.tolist()

    async def _step(self) -> None:
        t0 = time.perf_counter()
        tally = self.tally
        # the reward figures: every sample the policy generated for the step, also those the
        # dynamic-sampling filter dropped (they are not trained on)
        r = tally.rewards + tally.dropped_rewards
        # Returns once every rank has its whole share of the step; in the colocated placement that
        # is also when all the generation this step waits for is done.
        (r_sum, r_sq, r_n, n_dropped, g_seq_tok, st_sum) = await self._reduced(
            [sum(r), sum(x * x for x in r), float(len(r)), float(len(tally.dropped_rewards)),
             float(tally.sequence_tokens), float(sum(tally.staleness))])
        # a save asked for (SIGTERM) reaches the ranks at different moments: agree on it here
        asked = 1.0 if self.ctx.control.save_reason is not None else 0.0
        r_max, r_min = (max(r), min(r)) if r else (-math.inf, math.inf)
        (st_max, save_asked, r_max, neg_r_min) = await self._reduced(
            [float(max(tally.staleness, default=0)), asked, r_max, -r_min], dist.ReduceOp.MAX)
        uniform = 0.0
        if self.dynamic_sampling:  # groups of 2+ samples on this rank whose rewards are all equal
            groups: dict[int, list[float]] = {}
            for key, reward in zip(tally.sample_keys, tally.rewards, strict=True):
                groups.setdefault(key // self.ctx.config.algo.group_size, []).append(reward)
            (uniform,) = await self._reduced(
                [float(sum(len(rs) > 1 and min(rs) == max(rs) for rs in groups.values()))])
        t_barrier = time.perf_counter()
        before = await self.hand_over.before_train()
        t_ready = time.perf_counter()
        for cols in self.pending:
            await self.ctx.run_sync(self._accumulate, cols)
        # one rank: the optimizer step is local compute, on the event loop where it is brief
        stats = await self.ctx.run_brief(self.engine.step, local=self.R == 1)
        self.lr_schedule.step()
        t_train = time.perf_counter()
        self.version += 1
        await self._over_dp(self._record_trained, tally.sample_keys)
        reason = self._stop_reason(r_sum / max(r_n, 1.0))
        out = self.ctx.config.output
        if save_asked:
            reason = (f"stopped on request after saving step {self.version} "
                      f"(resume: streamrl run --resume {self.ctx.run_dir})")
        if reason is not None and out.checkpoint:
            # every rank is here together, with the training state on its device: export (collective)
            await self.ctx.run_sync(self.engine.export_pretrained, self.ctx.run_dir / "checkpoint", self.tokenizer)
        t_save = time.perf_counter()
        saves = bool(save_asked or (out.checkpoint_every and self.version % out.checkpoint_every == 0))
        if saves:  # sealed, committed once the launcher has recorded the step (below)
            await self.ctx.run_sync(self._save, "sigterm" if save_asked else "periodic")
        save_s = time.perf_counter() - t_save
        t_publish = time.perf_counter()
        weight_metrics = await self.hand_over.publish(self.version)
        if self.policy is not None:  # options.rollout: the next batch generates with this version
            if self.copies_policy:
                await self.ctx.run_sync(self._install_policy)
            self.policy.version = self.version
        t_end = time.perf_counter()
        self._trace_step(t0, t_barrier, t_ready, t_train, t_save if saves else None, save_s, t_publish, t_end)
        now = time.monotonic()
        wall = max(now - self.t_step, 1e-9)
        self.t_step = now
        n = max(stats["sequences"], 1.0)
        tokens = stats["tokens"]
        mean = r_sum / max(r_n, 1.0)
        if math.isfinite(r_max):  # a float sum's rounding can put the mean of equal rewards a hair outside them
            mean = min(max(mean, -neg_r_min), r_max)
        var = (r_sq - r_n * mean * mean) / (r_n - 1) if r_n > 1 else 0.0
        metrics = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(var, 0.0)),
            # the range of the step's rewards (what bounds the report's ±std band)
            **({"reward_min": -neg_r_min, "reward_max": r_max} if math.isfinite(r_max) else {}),
            "loss": stats["loss"],
            "kl": stats.get("kl", stats["approx_kl"]),
            "clip_fraction": stats["clip_fraction"],
            "entropy": stats["entropy"],
            "grad_norm": stats["grad_norm"],
            "lr": stats["lr"],  # the step's learning rate (algo.lr_schedule)
            "samples_per_s": n / wall,
            "tokens_per_s": tokens / wall,
            "response_len_mean": tokens / n,
            "response_tokens": tokens,
            "sequence_tokens": g_seq_tok,
            "staleness_mean": st_sum / n,
            "staleness_max": st_max,
            "micro_batches": stats["micro_batches"],
            "samples": stats["sequences"],  # trained on in this step (every rank's share)
            "step_time_s": wall,
            "wait_other_ranks_ms": (t_barrier - t0) * 1e3,
            "train_ms": (t_train - t_ready) * 1e3,
            "hand_over_ms": (t_end - t_train - save_s) * 1e3,
            "checkpoint_s": save_s,
            **before,
            **weight_metrics,
        }
        if "is_weight" in stats:
            metrics["is_weight"] = stats["is_weight"]
        if self.dynamic_sampling:
            metrics["dropped_samples"] = n_dropped  # judged uninformative by the filter, arrived with this step
            metrics["uniform_groups"] = uniform  # trained groups whose rewards are all equal: the filter's job is 0
        if self.with_keys:
            metrics["repeated_samples"] = self.repeated_samples
        if self.rank == 0:
            # the row takes the stages' figures measured before the version was visible: not the
            # next step's, which may already be running (streamrl.metrics.stage_figures)
            self.ctx.report_step(self.version, metrics, record=saves, ended_at=self.hand_over.visible_at)
            if saves:
                await self._commit()
        self._reset()
        if reason is not None:  # every rank sees the same global figures, so every rank stops here
            self.stopped = True
            raise StopRun(reason)

    def _trace_step(self, t0: float, t_barrier: float, t_ready: float, t_train: float, t_save: float | None,
                    save_s: float, t_publish: float, t_end: float) -> None:
        """The step just taken as spans of this worker's trace, and its new policy version."""
        trace = tracer()
        if not trace.enabled:
            return
        v = self.version
        trace.complete("optimizer step", "batch", t0, t_end, "train", version=v)
        if self.R > 1:
            trace.complete("wait other ranks", "batch", t0, t_barrier, "train")
        if not self.hand_over.trains_on_arrival:  # colocated: the training state swapped in
            trace.complete("before train", "batch", t_barrier, t_ready, "train")
        trace.complete("train", "batch", t_ready, t_train, "train", version=v)
        if t_save is not None:
            trace.complete("checkpoint", "batch", t_save, t_save + save_s, "train", version=v)
        trace.complete("publish", "batch", t_publish, t_end, "policy", version=v)
        trace.counter("policy version", v)

    def _stop_reason(self, reward_mean: float) -> str | None:
        a = self.ctx.config.algo
        if a.stop_reward is not None and reward_mean >= a.stop_reward:
            return f"reward {reward_mean:.3f} >= stop_reward {a.stop_reward} at step {self.version}"
        if self.version >= a.steps:
            return f"completed {a.steps} steps"
        return None

    async def close(self) -> None:
        rollout = getattr(self, "rollout", None)
        if rollout is not None:  # its links first: the generate link generates on this stage's engine
            await rollout.close()
        channel = getattr(self, "channel", None)
        if channel is not None and not self.follows and not getattr(self, "stopped", False):
            # stopped from outside (another stage failed): release followers waiting for a micro-batch
            with anyio.move_on_after(STOP_WAIT_S):
                await DaemonCall(channel.send_stop, "streamrl-train-replica-stop").wait()
        receiving = getattr(self, "_receiving", None)
        if receiving is not None:
            # a follower stopped from outside: its leader's stop message ends the receive (bounded)
            with anyio.move_on_after(STOP_WAIT_S), contextlib.suppress(Exception):
                await receiving.wait()
        hand_over = getattr(self, "hand_over", None)
        if hand_over is not None:
            await hand_over.close()
        if receiving is not None and receiving.running:
            # still blocked in a broadcast: destroying the group under it could hang; exit cleans up
            log.warning("train[%d]: no stop from TP rank 0 within %.0f s; leaving the process group",
                        self.rank, STOP_WAIT_S)
            return
        if dist.is_initialized():
            dist.destroy_process_group()


def rollout_spec(spec: StageSpec) -> StageSpec | None:
    """The chain a train stage with ``options.rollout`` runs on each claimed micro-batch: its links,
    reading what they read of the stage's reads, with the stage's workers, micro-batch, device,
    threads and claim of whole groups; None without ``options.rollout``."""
    rollout = spec.options.get("rollout")
    if rollout is None:
        return None
    links = msgspec.convert(rollout, ChainOptions).links
    return StageSpec(name=spec.name, cls=f"{ChainStage.__module__}:{ChainStage.__name__}",
                     reads=[c for c in spec.reads if any(c in link.reads for link in links)],
                     writes=[c for link in links for c in link.writes], workers=spec.workers,
                     micro_batch=spec.micro_batch, device=spec.device, threads=spec.threads,
                     whole_groups=spec.whole_groups, options=dict(rollout))


def _check_rollout(spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig, at: str) -> None:
    """``options.rollout``: a one-process synchronous step, and links that make what training reads."""
    at = f"{at} options.rollout"
    a = cfg.algo
    for ok, why in (
        (pipeline.placement == "separate", f"generates on this stage's own module, so the pipeline's placement must "
                                           f"be separate (it says {pipeline.placement!r})"),
        (spec.workers == 1, f"trains and generates in one process: workers must be 1 (it says {spec.workers}); for "
                            "several ranks that take turns generating and training use placement colocated "
                            "(pipelines/grpo_colocated.yaml)"),
        (a.max_staleness == 0, f"generates each step's samples with the policy it is about to train, so it is "
                               f"synchronous only: algo.max_staleness must be 0 (it is {a.max_staleness}); to let "
                               "generation run ahead, generate in a stage of its own (pipelines/grpo_rollout.yaml)"),
        (not a.dynamic_sampling.enabled, "makes exactly one step's samples a step: algo.dynamic_sampling needs a "
                                         "filter between generation and training (pipelines/dapo_rollout.yaml)"),
        (spec.options.get("tensor_parallel", 1) == 1, "generates on a whole model: tensor_parallel must be 1"),
    ):
        if not ok:
            raise ConfigError(f"{at}: {why}")
    chain = rollout_spec(spec)
    assert chain is not None
    links = link_specs(chain)
    generating = [k for k, link in enumerate(links) if class_says(import_stage_class(link.cls), "generates", link)]
    if len(generating) != 1:
        raise ConfigError(f"{at}.links: exactly one link must generate (streamrl.stages.generate:GenerateStage); "
                          f"found {len(generating)}")
    engine = links[generating[0]].options.get("engine", "builtin")
    if engine != "builtin":
        raise ConfigError(f"{at}.links[{generating[0]}].options.engine: the link generates on the module this "
                          f"stage trains, with the built-in engine, not {engine!r}; for vLLM generate in a stage "
                          "of its own (pipelines/grpo_rollout.yaml)")
    written = set(chain.writes)
    both = sorted(written & set(spec.reads))
    if both:  # (a stage of the pipeline writes it too, or the pipeline's check would have said so)
        raise ConfigError(f"{at}: the links write {both}, which the stage also reads from the dock; remove them "
                          "from the stage's reads")
    for col in ("prompt_ids", "response_ids", "advantage"):  # what training needs (samples_from_columns)
        if col not in written and col not in spec.reads:
            raise ConfigError(f"{at}: training needs {col!r}, which neither the stage reads nor a link writes")
    ChainStage.check_spec(chain, msgspec.structs.replace(pipeline, path=at), cfg)


def _check_option_values(opts: TrainOptions, at: str) -> None:
    if opts.tensor_parallel < 1:
        raise ConfigError(f"{at}.tensor_parallel must be >= 1 (workers per model replica), got "
                          f"{opts.tensor_parallel}")
    if opts.mmap_threshold_bytes is not None and not 0 < opts.mmap_threshold_bytes <= MAX_MMAP_THRESHOLD:
        raise ConfigError(f"{at}.mmap_threshold_bytes must be in 1..{MAX_MMAP_THRESHOLD} (glibc's limit), or null, "
                          f"got {opts.mmap_threshold_bytes}")
    if opts.bucket_bytes < 1:
        raise ConfigError(f"{at}.bucket_bytes must be >= 1 (bytes), got {opts.bucket_bytes}")
    if not opts.collective_timeout_s > 0:
        raise ConfigError(f"{at}.collective_timeout_s must be > 0 seconds, got {opts.collective_timeout_s}")
    if opts.backend is not None and opts.backend not in _BACKENDS:
        raise ConfigError(f"{at}.backend must be one of {list(_BACKENDS)} (or left out), got {opts.backend!r}")


def _check_reshard_world(spec: PipelineSpec, train: StageSpec, cfg: RunConfig, at: str) -> None:
    """nccl/hccl need one device per rank of the reshard world (train + disaggregated generate)."""
    from streamrl.models.device import DeviceUnavailableError, resolve_device

    receiver = spec.weights_receiver(train.name)
    world = train.workers + (receiver.workers if receiver is not None and receiver.weights_from else 0)
    device = train.device or cfg.resources.device
    try:
        kind = resolve_device(device).type
    except (DeviceUnavailableError, ValueError):
        return  # the device check names it
    backend = train.options.get("backend") or {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")
    need = _BACKENDS.get(str(backend))
    if need not in (None, "cpu") and need != kind:
        raise ConfigError(f"{at} options.backend: {backend!r} needs {need} devices, but the stage runs on "
                          f"{device!r}; use backend: gloo, or device: {need}")
    if need in ("cuda", "npu"):
        count = int(getattr(torch, need).device_count())
        if world > count:
            raise ConfigError(f"{at}: {world} reshard ranks (train + generation workers) but {count} {need} "
                              f"device(s): {backend} needs one device per rank; use fewer workers, or "
                              "options.backend: gloo")
