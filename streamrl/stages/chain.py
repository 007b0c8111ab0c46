"""The chain stage: several cheap stages run one after the other on one claimed micro-batch.

Why: each stage of a pipeline pays, per micro-batch, a claim, a fetch and a put (carrying the
ack) to the dock (each a ZeroMQ round trip, paid in asyncio and libzmq at both ends), and runs in
a process of its own. For stages whose compute is small (scoring with an in-process rule, group
advantages) those hops cost more CPU than the work; on a machine with few cores that CPU is
taken from generation and training. A chain claims once, runs its links in order, each link
seeing the columns the chain read plus what the links before it wrote, and puts what all the
links wrote in one put (docs/benchmarks.md §27 measures it).

```yaml
  - name: reward
    class: streamrl.stages.chain:ChainStage
    reads: [prompt, answer, response_ids]   # what the links read that no earlier link writes
    writes: [reward, advantage]             # every link's writes, in order
    whole_groups: true                      # claims as its links need (advantage: whole groups)
    micro_batch: 64
    options:
      links:
        - name: score
          class: streamrl.stages.score:ScoreStage
          reads: [prompt, answer, response_ids]
          writes: [reward]
          options: {}                       # the link's own options, checked as its class checks them
        - name: advantage
          class: streamrl.stages.advantage:AdvantageStage
          reads: [reward]
          writes: [advantage]
```

Each link is checked as the stage it would be on its own (its ``Options``, ``check_options``,
``check_spec``), with the chain's workers, micro-batch, device, threads and whole groups; an
error names ``options.links[k]``. A link is a processing stage (it reads columns): the chain
refuses sources and side stages, trainers (``publishes_policy`` or ``claim_size``) and chains. A
generator (``generates``) may be a link in placement ``separate`` (pipelines/grpo_rollout.yaml:
generate, score, advantage): the chain is then the run's rollout worker, which waits for its
policy version as the generate stage does and scores what it made before the one put; the hops
from generation to the trainer drop from three to one. A link may drop samples
(``Output.discard``, the filter: pipelines/dapo_chained.yaml): the links after it get only the
samples it kept, and the chain drops them from the run. The chain is restartable where each of its
links is, and drops samples where one of them does (the source then makes more).

A link reports its metrics as the chain's, named ``<link>/<name>`` (e.g. ``reward/score/latency_p50_ms``);
the chain's busy time is ``busy/<chain>``; in the run's trace each link's call is a span named after
the link inside the chain's batch.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from streamrl.config import ConfigError, RunConfig
from streamrl.metrics.trace import tracer
from streamrl.runtime.pipeline import (
    PipelineSpec,
    StageSpec,
    check_stage_class,
    class_says,
    import_object,
    import_stage_class,
    is_plain_name,
)
from streamrl.runtime.stage import Batch, Output, StageContext, as_output


class ChainLink(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={"cls": "class"}):
    """One link of a chain: a processing stage's class, the columns it reads and writes, its options."""

    name: Annotated[str, Meta(description="Names the link's metrics (<chain>/<link>/<name>) and its errors")]
    cls: Annotated[str, Meta(description="The link's stage class, module:Class (as a stage's `class`)")]
    reads: Annotated[list[str], Meta(description="Columns it reads: the chain's reads, or an earlier link's writes")]
    writes: Annotated[list[str], Meta(description="Columns it writes; the chain writes every link's")]
    options: Annotated[dict[str, Any], Meta(description=(
        "The link class's own options, checked as its class checks them"))] = msgspec.field(default_factory=dict)


class ChainOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Options of the chain stage (streamrl.stages.chain:ChainStage): the stages it runs one after
    the other on each claimed micro-batch, sharing one claim, fetch and put."""

    links: Annotated[list[ChainLink], Meta(description=(
        "The links, in the order they run: each {name, class: module:Class, reads, writes, options}, a processing "
        "stage checked as one of its own (with the chain's workers, micro_batch, device, threads, whole_groups). "
        "A link reads the chain's columns or an earlier link's; the chain reads and writes what its links need and "
        "make. A link that drops samples leaves the links after it only those it kept. A generator may be a link in "
        "placement separate. Not chainable: trainers, chains"))]


# class attributes that make a stage something other than one batch in, columns out
_REFUSED_FLAGS = {
    "publishes_policy": "it trains the policy (a trainer claims to fill its steps)",
}


def link_specs(spec: StageSpec) -> list[StageSpec]:
    """The stage spec each link of chain ``spec`` has: its own name, class, reads, writes and
    options; the chain's workers, micro-batch, device, threads and claim of whole groups."""
    options = msgspec.convert(spec.options, ChainOptions)
    return [StageSpec(name=link.name, cls=link.cls, reads=list(link.reads), writes=list(link.writes),
                      workers=spec.workers, micro_batch=spec.micro_batch, device=spec.device, threads=spec.threads,
                      whole_groups=spec.whole_groups, options=dict(link.options))
            for link in options.links]


def _links_say(spec: StageSpec, flag: str) -> list[bool]:
    """What each link's class says of ``flag`` for its spec; [] where the options are not links
    (the pipeline check reports that)."""
    try:
        links = link_specs(spec)
    except msgspec.ValidationError:
        return []
    return [class_says(import_stage_class(link.cls), flag, link) for link in links]


class ChainStage:
    Options = ChainOptions  # checked when the pipeline loads, then check_spec checks each link

    @staticmethod
    def restartable(spec: StageSpec) -> bool:
        """Where each link is: the chain keeps no state of its own between micro-batches."""
        says = _links_say(spec, "restartable")
        return bool(says) and all(says)

    @staticmethod
    def discards(spec: StageSpec) -> bool:
        """Where a link drops samples (the filter): the source then makes more (streamrl.stages.source)."""
        return any(_links_say(spec, "discards"))

    @staticmethod
    def uses_model_and_task(spec: StageSpec) -> bool:
        """Where a link does: the pre-run checks then load the run's model and task."""
        return any(_links_say(spec, "uses_model_and_task"))

    @staticmethod
    def generates(spec: StageSpec) -> bool:
        """Where a link generates: the pre-run checks then fit prompt + completion to the model."""
        return any(_links_say(spec, "generates"))

    @staticmethod
    def fetches_policy(spec: StageSpec) -> bool:
        """Where a link does (a generate link in placement separate): the trainer publishes weights."""
        return any(_links_say(spec, "fetches_policy"))

    @staticmethod
    def claims_one_step(spec: StageSpec) -> bool:
        """Where a link does (a generate link): the chain's claims are its links' claims."""
        return any(_links_say(spec, "claims_one_step"))

    @classmethod
    def check_spec(cls, spec: StageSpec, pipeline: PipelineSpec, cfg: RunConfig) -> None:
        """Before anything starts: each link is a stage the chain can run, checked as a stage of its
        own, and the chain's reads and writes are exactly what its links need and make."""
        at = f"{pipeline.where}: stage {spec.name!r}"
        links = link_specs(spec)
        if not links:
            raise ConfigError(f"{at} options.links: a chain needs at least one link")
        available = set(spec.reads)  # the columns a link may read: the chain's, and earlier links' writes
        needed: list[str] = []
        written: list[str] = []
        for k, link in enumerate(links):
            where = f"{at} options.links[{k}] ({link.name!r})"
            if not is_plain_name(link.name) or link.name in [ln.name for ln in links[:k]]:
                raise ConfigError(f"{where}: name must be letters, digits, '-' or '_', and unique among the chain's "
                                  "links")
            try:
                link_cls = import_object(link.cls, "class")
            except ValueError as exc:
                raise ConfigError(f"{where}.class: {exc}") from None
            if isinstance(link_cls, type) and issubclass(link_cls, ChainStage):
                raise ConfigError(f"{where}.class: a chain cannot be a link of a chain; list its links here instead")
            for flag, why in _REFUSED_FLAGS.items():
                if class_says(link_cls, flag, link):
                    raise ConfigError(f"{where}.class: {link.cls!r} cannot be chained: {why}; make it a stage of "
                                      "its own")
            if class_says(link_cls, "generates", link) and pipeline.placement != "separate":
                raise ConfigError(f"{where}.class: a chain generates in placement separate only (its own engine, "
                                  f"fed by the publisher); this pipeline's placement is {pipeline.placement!r}: make "
                                  f"{link.name!r} a stage of its own")
            if callable(getattr(link_cls, "claim_size", None)):
                raise ConfigError(f"{where}.class: {link.cls!r} cannot be chained: it sizes its own claims "
                                  "(claim_size); make it a stage of its own")
            if not link.reads:
                raise ConfigError(f"{where}.reads: a link processes claimed samples, so it reads columns; a "
                                  "source or a side stage is a stage of its own")
            if not link.writes:
                raise ConfigError(f"{where}.writes: a link that writes nothing adds nothing to the chain")
            for col in link.reads:
                if col not in available:
                    later = [ln.name for ln in links[k + 1:] if col in ln.writes]
                    why = (f"link {later[0]!r}, which comes after it, writes it: put the links in the order "
                           "they need" if later else f"add it to the chain's reads (it reads {spec.reads})")
                    raise ConfigError(f"{where}.reads: {col!r} is neither read by the chain nor written by an "
                                      f"earlier link; {why}")
                if col in spec.reads and col not in needed:
                    needed.append(col)
            for col in link.writes:
                if col in written or col in spec.reads:
                    raise ConfigError(f"{where}.writes: {col!r} is already "
                                      f"{'written by an earlier link' if col in written else 'read by the chain'} "
                                      "(columns are write-once)")
                written.append(col)
                available.add(col)
            # as a stage of its own, in this pipeline: its errors then name the chain and the link
            link_pipeline = msgspec.structs.replace(pipeline, path=f"{at} options.links[{k}]")
            check_stage_class(link, f"{where} class", link_pipeline, cfg)
        unread = [c for c in spec.reads if c not in needed]
        if unread:
            raise ConfigError(f"{at}: reads {unread}, which no link reads; remove them from its reads")
        if sorted(written) != sorted(spec.writes):
            raise ConfigError(f"{at}: writes {spec.writes} but its links write {written}; the chain's writes must "
                              f"be its links' writes: set writes: {written}")

    async def setup(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.links: list[tuple[StageSpec, Any]] = []
        try:
            for link in link_specs(ctx.spec):
                stage = import_object(link.cls, "class")()
                link_ctx = dataclasses.replace(ctx, spec=link, control=_LinkControl(ctx.control, link.name))
                if hasattr(ctx, "tasks"):  # the worker's task group, for links that serve in the background
                    link_ctx.tasks = ctx.tasks  # type: ignore[attr-defined]
                await stage.setup(link_ctx)
                self.links.append((link, stage))
        except BaseException:
            await self.close()  # the links already set up, so nothing they opened is left behind
            raise
        self.claims_one_reserve = any(getattr(stage, "claims_one_reserve", False) for _, stage in self.links)

    async def wait_ready_for(self, batch: Batch) -> None:
        """What the links wait for before a batch (a generate link: its policy version), outside
        the chain's busy time."""
        for _, stage in self.links:
            wait_ready = getattr(stage, "wait_ready_for", None)
            if wait_ready is not None:
                await wait_ready(batch)

    async def process(self, batch: Batch) -> Output:
        n = len(batch.samples)
        columns = dict(batch.columns)  # batch-long; each link's columns replace or join them
        written: dict[str, list[Any]] = {c: [None] * n for c in self.ctx.spec.writes}  # a dropped sample's stay None
        versions: list[int] | None = None  # set once a link sets its samples' versions (lengths likewise)
        lengths: list[int] | None = None
        discard = [False] * n
        kept = list(range(n))  # the batch positions no link has dropped, which the next link gets
        for link, stage in self.links:
            if not kept:  # every sample was dropped: nothing left to process
                break
            samples = [batch.samples[i] for i in kept]
            with tracer().span(link.name, "batch", "chain", samples=len(samples)):  # inside the chain's batch
                result = await stage.process(Batch(samples, {c: [columns[c][i] for i in kept] for c in link.reads}))
            try:
                out = as_output(result, link.writes, len(kept))
            except ValueError as exc:
                raise ValueError(f"chain link {link.name!r}: {exc}") from None
            for c, values in out.columns.items():
                _scatter(written[c], kept, values)
                columns[c] = written[c]
            if out.versions is not None:
                versions = _scatter(versions or batch.versions, kept, out.versions)
            if out.lengths is not None:
                lengths = _scatter(lengths or batch.lengths, kept, out.lengths)
            if out.discard is not None and any(out.discard):
                for i, drop in zip(kept, out.discard, strict=True):
                    discard[i] = discard[i] or bool(drop)
                kept = [i for i in kept if not discard[i]]
        return Output(written, versions=versions, lengths=lengths, discard=discard if any(discard) else None)

    async def close(self) -> None:
        """Closes every link set up, the last first, even where one fails; then raises the first error."""
        error: BaseException | None = None
        for _, stage in reversed(getattr(self, "links", [])):
            try:
                await stage.close()
            except BaseException as exc:  # the other links still close
                error = error or exc
        self.links = []
        if error is not None:
            raise error


def _scatter(into: list[Any], positions: list[int], values: list[Any]) -> list[Any]:
    """``into`` with ``values`` at ``positions`` (in place)."""
    for i, v in zip(positions, values, strict=True):
        into[i] = v
    return into


class _LinkControl:
    """The worker's control channel as a link sees it: its metrics named ``<link>/<name>``."""

    def __init__(self, control: Any, link: str) -> None:
        self._control = control
        self._link = link

    def stage_metrics(self, metrics: dict[str, float], *, defer: bool = False) -> None:
        self._control.stage_metrics({f"{self._link}/{k}": v for k, v in metrics.items()}, defer=defer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._control, name)
