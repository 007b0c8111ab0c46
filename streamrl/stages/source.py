"""The source stage: prompts from a task, ``group_size`` samples per prompt, one step at a time.

It writes those of these columns the pipeline declares among its writes: ``prompt_ids`` (tokens:
the prompt rendered through the chat template when ``task.chat_template`` is set), ``prompt`` and
``answer`` (text), ``step``, and ``sample_key`` (``step * batch_size + slot``: a sample's identity
across resumes, see :mod:`streamrl.runtime.checkpoints`). An agent pipeline leaves ``prompt_ids``
out: its agent stage renders the conversation itself (:mod:`streamrl.stages.agent`). Before the prompts of step s
it waits for policy version s - max_staleness: with 0 the whole pipeline is synchronous
on-policy; with k >= 1 generation may run k versions ahead of training. It waits for one version
less, s - max_staleness - 1, where every stage that reads ``step`` claims one step's prompts at a
time (:func:`streamrl.stages.common.source_runs_ahead`): step s's prompts are then made, put and claimed
before version s - max_staleness is out, and generation starts as soon as it is installed.

With ``algo.dynamic_sampling.enabled`` (DAPO: a filter stage drops groups whose rewards are all
equal, :mod:`streamrl.stages.filter`) it makes *waves* of groups instead of one batch per step,
drawing prompts one group at a time, so a sample's key is ``group * group_size + member`` (the
same numbers as above when every wave is a whole step). Before each wave it reads the dock's
counts of samples dropped (discarded by the filter, or too stale for the trainer) and fills the
shortfall of the samples still alive against what the steps generation may run ahead to need,
``batch_size x (version + 1 + max_staleness)`` (counted from this run's start or resume), at most
``prompts_per_step`` groups a wave. With ``algo.dynamic_sampling.token_budget`` a step's size is
the trainer's to decide (it trains micro-batch rounds until the step's response tokens reach the
budget), so the source keeps samples on their way to the trainer (made, not yet taken by it nor
dropped) instead: the rest of the current step and ``max_staleness`` steps more, at the mean step
size so far (``batch_size`` before the first step), and never less than one round, so the
trainer never waits for want of samples and, at a steady step size, none waits past
``max_staleness`` versions. Synchronous (``max_staleness: 0``) it first waits until the
filter has judged everything it made, so a wave is exactly the groups the step still lacks:
nothing is made that the step does not train on or the filter drop, and the waves (hence the
samples) depend only on the seed, which is what makes a resumed run equal an uninterrupted one.
``algo.dynamic_sampling.max_rounds`` caps the groups made per step. A sample's ``step`` column
says which version may generate it (the newest at the time of its wave).

Resumed (``ctx.resume``), it replays its prompt stream up to the checkpoint's position (the
prompts are drawn again and dropped, which restores the RNG and a dataset's shuffled order
exactly) and emits every sample the saved policy has not trained on: the keys at or above
``trained_below`` that are not in ``trained_extra``. A group of which some samples were trained
comes back with its other samples only, as a smaller group.
"""

from __future__ import annotations

import math
import random
from typing import Annotated, Any

import anyio
import msgspec
import torch
from msgspec import Meta

from streamrl.config import ConfigError, RunConfig
from streamrl.runtime.checkpoints import TrainedKeys
from streamrl.runtime.pipeline import (
    PipelineSpec,
    StageSpec,
    class_says,
    import_stage_class,
    step_share,
    trainer_stages,
)
from streamrl.runtime.policy import PolicyTimeout
from streamrl.runtime.stage import Output, StageContext
from streamrl.stages.common import build_task, build_tokenizer, source_runs_ahead
from streamrl.tasks.chat import render_prompt

SOURCE_COLUMNS = ("prompt_ids", "prompt", "answer", "step", "sample_key")  # what it can write
# dynamic sampling: how long the controller holds the source's long poll of the dock's figures when
# none of them changes (then it answers as they are, and the source asks again)
FOLLOW_DOCK_S = 5.0
# dynamic sampling ahead of training (max_staleness > 0): a wave smaller than prompts_per_step waits
# this long for more drops first. Made at each drop, waves would be a group or two each, and so
# would the generator's batches, whose cost is mostly per batch (docs/benchmarks.md §29)
COALESCE_S = 0.01


class OverGenerationCapReached(RuntimeError):
    """Dynamic sampling made ``algo.dynamic_sampling.max_rounds`` rounds per step and the filter still
    dropped too much for a step's quota."""


def discarding_stages(pipeline: PipelineSpec) -> list[str]:
    """The stages of ``pipeline`` that drop samples from the run (their class's ``discards`` says so
    for them: True, or a function of the spec)."""
    return [s.name for s in pipeline.stages if class_says(import_stage_class(s.cls), "discards", s)]


def _round_samples(train: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> int:
    """Samples a train stage takes per micro-batch round: one claim of each model replica."""
    share = step_share(train, import_stage_class(train.cls), pipeline, cfg)
    return cfg.batch_size // share * min(train.micro_batch, share)


class SourceOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the source stage (streamrl.stages.source:SourceStage)."""

    gate_on_policy: Annotated[bool, Meta(description=(
        "Wait for policy version step - algo.max_staleness before making each step's prompts (one version less "
        "where every stage that reads step claims one step's prompts at a time, as the generate stage of "
        "placement separate does: a step's prompts then wait in the dock for their version)"))] = True


class SourceStage:
    Options = SourceOptions  # checked when the pipeline loads
    uses_model_and_task = True  # the pre-run checks load the run's tokenizer and task (streamrl.runtime.prerun)

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        """Before anything starts (``validate_pipeline``): it can make every column it declares, and
        dynamic sampling has a stage that drops groups."""
        unknown = [c for c in spec.writes if c not in SOURCE_COLUMNS]
        if unknown:
            raise ConfigError(f"{pipeline.where}: stage {spec.name!r} writes {unknown}, which the source does not "
                              f"make; it writes any of {list(SOURCE_COLUMNS)}")
        if cfg.algo.dynamic_sampling.enabled and not discarding_stages(pipeline):
            raise ConfigError(f"{pipeline.where}: algo.dynamic_sampling.enabled needs a stage that drops "
                              "uninformative groups (streamrl.stages.filter:FilterStage between score and advantage, "
                              "as a stage or a chain's link: pipelines/dapo_rollout.yaml, pipelines/dapo.yaml; or an "
                              "agent stage with options.lost_sessions: drop); use such a pipeline (e.g. "
                              "pipeline=pipelines/dapo_rollout.yaml) or set enabled: false")
        if cfg.algo.dynamic_sampling.enabled and "sample_key" not in spec.writes:
            raise ConfigError(f"{pipeline.where}: stage {spec.name!r}: algo.dynamic_sampling needs sample keys (which "
                              "samples a step trained, which a checkpoint covers): add sample_key to the source's "
                              "writes and the train stage's reads, as pipelines/dapo.yaml does")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self.tokenizer = build_tokenizer(cfg)
        self.task = build_task(cfg, self.tokenizer)
        self.rng = random.Random(cfg.task.seed)
        self.step = 0
        self.gate = msgspec.convert(ctx.options, SourceOptions).gate_on_policy
        # a step's prompts go out one version before theirs (synchronous: while the step before
        # trains), where every stage that reads their step takes one step's prompts a claim (one
        # produce is one dock reserve): the generators then have them when the version comes out
        self.ahead = int(source_runs_ahead(cfg, ctx.pipeline))
        self.columns = [c for c in SOURCE_COLUMNS if c in ctx.spec.writes]
        self.trained = TrainedKeys()
        self.pending: list[Output] = []  # a resumed step's partial groups, emitted one group size at a time
        self.dynamic = cfg.algo.dynamic_sampling.enabled
        # dynamic sampling: the filter stages (their dock consumers' done counts are what they judged)
        self.filters = discarding_stages(ctx.pipeline) if self.dynamic and ctx.pipeline is not None else []
        # a token budget: the train stages (their dock counts say what they took) and their round size
        self.trainers: list[str] = []
        self.round = cfg.batch_size
        if self.dynamic and ctx.pipeline is not None:
            trainers = trainer_stages(ctx.pipeline)
            self.trainers = [st.name for st in trainers]
            self.round = max((_round_samples(st, ctx.pipeline, cfg) for st in trainers), default=cfg.batch_size)
        self.first_version = 0  # the policy version this run (or this resume) started from
        self.emitted = 0  # samples emitted since then (dynamic sampling's demand count)
        self.groups_made = 0  # dynamic sampling: groups drawn over the run (keys: group * group_size + member)
        self.first_group = 0  # groups_made when this run (or this resume) began
        self.boundary = (0, 0)  # a token budget: (a version, samples the trainer had taken when the source saw it)
        self.wave: tuple[int, int] | None = None  # the next wave's (groups, version), once the demand is there
        self.reported: dict[str, float] = {}  # the dynamic-sampling figures last sent as stage metrics
        # dynamic sampling: the demand changes with each new policy version and with the dock's figures
        # (drops, what the filters judged, what the trainers took). Two background tasks follow them,
        # one long poll each, and wake the demand loop at each change; polling either every few ms
        # would cost the trainer, the controller and this process a round trip each time
        self.changed = anyio.Event()
        self.dock_figures: dict[str, Any] | None = None  # the controller's stats as of its last change
        self.follow_error: Exception | None = None  # a follower's failure, raised by the demand loop
        self.following_dock = False  # started with the first wait: the worker opens its dock client after setup
        if self.dynamic:
            ctx.tasks.start_soon(self._follow_versions)  # type: ignore[attr-defined]  # the worker's task group
        if ctx.resume is not None:
            st = ctx.resume.state
            self.trained = TrainedKeys(st.trained_below, st.trained_extra)
            self.first_version = st.version
            a = cfg.algo
            if self.dynamic:
                self.groups_made = self.first_group = st.trained_below // a.group_size
                for _ in range(self.groups_made):  # replay: the same draws as the interrupted run made
                    self.task.make_prompts(self.rng, 1)
            else:
                self.step = st.trained_below // cfg.batch_size
                for _ in range(self.step):
                    self.task.make_prompts(self.rng, a.prompts_per_step)

    async def wait_ready(self) -> None:
        """Before the prompts of step s: policy version s - max_staleness (the runtime awaits this
        before ``produce``, so the wait does not count as the source's busy time)."""
        a = self.ctx.config.algo
        if self.dynamic:
            if not self.pending and self.wave is None:
                self.wave = await self._wait_for_demand()
        elif self.gate and self.step < a.steps and not self.pending:
            # not a step sooner: a generator's claim can take samples of two steps at once (a
            # micro-batch larger than a step, leases that came back), and the batch then needs the newer
            # step's version; at s - max_staleness every claimable sample's version is out already, so
            # no batch can wait on a version that needs its own samples trained (one step more
            # where no claim takes two steps' prompts: self.ahead)
            await self.ctx.policy.wait_version(self.step - a.max_staleness - self.ahead)

    async def _wait_for_demand(self) -> tuple[int, int]:
        """Dynamic sampling: until the samples alive (made, not dropped) fall short of what the steps
        generation may run ahead to need (synchronous: and the filter has judged all it was given).
        Returns (the groups to make, the newest policy version known)."""
        cfg, a, policy = self.ctx.config, self.ctx.config.algo, self.ctx.policy
        if not self.following_dock:
            self.following_dock = True
            self.ctx.tasks.start_soon(self._follow_dock)  # type: ignore[attr-defined]  # the worker's task group
        coalesced = False
        while True:
            changed = self.changed  # taken before reading what it guards: no change between is missed
            if self.follow_error is not None:
                raise self.follow_error
            stats = self.dock_figures
            if stats is None:  # the first answer is on its way
                await changed.wait()
                continue
            version = policy.known_version
            discarded = int(stats.get("samples_discarded", 0))
            dropped = discarded + int(stats.get("dropped_stale", 0))
            # what every dropping stage has judged (done for it: kept, dropped, or dropped by another)
            judged = min((int(stats["consumers"].get(name, {}).get("done", 0)) for name in self.filters), default=0)
            steps = min(version - self.first_version + 1 + a.max_staleness, a.steps - self.first_version)
            if a.dynamic_sampling.token_budget:
                short = self._short_of_rounds(stats, version, dropped)
            else:
                short = cfg.batch_size * steps - (self.emitted - dropped)
            settled = a.max_staleness > 0 or judged >= self.emitted  # synchronous: every wave judged
            figures = {"groups_made": float(self.groups_made), "discarded_samples": float(discarded),
                       "stale_samples": float(dropped - discarded)}
            if figures != self.reported:  # not one message per poll
                self.ctx.report_metrics(figures)
                self.reported = figures
            if short > 0 and settled:
                groups = min(-(-short // a.group_size), a.prompts_per_step)
                if a.max_staleness > 0 and groups < a.prompts_per_step and not coalesced:
                    coalesced = True
                    await anyio.sleep(COALESCE_S)
                    continue
                cap = a.dynamic_sampling.max_rounds * a.prompts_per_step * steps  # since this run (or resume) began
                if cap and self.groups_made - self.first_group + groups > cap:
                    raise OverGenerationCapReached(
                        f"dynamic sampling needs more than {cap} groups for {steps} step(s) "
                        f"(algo.dynamic_sampling.max_rounds={a.dynamic_sampling.max_rounds} rounds of "
                        f"prompts_per_step={a.prompts_per_step} per step): the filter dropped {discarded} of the "
                        f"{self.emitted} samples made, groups whose rewards are all equal. Raise max_rounds (0 = no "
                        "cap); if most groups are all solved or all failed, the prompts are too easy or too hard for "
                        "the policy, or stop earlier (algo.stop_reward)" + (
                            f". With algo.dynamic_sampling.token_budget={a.dynamic_sampling.token_budget} the cap "
                            "counts rounds of prompts_per_step: set prompts_per_step x group_size near a step's "
                            "samples (the budget over the mean response length)" if a.dynamic_sampling.token_budget
                            else ""))
                return groups, version
            await changed.wait()  # a new version, a drop, a judgement or a take

    def _wake(self) -> None:
        event, self.changed = self.changed, anyio.Event()
        event.set()

    async def _follow_versions(self) -> None:
        """Dynamic sampling: wait for each next policy version, one long poll at a time, and wake the
        demand loop at each."""
        policy = self.ctx.policy
        while True:
            try:
                await policy.wait_version(policy.known_version + 1)
            except PolicyTimeout:  # the publisher is slow or gone: ask again (the run's own watchdogs act)
                continue
            self._wake()

    async def _follow_dock(self) -> None:
        """Dynamic sampling: keep ``dock_figures`` current, one long poll of the controller at a time,
        answered when a watched figure changes: the drops, the filters' done counts (what they judged)
        and, with a token budget, the trainers' done and claimed counts (what they took). A failure
        is kept for the demand loop to raise (once the source has finished, the dock client closes
        under this task: nothing waits for it then)."""
        assert self.ctx.dock_statistics is not None, "a source runs with its worker's dock client open"
        watch = self.filters + (self.trainers if self.ctx.config.algo.dynamic_sampling.token_budget else [])
        seen: int | None = None
        try:
            while True:
                stats = await self.ctx.dock_statistics(watch=watch, seen=seen, timeout=FOLLOW_DOCK_S)
                if stats["watched"] != seen:  # (at the timeout: the same figures)
                    seen = stats["watched"]
                    self.dock_figures = stats
                    self._wake()
        except Exception as exc:
            self.follow_error = exc
            self._wake()

    def _short_of_rounds(self, stats: dict[str, Any], version: int, dropped: int) -> int:
        """A token budget: the samples the trainer lacks to finish its step and train ``max_staleness``
        more, at the mean step size so far, and never less than one round (a trainer waiting in a
        claim lacks a round: then this is > 0)."""
        a = self.ctx.config.algo
        if not self.first_version <= version < a.steps:  # (resumed: the checkpoint's version is not yet seen)
            return 0
        counts = [stats["consumers"].get(name, {}) for name in self.trainers]
        done = sum(int(c.get("done", 0)) for c in counts) - dropped  # drops are done for the trainer too
        taken = done + sum(int(c.get("claimed", 0)) for c in counts)  # trained, or in training now
        if version != self.boundary[0]:
            # the first look at this version: the samples the trainer acked so far are its steps up to
            # it (its last round may not be acked yet; the samples it holds may already be the next
            # step's: the boundary errs low, hence the partial step high and the demand low)
            self.boundary = (version, done)
        steps = version - self.first_version
        size = self.boundary[1] / steps if steps > 0 else float(self.ctx.config.batch_size)
        ahead = min(a.max_staleness, a.steps - version - 1)
        need = max(size - (taken - self.boundary[1]), 0.0) + size * ahead
        return max(math.ceil(need), self.round) - (self.emitted - dropped - taken)

    async def produce(self) -> Output | None:
        a = self.ctx.config.algo
        if self.dynamic:
            while not self.pending:  # (a resumed wave may hold only samples trained already)
                await self.wait_ready()  # at once when the runtime already awaited it
                assert self.wave is not None
                (groups, version), self.wave = self.wave, None
                # the wave may be generated by the newest version there is (its step - max_staleness)
                self.pending = self._make_wave(groups, version + a.max_staleness)
                self.emitted += sum(len(out.columns["prompt"]) for out in self.pending)
            return self.pending.pop(0)
        while not self.pending:
            if self.step >= a.steps:
                return None
            await self.wait_ready()  # at once when the runtime already awaited it
            prompts = self.task.make_prompts(self.rng, a.prompts_per_step)
            self.pending = self._outputs(prompts, self.step * self.ctx.config.batch_size, self.step)
            self.step += 1
        return self.pending.pop(0)

    def _make_wave(self, groups: int, step: int) -> list[Output]:
        """Dynamic sampling: the next ``groups`` groups, prompts drawn one group at a time (a resume
        replays the same draws whatever the waves were)."""
        first = self.groups_made
        prompts = [p for _ in range(groups) for p in self.task.make_prompts(self.rng, 1)]
        self.groups_made += groups
        return self._outputs(prompts, first * self.ctx.config.algo.group_size, step)

    def _outputs(self, prompts: list[Any], base: int, step: int) -> list[Output]:
        """The samples of ``prompts`` (one group each, keys from ``base``) not yet trained on, as
        Outputs of one group size each; their ``step`` column is ``step``."""
        a = self.ctx.config.algo
        by_size: dict[int, dict[str, list[Any]]] = {}
        for g, p in enumerate(prompts):
            keys = [base + g * a.group_size + j for j in range(a.group_size)]
            keys = [k for k in keys if k not in self.trained]
            if not keys:
                continue
            ids = self._prompt_ids(p) if "prompt_ids" in self.columns else None
            columns = by_size.setdefault(len(keys), {c: [] for c in SOURCE_COLUMNS})
            for k in keys:
                columns["prompt_ids"].append(ids)
                columns["prompt"].append(p.text)
                columns["answer"].append(p.answer)
                columns["step"].append(step)
                columns["sample_key"].append(k)
        outputs = []
        for size in sorted(by_size, reverse=True):  # whole groups first
            outputs.append(Output({c: by_size[size][c] for c in self.columns}, group_size=size))
        return outputs

    def _prompt_ids(self, prompt: Any) -> torch.Tensor:
        # the chat template (task.chat_template) carries its own special tokens: add none
        t = self.ctx.config.task
        text = render_prompt(prompt, self.tokenizer, chat_template=t.chat_template, system_prompt=t.system_prompt)
        return torch.tensor(self.tokenizer.encode(text, add_special_tokens=False), dtype=torch.int64)

    async def close(self) -> None:
        pass
