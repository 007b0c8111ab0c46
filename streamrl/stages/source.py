"""The source stage: prompts from a task, ``group_size`` samples per prompt, one step at a time.

It writes ``prompt_ids`` (tokens: the prompt rendered through the chat template when
``task.chat_template`` is set), ``prompt`` and ``answer`` (text) and ``step``, and, when the
pipeline declares it among its writes, ``sample_key`` (``step * batch_size + slot``: a sample's
identity across resumes, see :mod:`streamrl.runtime.checkpoints`). Before the prompts of step s
it waits for policy version s - max_staleness: with 0 the whole pipeline is synchronous
on-policy; with k >= 1 generation may run k versions ahead of training.

Resumed (``ctx.resume``), it replays its prompt stream up to the checkpoint's position (the
prompts are drawn again and dropped, which restores the RNG and a dataset's shuffled order
exactly) and emits every sample the saved policy has not trained on: the keys at or above
``trained_below`` that are not in ``trained_extra``. A group of which some samples were trained
comes back with its other samples only, as a smaller group.
"""

from __future__ import annotations

import random
from typing import Annotated, Any

import msgspec
import torch
from msgspec import Meta

from streamrl.runtime.checkpoints import TrainedKeys
from streamrl.runtime.stage import Output, StageContext
from streamrl.stages.common import build_task, build_tokenizer
from streamrl.tasks.chat import render_prompt


class SourceOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the source stage (streamrl.stages.source:SourceStage)."""

    gate_on_policy: Annotated[bool, Meta(description=(
        "Wait for policy version step - algo.max_staleness before making each step's prompts"))] = True


class SourceStage:
    Options = SourceOptions  # checked when the pipeline loads
    uses_model_and_task = True  # the pre-run checks load the run's tokenizer and task (streamrl.runtime.prerun)

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.tokenizer = build_tokenizer(cfg)
        self.task = build_task(cfg, self.tokenizer)
        self.rng = random.Random(cfg.task.seed)
        self.step = 0
        self.gate = msgspec.convert(ctx.options, SourceOptions).gate_on_policy
        self.with_keys = "sample_key" in ctx.spec.writes
        self.trained = TrainedKeys()
        self.pending: list[Output] = []  # a resumed step's partial groups, emitted one group size at a time
        if ctx.resume is not None:
            st = ctx.resume.state
            self.trained = TrainedKeys(st.trained_below, st.trained_extra)
            first = st.trained_below // cfg.batch_size
            for _ in range(first):  # replay: the same draws as the interrupted run made
                self.task.make_prompts(self.rng, cfg.algo.prompts_per_step)
            self.step = first

    async def wait_ready(self) -> None:
        """Before the prompts of step s: policy version s - max_staleness (the runtime awaits this
        before ``produce``, so the wait does not count as the source's busy time)."""
        a = self.ctx.config.algo
        if self.gate and self.step < a.steps and not self.pending:
            await self.ctx.policy.wait_version(self.step - a.max_staleness)

    async def produce(self) -> Output | None:
        a = self.ctx.config.algo
        while not self.pending:
            if self.step >= a.steps:
                return None
            await self.wait_ready()  # at once when the runtime already awaited it
            self.pending = self._make_step()
            self.step += 1
        return self.pending.pop(0)

    def _make_step(self) -> list[Output]:
        """The samples of source step ``self.step`` not yet trained on, as Outputs of one group size each."""
        a, t = self.ctx.config.algo, self.ctx.config.task
        prompts = self.task.make_prompts(self.rng, a.prompts_per_step)
        base = self.step * self.ctx.config.batch_size
        by_size: dict[int, dict[str, list[Any]]] = {}
        for g, p in enumerate(prompts):
            keys = [base + g * a.group_size + j for j in range(a.group_size)]
            keys = [k for k in keys if k not in self.trained]
            if not keys:
                continue
            # the chat template (task.chat_template) carries its own special tokens: add none
            text = render_prompt(p, self.tokenizer, chat_template=t.chat_template, system_prompt=t.system_prompt)
            ids = torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)
            columns = by_size.setdefault(len(keys), {"prompt_ids": [], "prompt": [], "answer": [], "step": [],
                                                     "sample_key": []})
            for k in keys:
                columns["prompt_ids"].append(ids)
                columns["prompt"].append(p.text)
                columns["answer"].append(p.answer)
                columns["step"].append(self.step)
                columns["sample_key"].append(k)
        outputs = []
        for size in sorted(by_size, reverse=True):  # whole groups first
            columns = by_size[size]
            if not self.with_keys:
                del columns["sample_key"]
            outputs.append(Output(columns, group_size=size))
        return outputs

    async def close(self) -> None:
        pass
