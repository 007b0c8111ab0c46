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

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
import msgspec
import torch
import torch.distributed as dist
from torch import Tensor

from streamrl.algos.grpo import LossConfig, loss_denominator, per_token_loss, unnormalized_loss
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.engines.train import samples_from_columns
from streamrl.models.build import save_pretrained_dir
from streamrl.reshard import (
    AdamWConfig,
    ColocatedPolicy,
    ModelShardingSpec,
    RankGroups,
    ReshardConfig,
    Resharder,
    ReshardReport,
    ShardedTrainEngine,
    Topology,
    TrainLayout,
    build_rank_groups,
    local_hf_views,
)
from streamrl.runtime.policy import PolicyPublisher
from streamrl.runtime.stage import Batch, ClaimSize, Output, StageContext, StopRun
from streamrl.stages.common import StepTally, build_policy, step_claim

SHARED_KEY = "colocated_rank"
DEFAULT_BUCKET_BYTES = 64 * 2**20  # peak transient memory of one reshard per rank (one gathered bucket)


class ColocatedSetupError(RuntimeError):
    """The colocated train stage of this process could not set up its policy (see its own error)."""


@dataclass
class ColocatedRank:
    """What the stages of one colocated process share (``ctx.shared[SHARED_KEY]``)."""

    ready: anyio.Event = field(default_factory=anyio.Event)
    policy: ColocatedPolicy | None = None
    groups: RankGroups | None = None
    error: str | None = None


def colocated_rank(ctx: StageContext) -> ColocatedRank:
    rank = ctx.shared.get(SHARED_KEY)
    if rank is None:
        rank = ctx.shared[SHARED_KEY] = ColocatedRank()
    return rank


def _option(ctx: StageContext, name: str, default: Any, kind: type) -> Any:
    value = ctx.options.get(name, default)
    if value is None and default is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"stage {ctx.spec.name!r} options.{name} must be {kind.__name__}, got {value!r}")
    return value


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
    ``loss_scale``), with the sums the step metrics need."""

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


class ColocatedTrainStage:
    """Sharded GRPO training over the R colocated ranks; hands each version to generation via the reshard.

    Options: ``bucket_bytes`` (reshard bucket cap, bytes, default 64 MiB), ``swap`` (move the
    training state to host memory while generating, default true), ``backend`` (default gloo on
    CPU, nccl on CUDA), ``collective_timeout_s`` (how long a rank waits in a collective for the
    others, default 600: covers a whole generation phase).
    """

    placement = "colocated"

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        shared = colocated_rank(ctx)
        try:
            await self._setup(ctx, shared)
        except BaseException as exc:
            shared.error = f"{type(exc).__name__}: {exc}"
            shared.ready.set()
            raise
        shared.ready.set()

    async def _setup(self, ctx: StageContext, shared: ColocatedRank) -> None:
        cfg, a = ctx.config, ctx.config.algo
        self.R, self.rank = ctx.spec.workers, ctx.worker
        if cfg.batch_size % self.R:
            raise ValueError(f"prompts_per_step x group_size = {cfg.batch_size} samples per step must divide "
                             f"evenly over the train stage's workers={self.R}")
        if a.old_logprobs != "rollout":
            raise ValueError(f"algo.old_logprobs={a.old_logprobs!r} is not supported by the colocated train stage "
                             "yet; use 'rollout'")
        self.per_rank = cfg.batch_size // self.R
        bucket_bytes = _option(ctx, "bucket_bytes", DEFAULT_BUCKET_BYTES, int)
        swap = _option(ctx, "swap", True, bool)
        timeout_s = _option(ctx, "collective_timeout_s", 600.0, float)
        backend = _option(ctx, "backend", "nccl" if ctx.device.startswith("cuda") else "gloo", str)
        store_path = ctx.run_dir / "rendezvous" / ctx.spec.name
        store_path.parent.mkdir(parents=True, exist_ok=True)

        def join() -> RankGroups:
            store = dist.FileStore(str(store_path), self.R)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.R,
                                    timeout=timedelta(seconds=timeout_s))
            return build_rank_groups(Topology.colocated(TrainLayout(self.R), 1))

        with anyio.fail_after(cfg.resources.start_timeout_s):
            self.groups = await ctx.run_sync(join)
        assert self.groups.train is not None
        self.group = self.groups.train.group  # None with R = 1
        model, self.tokenizer = build_policy(cfg, ctx.device)
        self.model_config = model.config
        self.vocab = int(model.config.vocab_size)
        spec = ModelShardingSpec.from_config(model.config)
        self.engine = ShardedTrainEngine(
            model, spec, self.groups.train,
            optimizer=AdamWConfig(lr=a.lr, betas=(a.betas[0], a.betas[1]), weight_decay=a.weight_decay,
                                  max_grad_norm=a.max_grad_norm),
            device=ctx.device,
        )
        resharder = Resharder(spec, self.groups, config=ReshardConfig(bucket_bytes=bucket_bytes),
                              shard_dtype=self.engine.dtype, inference_dtype=self.engine.dtype, device=ctx.device)
        self.policy = ColocatedPolicy(self.engine, resharder, swap_training_state=swap)
        self.loss_config = msgspec.structs.replace(a.loss, temperature=a.temperature)
        self.version = 0
        self.last_reshard: ReshardReport = await self.policy.to_inference(0)  # version 0 = the initial policy
        shared.policy, shared.groups = self.policy, self.groups
        self.publisher: PolicyPublisher | None = None
        if self.rank == 0:  # version numbers for the source's gating; weights never travel here
            self.publisher = PolicyPublisher(ctx.weights_endpoint)
            ctx.tasks.start_soon(self.publisher.serve)  # type: ignore[attr-defined]
        self._reset()
        self.t_step = time.monotonic()

    def _reset(self) -> None:
        self.tally = StepTally()
        self.pending: list[dict[str, Any]] = []  # this rank's share, trained on once all shares are claimed

    def claim_size(self) -> ClaimSize:
        # every rank claims the same sizes in the same order, so every rank runs the same number
        # of forward/backward collectives per step
        return step_claim(self.ctx.spec.micro_batch, self.per_rank - self.tally.consumed, self.version,
                          self.ctx.config.algo.max_staleness)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        self.pending.append(dict(batch.columns))
        self.tally.add(batch, self.version)
        if self.tally.consumed >= self.per_rank:
            await self._step()
        return {}

    def _all_reduce(self, values: list[float], op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(t, op=op, group=self.group)
        return t.tolist()

    def _train(self, scale: float) -> tuple[dict[str, float], float]:
        """Forward/backward of this rank's micro-batches (collective), then the optimizer step."""
        loss_fn = GrpoLossFn(self.loss_config, self.engine.device)
        for cols in self.pending:
            self.engine.forward_backward(grpo_micro_batch(cols), loss_fn, loss_scale=scale)
        stats = self.engine.optimizer_step()
        return loss_fn.sums, stats.grad_norm

    async def _step(self) -> None:
        a = self.ctx.config.algo
        t0 = time.perf_counter()
        tally, r = self.tally, self.tally.rewards
        # All-reduce of the counts = "every rank has claimed its share": generation for this step is done.
        (g_tokens, g_seqs, r_sum, r_sq, g_seq_tok, st_sum) = await self.ctx.run_sync(
            self._all_reduce, [float(tally.response_tokens), float(tally.consumed), sum(r), sum(x * x for x in r),
                               float(tally.sequence_tokens), float(sum(tally.staleness))])
        (st_max,) = await self.ctx.run_sync(self._all_reduce, [float(max(tally.staleness, default=0))],
                                            dist.ReduceOp.MAX)
        t_barrier = time.perf_counter()
        swap_in = await self.policy.to_training()
        t_in = time.perf_counter()
        denominator = max(loss_denominator(self.loss_config.loss_agg, int(g_tokens), int(g_seqs)), 1)
        # the engine averages gradients over the R data-parallel ranks; each rank backpropagates
        # an unnormalised sum, so R / global denominator gives sum over all samples / denominator
        scale = self.engine.layout.data_parallel / denominator
        sums, grad_norm = await self.ctx.run_sync(self._train, scale)
        t_train = time.perf_counter()
        loss_sum, clipped, approx_kl, entropy, kl = await self.ctx.run_sync(
            self._all_reduce, [sums["loss"], sums["clipped"], sums["approx_kl"], sums["entropy"], sums["kl"]])
        self.version += 1
        report = await self.policy.to_inference(self.version)
        swap_out = self.policy.last_swap
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
            "micro_batches": float(len(self.pending) * self.R),
            "step_time_s": wall,
            # the colocated weight path (this rank; every rank moves the same bytes)
            "wait_other_ranks_ms": (t_barrier - t0) * 1e3,
            "swap_in_ms": (t_in - t_barrier) * 1e3 if swap_in is not None else 0.0,
            "train_ms": (t_train - t_in) * 1e3,
            "reshard_ms": report.total_s * 1e3,
            "swap_out_ms": swap_out.seconds * 1e3 if swap_out is not None else 0.0,
            "to_inference_ms": (t_end - t_train) * 1e3,
            "reshard_peak_extra_bytes": float(report.peak_extra_bytes),
            "reshard_largest_bucket_bytes": float(report.largest_bucket_bytes),
            "reshard_bucket_bytes_limit": float(report.bucket_bytes_limit or 0),
            "reshard_buckets": float(len(report.buckets)),
            "reshard_received_bytes": float(report.received_bytes),
            "swap_bytes": float(swap_out.bytes) if swap_out is not None else 0.0,
        }
        self.last_reshard = report
        if self.rank == 0:
            self.ctx.report_step(self.version, metrics)
        self._reset()
        # every rank sees the same global figures, so every rank stops at the same step
        if a.stop_reward is not None and metrics["reward_mean"] >= a.stop_reward:
            raise StopRun(f"reward {metrics['reward_mean']:.3f} >= stop_reward {a.stop_reward} at step {self.version}")
        if self.version >= a.steps:
            raise StopRun(f"completed {a.steps} steps")

    def _save_checkpoint(self) -> None:
        """Rank 0 writes the newest version from its full (T = 1) inference copy: no collective."""
        model, _ = build_policy(self.ctx.config, "cpu")
        views = local_hf_views(self.policy.weights.tensors, self.policy.resharder.plan, 0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(views[name])
        save_pretrained_dir(model, self.tokenizer, self.ctx.run_dir / "checkpoint")

    async def close(self) -> None:
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()  # type: ignore[union-attr]
        policy = getattr(self, "policy", None)
        if (self.ctx.config.output.checkpoint and policy is not None and self.rank == 0 and self.version > 0
                and policy.phase == "inference"):
            await self.ctx.run_sync(self._save_checkpoint)
        if dist.is_initialized():
            dist.destroy_process_group()


class ColocatedGenerateStage:
    """Samples with the inference weights of the colocated train stage in this process (T = 1)."""

    placement = "colocated"

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        if ctx.spec.colocate_with is None:
            raise ValueError(f"stage {ctx.spec.name!r} needs `colocate_with: <the colocated train stage>`")
        model, tok = build_policy(ctx.config, ctx.device)
        model.eval()
        self.params = dict(model.named_parameters())
        for p in self.params.values():  # weights come from the reshard: this stage keeps no copy
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.engine = TorchRolloutEngine(model, tok.eos_token_id, tok.pad_token_id, ctx.device)
        seed = ctx.config.seed * 1000 + 17 * ctx.worker + 1
        self.generator = torch.Generator(device=self.engine.device).manual_seed(seed)
        shared = colocated_rank(ctx)
        with anyio.fail_after(ctx.config.resources.start_timeout_s):
            await shared.ready.wait()
        if shared.policy is None:
            raise ColocatedSetupError(f"the colocated train stage {ctx.spec.colocate_with!r} of this process failed "
                                      f"to set up: {shared.error}")
        self.policy = shared.policy
        self.plan = shared.policy.resharder.plan
        missing = set(self.params) - {p.source for p in self.plan.pieces[0]}
        if missing:
            raise ValueError(f"the inference layout lacks parameters {sorted(missing)[:3]} of the rollout model")

    def _generate(self, tensors: Mapping[str, Tensor], prompts: list[Tensor]) -> list[Any]:
        views = local_hf_views(tensors, self.plan, 0)
        a = self.ctx.config.algo
        try:
            for name, p in self.params.items():  # zero-copy: the model computes on the inference weights
                p.data = views[name]
            return self.engine.generate(prompts, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                                        top_p=a.top_p, top_k=a.top_k, generator=self.generator)
        finally:
            for p in self.params.values():  # do not keep released weights alive through the module
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    async def process(self, batch: Batch) -> Output:
        a = self.ctx.config.algo
        need = max(int(s) for s in batch.columns["step"]) - a.max_staleness if "step" in batch.columns else 0
        prompts = batch.columns["prompt_ids"]
        # waits through the training phase (weights released) until version >= need is resharded in
        async with self.policy.weights.use(need) as tensors:
            version = self.policy.weights.version
            assert version is not None
            gens = await self.ctx.run_sync(self._generate, tensors, prompts)
        lengths = [int(p.numel()) + int(g.response_ids.numel()) for p, g in zip(prompts, gens, strict=True)]
        return Output(
            {"response_ids": [g.response_ids for g in gens], "rollout_logprobs": [g.logprobs for g in gens]},
            versions=[version] * len(gens), lengths=lengths,
        )

    async def close(self) -> None:
        pass
