"""GRPO training in the sharded layout over a train group of R processes, for both reshard placements.

The colocated trainer (:mod:`streamrl.stages.colocated`: the same processes alternate generation
and training) and the disaggregated one (:mod:`streamrl.stages.disaggregated`: the train group
sends each version to separate generation workers) share everything but the weight hand-over:

- joining a torch.distributed world through a FileStore in ``<run_dir>/rendezvous/<train stage>``
  (rank = train worker index; a disaggregated world adds the generation workers after them);
- :class:`~streamrl.reshard.ShardedTrainEngine` (parameters, gradients and AdamW moments sharded
  over the R ranks, gradients reduce-scattered) with the GRPO loss of :mod:`streamrl.algos.grpo`;
- claims of ``batch_size / R`` samples a step, in the same sizes on every rank (each micro-batch is
  a collective, so every rank must run the same number of them);
- all-reduced step figures, so every rank reports and stops alike;
- rank 0 serves version numbers to the source (``PolicyPublisher`` with no weights: in these
  placements weights never travel through it) and reports the step metrics.

What differs is a few hooks of :class:`ShardedGrpoTrainer`: ``_start_weights`` (version 0),
``_accumulate`` (a micro-batch arrives), ``_train`` (the step's compute) and ``_hand_over`` (the new
version to generation).

:class:`ViewRollout` is the generation side both placements share: a rollout model whose
parameters are bound, for the length of one call, to zero-copy views of inference weights held
under a lease.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import anyio
import msgspec
import torch
import torch.distributed as dist
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from streamrl.algos.grpo import LossConfig, loss_denominator, per_token_loss, unnormalized_loss
from streamrl.engines.rollout import Generation, TorchRolloutEngine
from streamrl.engines.train import samples_from_columns
from streamrl.models.build import resolve_device, save_pretrained_dir
from streamrl.reshard import (
    AdamWConfig,
    DaemonCall,
    InferencePlan,
    InferenceWeights,
    ModelShardingSpec,
    RankGroups,
    ShardedTrainEngine,
    Topology,
    build_rank_groups,
    local_hf_views,
)
from streamrl.runtime.pipeline import ReshardTrainOptions, StageSpec
from streamrl.runtime.policy import PolicyPublisher
from streamrl.runtime.stage import Batch, ClaimSize, Output, StageContext, StopRun
from streamrl.stages.common import StepTally, build_policy, step_claim


def default_backend(device: str) -> str:
    """The torch.distributed backend for a device ("auto" resolved): nccl on CUDA, hccl on Ascend NPU
    (registered by torch_npu), else gloo."""
    kind = resolve_device(device).type
    return {"cuda": "nccl", "npu": "hccl"}.get(kind, "gloo")


def rank_device(device: str, world_rank: int, world_size: int, backend: str) -> str:
    """This rank's device in a reshard world of ``world_size`` processes on this machine.

    An accelerator named without an index (``cuda``, ``npu``, or ``auto`` resolving to one) becomes
    ``<kind>:<world_rank mod device count>``, so the ranks spread over the machine's devices; an
    explicit index, or cpu, is kept. nccl and hccl need one device per rank: more ranks than
    devices is refused with what to change.
    """
    d = resolve_device(device)
    if d.type == "cpu":
        return "cpu"
    count = int(getattr(torch, d.type).device_count())
    if backend in ("nccl", "hccl") and world_size > count:
        raise ValueError(f"{world_size} reshard ranks (train + generation workers) but {count} {d.type} device(s): "
                         f"{backend} needs one device per rank; use fewer workers, or options.backend: gloo on "
                         "the train stage")
    return str(d) if d.index is not None else f"{d.type}:{world_rank % count}"


async def join_world(ctx: StageContext, store_name: str, rank: int, world_size: int, topology: Topology, *,
                     backend: str, timeout_s: float, device: str) -> RankGroups:
    """Join the torch.distributed world of ``topology`` (rank ``rank`` of ``world_size``) through a
    FileStore in ``<run_dir>/rendezvous/<store_name>``, and create its groups (collective).
    ``device``: this rank's (see :func:`rank_device`); an accelerator is made current first, as
    nccl/hccl expect."""
    store_path = ctx.run_dir / "rendezvous" / store_name
    store_path.parent.mkdir(parents=True, exist_ok=True)

    def join() -> RankGroups:
        kind = torch.device(device).type
        if kind != "cpu":
            getattr(torch, kind).set_device(torch.device(device))
        store = dist.FileStore(str(store_path), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        return build_rank_groups(topology)

    # in a daemon thread: a Stop during set-up (another worker failed, so this rendezvous never
    # completes) abandons the wait instead of holding the process until the store times out
    wait_s = ctx.config.resources.start_timeout_s
    with anyio.move_on_after(wait_s):
        return await DaemonCall(join, "streamrl-join-world").wait()
    raise TimeoutError(f"stage {ctx.spec.name!r} worker {ctx.worker}: joining the torch.distributed world "
                       f"{store_name!r} ({world_size} ranks) took over resources.start_timeout_s={wait_s:g} s; "
                       "a rank did not start (see the other workers' logs)")


def weights_receiver(ctx: StageContext) -> StageSpec:
    """The generate stage this train stage hands its weights to (see ``PipelineSpec.weights_receiver``)."""
    generate = ctx.pipeline.weights_receiver(ctx.spec.name) if ctx.pipeline is not None else None
    if generate is None:
        raise ValueError(f"no stage says `colocate_with: {ctx.spec.name}` or `weights_from: {ctx.spec.name}`; the "
                         f"train stage {ctx.spec.name!r} has no generate stage to hand its weights to")
    return generate


def grpo_micro_batch(cols: Mapping[str, Any]) -> dict[str, Tensor]:
    """Right-padded prompt+response rows for the Hugging Face forward, and where each response
    token's logit sits (the same maths as TorchTrainEngine's HF path)."""
    samples = samples_from_columns(cols)
    inputs = [torch.cat([s.prompt_ids, s.response_ids[:-1]]) for s in samples]
    lengths = torch.tensor([x.numel() for x in inputs])
    width = int(lengths.max())
    resp_lens = torch.tensor([s.response_ids.numel() for s in samples])
    seq_index = torch.repeat_interleave(torch.arange(len(samples)), resp_lens)
    offset = torch.arange(seq_index.numel()) - (resp_lens.cumsum(0) - resp_lens)[seq_index]
    first = torch.tensor([s.prompt_ids.numel() - 1 for s in samples])
    batch = {
        "input_ids": torch.nn.utils.rnn.pad_sequence(inputs, batch_first=True),
        "attention_mask": (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long(),
        "rows": seq_index * width + first[seq_index] + offset,
        "targets": torch.cat([s.response_ids for s in samples]),
        "seq_index": seq_index,
        "n_seqs": torch.tensor(len(samples)),
        "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32)[seq_index],
    }
    for name in ("rollout_logprobs", "ref_logprobs"):
        if all(getattr(s, name) is not None for s in samples):
            batch[name] = torch.cat([getattr(s, name) for s in samples]).float()
    return batch


class GrpoLossFn:
    """``ShardedTrainEngine.forward_backward``'s loss: the GRPO per-token loss of
    :mod:`streamrl.algos.grpo` summed unnormalised (the step's global denominator is applied through
    ``loss_scale`` or ``scale_grads``), with the sums the step metrics need."""

    def __init__(self, config: LossConfig, device: torch.device) -> None:
        self.config, self.device = config, device
        self.sums = dict.fromkeys(("loss", "clipped", "approx_kl", "entropy", "kl"), 0.0)

    def __call__(self, logits: Tensor, b: Mapping[str, Tensor]) -> Tensor:
        cfg, device = self.config, self.device
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, b["rows"].to(device))
        logp_all = torch.log_softmax(flat.float() / cfg.temperature, dim=-1)
        logp = logp_all.gather(1, b["targets"].to(device).unsqueeze(1)).squeeze(1)
        optional = {k: b[k].to(device) for k in ("rollout_logprobs", "ref_logprobs") if k in b}
        per_token, stats = per_token_loss(logp, b["advantages"].to(device), cfg, **optional)
        loss = unnormalized_loss(per_token, b["seq_index"].to(device), int(b["n_seqs"]), cfg.loss_agg)
        self.sums["loss"] += float(loss.detach())
        self.sums["clipped"] += float(stats["clipped"].sum())
        self.sums["approx_kl"] += float(stats["approx_kl"].sum())
        if "kl" in stats:
            self.sums["kl"] += float(stats["kl"].sum())
        if cfg.compute_entropy:
            with torch.no_grad():
                self.sums["entropy"] += float(-(logp_all.exp() * logp_all).sum())
        return loss


class ShardedGrpoTrainer:
    """The train stage over R ranks, less the weight hand-over (see the module doc).

    A subclass sets ``placement`` and implements ``_topology``, ``_world_size``,
    ``_start_weights``, ``_accumulate``, ``_train`` and ``_hand_over``; it may override
    ``_before_train`` and ``_on_stop``.
    """

    placement: str
    # what ``options`` this stage takes, and their defaults; checked when the pipeline loads
    Options: type[ReshardTrainOptions] = ReshardTrainOptions

    # -- set-up -----------------------------------------------------------------------------------
    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.checkpoint_saved = False
        cfg, a = ctx.config, ctx.config.algo
        self.R, self.rank = ctx.spec.workers, ctx.worker
        if cfg.batch_size % self.R:
            raise ValueError(f"prompts_per_step x group_size = {cfg.batch_size} samples per step must divide "
                             f"evenly over the train stage's workers={self.R}")
        if a.old_logprobs != "rollout":
            raise ValueError(f"algo.old_logprobs={a.old_logprobs!r} is not supported by the {self.placement} "
                             "train stage yet; use 'rollout'")
        self.per_rank = cfg.batch_size // self.R
        self.options = msgspec.convert(ctx.options, self.Options)
        self.bucket_bytes = self.options.bucket_bytes
        # how long a rank waits in a collective for the others: covers a whole generation phase
        self.timeout_s = self.options.collective_timeout_s
        backend = self.options.backend or default_backend(ctx.device)
        world_size = self._world_size()
        self.device = rank_device(ctx.device, self.rank, world_size, backend)  # train worker k = world rank k
        self.groups = await join_world(ctx, ctx.spec.name, self.rank, world_size, self._topology(),
                                       backend=backend, timeout_s=self.timeout_s, device=self.device)
        assert self.groups.train is not None
        self.group = self.groups.train.group  # None with R = 1
        model, self.tokenizer = build_policy(cfg, self.device)
        self.spec = ModelShardingSpec.from_config(model.config)
        self.engine = ShardedTrainEngine(
            model, self.spec, self.groups.train,
            optimizer=AdamWConfig(lr=a.lr, betas=(a.betas[0], a.betas[1]), weight_decay=a.weight_decay,
                                  max_grad_norm=a.max_grad_norm),
            device=self.device,
        )
        self.loss_config = msgspec.structs.replace(a.loss, temperature=a.temperature)
        self.version = 0
        await self._start_weights()  # version 0 = the initial policy
        self.publisher: PolicyPublisher | None = None
        if self.rank == 0:  # version numbers for the source's gating; weights never travel here
            self.publisher = PolicyPublisher(ctx.weights_endpoint)
            ctx.tasks.start_soon(self.publisher.serve)  # type: ignore[attr-defined]
        self._reset()
        self.t_step = time.monotonic()

    def _world_size(self) -> int:
        raise NotImplementedError

    def _topology(self) -> Topology:
        raise NotImplementedError

    async def _start_weights(self) -> None:
        """Make version 0 available to generation."""
        raise NotImplementedError

    def _train(self, scale: float) -> tuple[dict[str, float], float]:
        """The step's compute (blocking, collective): returns the loss sums and the gradient norm.
        ``scale`` turns each rank's unnormalised gradient sum into the step's mean gradient."""
        raise NotImplementedError

    async def _hand_over(self, version: int) -> dict[str, float]:
        """Give ``version`` to generation; returns the weight path's figures for the step's metrics."""
        raise NotImplementedError

    # -- the step ---------------------------------------------------------------------------------
    async def _accumulate(self, batch: Batch) -> None:
        """Take one micro-batch of this rank's share (train on it now, or keep it for the step)."""
        raise NotImplementedError

    def _reset(self) -> None:
        self.tally = StepTally()
        self.micro_batches = 0
        self.loss_fn = GrpoLossFn(self.loss_config, self.engine.device)

    def claim_size(self) -> ClaimSize:
        # every rank claims the same sizes in the same order, so every rank runs the same number
        # of forward/backward collectives per step
        return step_claim(self.ctx.spec.micro_batch, self.per_rank - self.tally.consumed, self.version,
                          self.ctx.config.algo.max_staleness)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        await self._accumulate(batch)
        self.micro_batches += 1
        self.tally.add(batch, self.version)
        if self.tally.consumed >= self.per_rank:
            await self._step()
        return {}

    def _all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    async def _step(self) -> None:
        a = self.ctx.config.algo
        t0 = time.perf_counter()
        tally, r = self.tally, self.tally.rewards
        # The all-reduce of the counts returns once every rank has its whole share of the step.
        (g_tokens, g_seqs, r_sum, r_sq, g_seq_tok, st_sum) = await self.ctx.run_sync(
            self._all_reduce, [float(tally.response_tokens), float(tally.consumed), sum(r), sum(x * x for x in r),
                               float(tally.sequence_tokens), float(sum(tally.staleness))])
        (st_max,) = await self.ctx.run_sync(self._all_reduce, [float(max(tally.staleness, default=0))],
                                            dist.ReduceOp.MAX)
        t_barrier = time.perf_counter()
        before = await self._before_train()
        t_ready = time.perf_counter()
        denominator = max(loss_denominator(self.loss_config.loss_agg, int(g_tokens), int(g_seqs)), 1)
        # the engine averages gradients over the data-parallel ranks; each rank backpropagates
        # an unnormalised sum, so dp / global denominator gives sum over all samples / denominator
        scale = self.engine.layout.data_parallel / denominator
        sums, grad_norm = await self.ctx.run_sync(self._train, scale)
        t_train = time.perf_counter()
        loss_sum, clipped, approx_kl, entropy, kl = await self.ctx.run_sync(
            self._all_reduce, [sums["loss"], sums["clipped"], sums["approx_kl"], sums["entropy"], sums["kl"]])
        self.version += 1
        weight_metrics = await self._hand_over(self.version)
        t_end = time.perf_counter()
        if self.publisher is not None:
            await self.publisher.publish(self.version, {})
        now = time.monotonic()
        wall = max(now - self.t_step, 1e-9)
        self.t_step = now
        n = max(g_seqs, 1.0)
        mean = r_sum / n
        var = (r_sq - n * mean * mean) / (n - 1) if n > 1 else 0.0
        metrics = {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(var, 0.0)),
            "loss": loss_sum / denominator,
            "kl": (kl if a.loss.kl_coef > 0 else approx_kl) / max(g_tokens, 1),
            "clip_fraction": clipped / max(g_tokens, 1),
            "entropy": entropy / max(g_tokens, 1),
            "grad_norm": grad_norm,
            "samples_per_s": g_seqs / wall,
            "tokens_per_s": g_tokens / wall,
            "response_len_mean": g_tokens / n,
            "response_tokens": g_tokens,
            "sequence_tokens": g_seq_tok,
            "staleness_mean": st_sum / n,
            "staleness_max": st_max,
            "micro_batches": float(self.micro_batches * self.R),
            "step_time_s": wall,
            # the weight path (this rank; every rank moves the same bytes)
            "wait_other_ranks_ms": (t_barrier - t0) * 1e3,
            "train_ms": (t_train - t_ready) * 1e3,
            "hand_over_ms": (t_end - t_train) * 1e3,
            **before,
            **weight_metrics,
        }
        if self.rank == 0:
            self.ctx.report_step(self.version, metrics)
        self._reset()
        # every rank sees the same global figures, so every rank stops at the same step
        reason = None
        if a.stop_reward is not None and metrics["reward_mean"] >= a.stop_reward:
            reason = f"reward {metrics['reward_mean']:.3f} >= stop_reward {a.stop_reward} at step {self.version}"
        elif self.version >= a.steps:
            reason = f"completed {a.steps} steps"
        if reason is not None:
            await self._on_stop()
            raise StopRun(reason)

    async def _before_train(self) -> dict[str, float]:
        """Between "every rank has its share" and the step's compute (e.g. swap the state in)."""
        return {}

    async def _on_stop(self) -> None:
        """All ranks are here together, at the last step: write the checkpoint (collective)."""
        if self.ctx.config.output.checkpoint:
            full = await self.ctx.run_sync(self.engine.full_state_dict)
            if self.rank == 0:
                await self.ctx.run_sync(self._save_checkpoint, full)
            self.checkpoint_saved = True

    def _save_checkpoint(self, weights: Mapping[str, Tensor]) -> None:
        """Rank 0 writes the newest version, given its full weights under the Hugging Face names."""
        model, _ = build_policy(self.ctx.config, "cpu")
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        save_pretrained_dir(model, self.tokenizer, self.ctx.run_dir / "checkpoint")

    async def close(self) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()  # type: ignore[union-attr]
        if dist.is_initialized():
            dist.destroy_process_group()


class ViewRollout:
    """A rollout engine whose model computes on inference weights it does not own.

    The model's parameters are emptied at construction; each ``generate`` binds them to zero-copy
    views of one inference rank's weights (held by the caller under a lease) and unbinds them
    before returning, so released weights are never kept alive through the module.
    """

    def __init__(self, ctx: StageContext, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 plan: InferencePlan, inference_rank: int = 0) -> None:
        model.eval()
        self.ctx, self.plan, self.inference_rank = ctx, plan, inference_rank
        self.params = dict(model.named_parameters())
        device = next(iter(self.params.values())).device  # the caller built it on this rank's device
        for p in self.params.values():  # weights come from the reshard: keep no copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        missing = set(self.params) - {p.source for p in plan.pieces[inference_rank]}
        if missing:
            raise ValueError(f"the inference layout lacks parameters {sorted(missing)[:3]} of the rollout model")
        self.engine = TorchRolloutEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, device)
        seed = ctx.config.seed * 1000 + 17 * ctx.worker + 1
        self.generator = torch.Generator(device=self.engine.device).manual_seed(seed)

    def generate(self, tensors: Mapping[str, Tensor], prompts: list[Tensor]) -> list[Generation]:
        views = local_hf_views(tensors, self.plan, self.inference_rank)
        a = self.ctx.config.algo
        try:
            for name, p in self.params.items():  # zero-copy: the model computes on the inference weights
                p.data = views[name]
            return self.engine.generate(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                        top_p=a.top_p, top_k=a.top_k, generator=self.generator)
        finally:
            for p in self.params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    async def process(self, weights: InferenceWeights, batch: Batch) -> Output:
        """A generate stage's ``process``: completions of the batch's prompts under a shared lease on
        a version new enough for them (waits for it)."""
        need = version_needed(batch, self.ctx.config.algo.max_staleness)
        prompts = batch.columns["prompt_ids"]
        async with weights.use(need) as tensors:
            version = weights.version
            assert version is not None
            gens = await self.ctx.run_sync(self.generate, tensors, prompts)
        return generation_output(prompts, gens, version)


def version_needed(batch: Batch, max_staleness: int) -> int:
    """The oldest policy version allowed to generate ``batch``: its newest prompt's step - max_staleness."""
    steps = batch.columns.get("step")
    return max(int(s) for s in steps) - max_staleness if steps else 0


def generation_output(prompts: list[Tensor], gens: list[Generation], version: int) -> Output:
    """A generate stage's columns, versions and lengths for ``gens``."""
    lengths = [int(p.numel()) + int(g.response_ids.numel()) for p, g in zip(prompts, gens, strict=True)]
    return Output(
        {"response_ids": [g.response_ids for g in gens], "rollout_logprobs": [g.logprobs for g in gens]},
        versions=[version] * len(gens), lengths=lengths,
    )
