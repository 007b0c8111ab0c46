"""The train stage: GRPO/PPO clipped objective, gradients accumulated micro-batch by micro-batch.

Streaming: each claimed micro-batch is forwarded and back-propagated as soon as it arrives
(the engine sums unnormalised losses), and the optimizer steps once a whole step's samples
(prompts_per_step x group_size) went through, normalising by the step's global token or
sequence count. So training of step s starts while later micro-batches of s are still being
generated and scored. After each step the new weights are published as version v+1.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import torch

from streamrl.engines.train import TorchTrainEngine, samples_from_columns
from streamrl.runtime.pipeline import NoOptions
from streamrl.runtime.policy import PolicyPublisher
from streamrl.runtime.stage import Batch, ClaimSize, StageContext, StopRun
from streamrl.stages.common import StepTally, build_policy, step_claim


class TrainStage:
    Options = NoOptions  # it takes no options; checked when the pipeline loads

    # One trainer process holds the policy and publishes its versions; data-parallel training
    # across processes is the reshard's train group (streamrl.reshard), not more workers here.
    max_workers = 1

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        a = ctx.config.algo
        self.model, self.tokenizer = build_policy(ctx.config, ctx.device)
        self.engine = TorchTrainEngine(self.model, lr=a.lr, betas=a.betas, weight_decay=a.weight_decay,
                                       max_grad_norm=a.max_grad_norm, device=ctx.device)
        self.loss_config = msgspec.structs.replace(a.loss, temperature=a.temperature)
        self.publisher = PolicyPublisher(ctx.weights_endpoint)
        ctx.tasks.start_soon(self.publisher.serve)  # type: ignore[attr-defined]
        self.version = 0
        self.batch_size = ctx.config.batch_size
        self._reset()
        self.t_step = time.monotonic()

    def _reset(self) -> None:
        self.tally = StepTally()
        self.micro: list[dict[str, float]] = []

    def claim_size(self) -> ClaimSize:
        return step_claim(self.ctx.spec.micro_batch, self.batch_size - self.tally.consumed, self.version,
                          self.ctx.config.algo.max_staleness)

    async def process(self, batch: Batch) -> dict[str, list[Any]]:
        a = self.ctx.config.algo
        cols = dict(batch.columns)
        if a.old_logprobs == "recompute":
            cols["old_logprobs"] = await self.ctx.run_sync(self.engine.logprobs, cols["prompt_ids"],
                                                           cols["response_ids"], a.temperature)
        samples = samples_from_columns(cols)
        self.micro.append(await self.ctx.run_sync(self.engine.accumulate, samples, self.loss_config))
        self.tally.add(batch, self.version)
        if self.tally.consumed >= self.batch_size:
            await self._step()
        return {}

    async def _step(self) -> None:
        a = self.ctx.config.algo
        stats = await self.ctx.run_sync(self.engine.step)
        self.version += 1
        await self.publisher.publish(self.version, self.engine.state_dict(copy=False))
        now = time.monotonic()
        wall = max(now - self.t_step, 1e-9)
        self.t_step = now
        r = torch.tensor(self.tally.rewards) if self.tally.rewards else torch.zeros(1)
        metrics = {
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
            "loss": stats["loss"],
            "kl": stats.get("kl", stats.get("approx_kl", 0.0)),
            "clip_fraction": stats["clip_fraction"],
            "entropy": stats["entropy"],
            "grad_norm": stats["grad_norm"],
            "samples_per_s": self.tally.consumed / wall,
            "tokens_per_s": self.tally.response_tokens / wall,
            "response_len_mean": self.tally.response_tokens / max(self.tally.consumed, 1),
            "response_tokens": float(self.tally.response_tokens),
            "sequence_tokens": float(self.tally.sequence_tokens),
            "staleness_mean": sum(self.tally.staleness) / max(len(self.tally.staleness), 1),
            "staleness_max": float(max(self.tally.staleness, default=0)),
            "micro_batches": stats["micro_batches"],
            "step_time_s": wall,
        }
        self.ctx.report_step(self.version, metrics)
        self._reset()
        if a.stop_reward is not None and metrics["reward_mean"] >= a.stop_reward:
            raise StopRun(f"reward {metrics['reward_mean']:.3f} >= stop_reward {a.stop_reward} at step {self.version}")
        if self.version >= a.steps:
            raise StopRun(f"completed {a.steps} steps")

    async def close(self) -> None:
        self.publisher.close()
        if self.ctx.config.output.checkpoint and self.version > 0:
            await self.ctx.run_sync(self.engine.save_checkpoint, self.ctx.run_dir / "checkpoint", self.tokenizer)
