"""The source stage: prompts from a task, ``group_size`` samples per prompt, one step at a time.

It writes ``prompt_ids`` (tokens: the prompt rendered through the chat template when
``task.chat_template`` is set), ``prompt`` and ``answer`` (text) and ``step``. Before the
prompts of step s it waits for policy version s - max_staleness: with 0 the whole pipeline is
synchronous on-policy; with k >= 1 generation may run k versions ahead of training.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import torch

from streamrl.runtime.pipeline import SourceOptions
from streamrl.runtime.stage import Output, StageContext
from streamrl.stages.common import build_task, build_tokenizer
from streamrl.tasks.chat import render_prompt


class SourceStage:
    Options = SourceOptions  # checked when the pipeline loads

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.tokenizer = build_tokenizer(cfg)
        self.task = build_task(cfg, self.tokenizer)
        self.rng = random.Random(cfg.task.seed)
        self.step = 0
        self.gate = msgspec.convert(ctx.options, SourceOptions).gate_on_policy

    async def wait_ready(self) -> None:
        """Before the prompts of step s: policy version s - max_staleness (the runtime awaits this
        before ``produce``, so the wait does not count as the source's busy time)."""
        a = self.ctx.config.algo
        if self.gate and self.step < a.steps:
            await self.ctx.policy.wait_version(self.step - a.max_staleness)

    async def produce(self) -> Output | None:
        a = self.ctx.config.algo
        if self.step >= a.steps:
            return None
        await self.wait_ready()  # at once when the runtime already awaited it
        t = self.ctx.config.task
        prompts = self.task.make_prompts(self.rng, a.prompts_per_step)
        columns: dict[str, list[Any]] = {"prompt_ids": [], "prompt": [], "answer": [], "step": []}
        for p in prompts:
            # the chat template (task.chat_template) carries its own special tokens: add none
            text = render_prompt(p, self.tokenizer, chat_template=t.chat_template, system_prompt=t.system_prompt)
            ids = torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)
            for _ in range(a.group_size):
                columns["prompt_ids"].append(ids)
                columns["prompt"].append(p.text)
                columns["answer"].append(p.answer)
                columns["step"].append(self.step)
        self.step += 1
        return Output(columns, group_size=a.group_size)

    async def close(self) -> None:
        pass
