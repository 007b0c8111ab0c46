"""The eval stage: held-out evaluation of policy versions while training goes on.

A *side* stage (no reads, no writes): it takes no samples from the dock. ``eval.every: N`` in the
run config adds it to the pipeline (named ``eval``; stage overrides ``stages.eval.device`` etc.
apply). It fetches policy versions N, 2N, ... from the trainer's publisher (the newest one at or
above each: an evaluation slower than N training steps skips versions instead of falling behind),
generates on the task's eval split (the dataset's ``eval_path`` / ``eval_split``; for a task
without one, ``eval.max_prompts`` prompts drawn from a stream seeded by ``eval.seed``), scores the
completions with the task's reward and reports one ``eval/...`` row per version:

- ``eval/mean@k``: the mean reward over every prompt's k = ``eval.samples`` completions
  (with k = 1 and a 0/1 reward: the accuracy, pass@1);
- ``eval/pass@k``: the fraction of prompts with at least one completion whose reward is >=
  ``eval.pass_threshold``;
- ``eval/response_len_mean`` (tokens), ``eval/prompts``, ``eval/eval_s`` (the evaluation's time).

The final version (``eval.at_end``) is evaluated even when the run stops first (``stop_reward``,
or the trainer's last step racing the fetch): the trainer exports it to ``<run dir>/checkpoint``
with its version (``output.checkpoint``), and this stage evaluates that export when it closes.

Training does not wait for evaluation: this stage runs in its own process and only reads the
published snapshots. It needs them, so it works in the ``separate`` placement (the colocated and
disaggregated placements hand weights over without publishing them).
"""

from __future__ import annotations

import logging
import random
import time

import torch

from streamrl.config import ConfigError, RunConfig
from streamrl.engines.rollout import TorchRolloutEngine
from streamrl.metrics.trace import tracer
from streamrl.runtime.pipeline import NoOptions, PipelineSpec, StageSpec, apply_overrides
from streamrl.runtime.stage import StageContext
from streamrl.stages.common import build_policy, build_task
from streamrl.stages.score import ScoreOptions, reward_of
from streamrl.tasks.base import Prompt, Task
from streamrl.tasks.chat import render_prompt

log = logging.getLogger("streamrl.stage.eval")

DEFAULT_PROMPTS = 64  # eval prompts of a task without an eval split, when eval.max_prompts is unset
GENERATE_CHUNK = 64  # completions generated per engine call (bounds the KV cache)


# The stage `eval.every > 0` adds to a pipeline that does not list one.
EVAL_STAGE_NAME = "eval"
EVAL_STAGE_CLASS = "streamrl.stages.evaluate:EvalStage"


def add_eval_stage(spec: PipelineSpec, cfg: RunConfig) -> None:
    """``eval.every > 0`` in the run config: evaluation runs as a stage of its own beside the
    dataflow; add it (with its ``stages.eval`` overrides) unless the pipeline lists one."""
    if cfg.eval.every <= 0 or any(s.cls == EVAL_STAGE_CLASS for s in spec.stages):
        return
    if EVAL_STAGE_NAME in [s.name for s in spec.stages]:
        raise ConfigError(f"{spec.path}: eval.every > 0 adds a stage named {EVAL_STAGE_NAME!r}, but the pipeline "
                          f"already has a stage of that name; rename it, or list {{name: {EVAL_STAGE_NAME}, "
                          f"class: {EVAL_STAGE_CLASS}}} in the pipeline yourself")
    eval_stage = StageSpec(name=EVAL_STAGE_NAME, cls=EVAL_STAGE_CLASS)
    spec.stages.append(apply_overrides(eval_stage, cfg.stages[EVAL_STAGE_NAME])
                       if EVAL_STAGE_NAME in cfg.stages else eval_stage)


class EvalSplitError(ValueError):
    """The task cannot give eval prompts as configured."""


def eval_prompts(task: Task, limit: int | None, seed: int) -> list[Prompt]:
    """The prompts every evaluation uses: the task's eval split (its first ``limit`` rows), or for
    a task without one ``limit`` (default 64) prompts from a stream of its own (``eval-<seed>``,
    apart from the training stream)."""
    has_split = getattr(task, "has_eval_split", None)
    if callable(has_split) and has_split():
        prompts = list(task.eval_prompts(limit))  # type: ignore[attr-defined]
    else:
        prompts = task.make_prompts(random.Random(f"eval-{seed}"), limit or DEFAULT_PROMPTS)
    if not prompts:
        raise EvalSplitError(f"task {task.name!r}: the eval split has no prompts")
    return prompts


class EvalStage:
    Options = NoOptions  # eval.* in the run config says what to do
    uses_model_and_task = True  # the pre-run checks load the run's model and task (streamrl.runtime.prerun)
    placement = "separate"  # it reads the published snapshots (see the module docstring)
    fetches_policy = True

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.eval = cfg.eval
        model, self.tokenizer = build_policy(cfg, ctx.device)
        model.eval()
        self.engine = TorchRolloutEngine(model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, ctx.device)
        self.task = build_task(cfg, self.tokenizer)
        self.prompts = eval_prompts(self.task, self.eval.max_prompts, self.eval.seed)
        self.prompt_ids = [
            torch.tensor(self.tokenizer.encode(render_prompt(p, self.tokenizer, chat_template=cfg.task.chat_template,
                                                             system_prompt=cfg.task.system_prompt),
                                               add_special_tokens=False), dtype=torch.int64)
            for p in self.prompts
        ]
        self.generator = torch.Generator(device=self.engine.device).manual_seed(self.eval.seed)
        self.version = 0
        self.evaluated: set[int] = set()
        ctx.log.info("eval: %d prompts x %d samples per evaluation", len(self.prompts), self.eval.samples)

    def versions(self) -> list[int]:
        """The versions evaluated while the run goes: every, 2 * every, ..., and the last one."""
        steps, every = self.ctx.config.algo.steps, self.eval.every
        wanted = list(range(every, steps + 1, every))
        if self.eval.at_end and steps not in wanted:
            wanted.append(steps)
        if self.ctx.resume is not None:  # evaluated by the run before the resume (its rows are kept)
            wanted = [v for v in wanted if v > self.ctx.resume.state.version]
        return wanted

    async def run(self) -> None:
        for need in self.versions():
            if need <= self.version:
                continue  # a newer version than this one was already evaluated
            version, state = await self.ctx.policy.fetch(self.version, need)
            if state is not None:
                await self.ctx.run_sync(self.engine.load_state_dict, state)
                self.version = version
            state = None  # copied into the engine: its file's mapping goes now (WeightsRequest.done)
            await self._evaluate_and_report(self.version)

    async def _evaluate_and_report(self, version: int) -> None:
        with tracer().span("evaluate", "batch", "eval", version=version):
            t0 = time.perf_counter()
            metrics = await self.ctx.run_sync(self.evaluate)
            metrics["eval_s"] = time.perf_counter() - t0
        self.evaluated.add(version)
        self.ctx.report_eval(version, metrics)

    def evaluate(self) -> dict[str, float]:
        """Generate k completions per eval prompt with the engine's current weights and score them."""
        e, a = self.eval, self.ctx.config.algo
        k = e.samples
        greedy = e.temperature == 0
        rows = [i for i in range(len(self.prompts)) for _ in range(k)]
        rewards: list[float] = []
        lengths: list[int] = []
        for start in range(0, len(rows), GENERATE_CHUNK):
            chunk = rows[start:start + GENERATE_CHUNK]
            gens = self.engine.generate(
                [self.prompt_ids[i] for i in chunk], max_new_tokens=e.max_new_tokens or a.max_new_tokens,
                # greedy = the most likely token: top_k 1 at temperature 1 (the engine samples)
                temperature=1.0 if greedy else e.temperature, top_p=1.0 if greedy else a.top_p,
                top_k=1 if greedy else a.top_k, generator=self.generator,
            )
            ids = [g.response_ids.tolist() for g in gens]
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
            prompts = [self.prompts[i] for i in chunk]
            scores = self.task.reward_batch([p.text for p in prompts], texts, ids, [p.answer for p in prompts],
                                            [dict(p.metadata) for p in prompts])
            rewards += [reward_of(s, ScoreOptions(), sample_id=start + j, source="the task's reward")
                        for j, s in enumerate(scores)]
            lengths += [len(x) for x in ids]
        per_prompt = [rewards[i * k:(i + 1) * k] for i in range(len(self.prompts))]
        return {
            f"mean@{k}": sum(rewards) / len(rewards),
            f"pass@{k}": sum(max(r) >= e.pass_threshold for r in per_prompt) / len(per_prompt),
            "response_len_mean": sum(lengths) / len(lengths),
            "prompts": float(len(self.prompts)),
        }

    async def close(self) -> None:
        """The final evaluation (``eval.at_end``): of the checkpoint the trainer exported when the
        run ended, unless that version was evaluated already. Runs after Stop, within
        ``eval.end_timeout_s`` (the launcher waits that long for this stage)."""
        if not hasattr(self, "engine") or not self.eval.at_end:
            return
        # the model code is the worker's: its import takes seconds, and the launcher imports this module
        from streamrl.models.build import load_model, read_export_version

        final = read_export_version(self.ctx.run_dir / "checkpoint")
        if final is None or final in self.evaluated:
            return
        path = self.ctx.run_dir / "checkpoint"
        log.info("eval: the final version %d from %s", final, path)
        model = await self.ctx.run_sync(load_model, str(path), dtype=torch.float32, device=str(self.engine.device))
        dtype = self.engine.model.get_input_embeddings().weight.dtype
        await self.ctx.run_sync(self.engine.load_state_dict, model.to(dtype).state_dict())
        self.version = final
        await self._evaluate_and_report(final)
