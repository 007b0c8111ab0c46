"""Pipeline configs: the stage graph, loaded from YAML and checked before anything starts.

```yaml
name: grpo
stages:
  - name: generate
    class: streamrl.stages.generate:GenerateStage   # module:Class, a user's own class plugs in alike
    reads: [prompt_ids]
    writes: [response_ids, rollout_logprobs]
    workers: 1            # worker processes of this stage
    micro_batch: 64       # samples per claim
    device: cpu           # default: resources.device of the run config
    threads: 1            # torch intra-op threads per worker
    whole_groups: false   # claim complete groups only (e.g. group-normalised advantages)
    options: {}           # passed to the stage as ctx.options
    colocate_with: train  # run worker k of this stage in the process of worker k of `train`
    weights_from: train   # placement disaggregated: receive each policy version from `train`'s group
```

``placement`` (pipeline level) says how policy weights reach generation: ``separate`` (default:
the trainer publishes full state snapshots that every generator fetches), ``colocated`` (the
train stage's R workers form a torch.distributed group and hand weights to the generate stage
in the same processes through the allgather-swap reshard; see docs/reshard.md §8) or
``disaggregated`` (the train stage's R workers send each version, bucket by bucket, to the
workers of the stage that says ``weights_from: <train stage>``, which join the same
torch.distributed world; see docs/reshard.md §8).

The checks (``validate_pipeline``): names unique; every read column has exactly one writer stage;
no column is written twice; the column graph has no cycle (policy versions are the only way back);
classes import and have the right methods; each stage's ``options`` are the ones its class takes
(``check_options`` and / or an ``Options`` msgspec Struct on the class); resources are
satisfiable (devices exist, workers >= 1). Then ``check_run``, the run as a whole: whole groups vs
claims, the reshard trainers' batch split and worlds, the model's sharding vs tensor_parallel, the
task and its options, a JSONL prompt file's rows (bounded: see ``streamrl.tasks.dataset``), the
model directory, and prompt + ``algo.max_new_tokens`` vs the model's positions. Every error is a
``ConfigError`` naming the file, the stage or dotted key, or the row, and what to change;
``streamrl validate``, ``streamrl run`` and ``streamrl.run`` all get it before anything starts.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from streamrl.config import (
    ConfigError,
    ConfigErrors,
    ConfigProblem,
    RunConfig,
    StageOverride,
    did_you_mean,
    read_yaml_mapping,
    resolve_path,
)
from streamrl.engines.options import EngineName, VllmOptions

log = logging.getLogger("streamrl.pipeline")


class StageSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, rename={"cls": "class"}):
    name: str
    cls: str
    reads: list[str] = msgspec.field(default_factory=list)
    writes: list[str] = msgspec.field(default_factory=list)
    workers: int = 1
    micro_batch: int = 16
    device: str | None = None
    threads: int = 1
    whole_groups: bool = False
    balance_by_length: bool = False
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # name of a stage whose worker k hosts this stage's worker k in one process (shared memory:
    # ctx.shared); both need the same number of workers
    colocate_with: str | None = None
    # placement disaggregated: the train stage whose group sends this stage's workers each policy
    # version (they join its torch.distributed world after its ranks)
    weights_from: str | None = None
    # a worker that dies may be started again (resources.max_restarts): the stage keeps no state
    # between micro-batches. Set from the class's ``restartable = True`` too.
    restartable: bool = False

    @property
    def is_source(self) -> bool:
        """It makes samples: no reads, some writes."""
        return not self.reads and bool(self.writes)

    @property
    def is_side(self) -> bool:
        """It neither reads nor writes dock columns (e.g. evaluation): its ``run()`` works beside
        the dataflow until it returns or the run stops."""
        return not self.reads and not self.writes


PLACEMENTS = ("separate", "colocated", "disaggregated")
# The stage `eval.every > 0` adds to a pipeline that does not list one (streamrl.stages.evaluate).
EVAL_STAGE_NAME = "eval"
EVAL_STAGE_CLASS = "streamrl.stages.evaluate:EvalStage"
_PIPELINE_FIELDS = ["name", "stages", "placement"]


class PipelineSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    stages: list[StageSpec]
    # how weights reach generation: separate | colocated | disaggregated (see the module doc)
    placement: str = "separate"
    path: str = ""

    def stage(self, name: str) -> StageSpec:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def consumers(self) -> list[str]:
        """Stages that claim samples: each must ack every sample before it is freed."""
        return [s.name for s in self.stages if s.reads]

    def weights_receiver(self, train: str) -> StageSpec | None:
        """The stage that takes the policy from reshard train stage ``train``: the one with
        ``colocate_with: train`` (colocated) or ``weights_from: train`` (disaggregated)."""
        return next((s for s in self.stages if train in (s.colocate_with, s.weights_from)), None)

    def process_groups(self) -> list[list[tuple[StageSpec, int]]]:
        """The worker processes to start: each a list of (stage, worker index) run together.

        A stage with ``colocate_with: X`` puts its worker k into the process of X's worker k."""
        hosted: dict[tuple[str, int], list[tuple[StageSpec, int]]] = {}
        for s in self.stages:
            if s.colocate_with is None:
                for k in range(s.workers):
                    hosted[(s.name, k)] = [(s, k)]
        for s in self.stages:
            if s.colocate_with is not None:
                for k in range(s.workers):
                    hosted[(s.colocate_with, k)].append((s, k))
        return list(hosted.values())


def _explain_stage_error(text: str, raw: Any) -> str:
    """msgspec says ``at `$.stages[2].micro_batch```: name the stage, and suggest a field name."""
    m = re.search(r"\$\.stages\[(\d+)\](?:\.(\w+))?", text)
    if not m or not isinstance(raw, dict) or not isinstance(raw.get("stages"), list):
        if text.startswith("Object contains unknown field") and " - at `$." not in text:  # top level
            field = text.split("`")[1]
            return f"unknown top-level field {field!r}{did_you_mean(field, _PIPELINE_FIELDS)}"
        if text.startswith("Object missing required field"):
            field = text.split("`")[1]
            example = "name: my_pipeline" if field == "name" else "stages: [{name: ..., class: module:Class}, ...]"
            at = text.partition(" - at `$")[2].rstrip("`")
            return f"the required field {field!r} is missing{' at ' + at.strip('.') if at else ''}; add e.g. `{example}`"
        return text.replace("$.", "")
    k = int(m.group(1))
    stage = raw["stages"][k] if k < len(raw["stages"]) else {}
    name = stage.get("name", "?") if isinstance(stage, dict) else "?"
    field = m.group(2)
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        known = [f.encode_name for f in msgspec.structs.fields(StageSpec)]
        return f"stage {name!r} (stages[{k}]): unknown field {field!r}{did_you_mean(field, known)}"
    return f"stage {name!r} (stages[{k}]): field {field!r}: {text.split(' - at ')[0]}"


def import_object(spec: str, what: str, *, form: str = "package.module:Name", must_call: bool = False) -> Any:
    """The object ``spec`` (``module:attr``) names, else ValueError naming ``what`` and the fix.
    ``must_call``: it must be callable (a user's function)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be '{form}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    obj = getattr(module, attr, None)
    if obj is None or (must_call and not callable(obj)):
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {'callable ' if must_call else ''}{attr!r}")
    return obj


def _apply_overrides(stage: StageSpec, over: StageOverride) -> StageSpec:
    changes = {k: v for k, v in msgspec.structs.asdict(over).items() if v is not None}
    if "options" in changes:
        changes["options"] = {**stage.options, **changes["options"]}
    return msgspec.structs.replace(stage, **changes)


def load_pipeline(cfg: RunConfig) -> PipelineSpec:
    """The run's pipeline with its per-stage overrides applied, validated, and the whole run checked
    (:func:`check_run`): everything that can be known before a process starts."""
    path = resolve_path(cfg, cfg.pipeline)
    where = str(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "no such file"
        raise ConfigError(f"pipeline {cfg.pipeline!r}: {what} (looked relative to {cfg.config_dir}, the cwd "
                          "and the streamrl checkout); set pipeline to a file such as pipelines/grpo.yaml")
    raw = read_yaml_mapping(path, "pipeline", "a mapping with `name:` and `stages:` (a list of stages)")
    if "path" in raw:
        raise ConfigError(f"{where}: unknown field 'path' (streamrl sets it); known: {_PIPELINE_FIELDS}")
    try:
        spec = msgspec.convert({**raw, "path": where}, PipelineSpec)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_explain_stage_error(str(exc), raw)}") from None
    names = [s.name for s in spec.stages]
    for name in cfg.stages:
        if name not in names and not (name == EVAL_STAGE_NAME and cfg.eval.every > 0):
            raise ConfigError(f"run config: stages.{name} overrides a stage that {where} does not have "
                              f"(stages: {names})")
    spec.stages = [_apply_overrides(s, cfg.stages[s.name]) if s.name in cfg.stages else s for s in spec.stages]
    if cfg.eval.every > 0 and not any(s.cls == EVAL_STAGE_CLASS for s in spec.stages):
        # evaluation is asked for in the run config: it runs as a stage of its own beside the dataflow
        if EVAL_STAGE_NAME in names:
            raise ConfigError(f"{where}: eval.every > 0 adds a stage named {EVAL_STAGE_NAME!r}, but the pipeline "
                              f"already has a stage of that name; rename it, or list {{name: {EVAL_STAGE_NAME}, "
                              f"class: {EVAL_STAGE_CLASS}}} in the pipeline yourself")
        eval_stage = StageSpec(name=EVAL_STAGE_NAME, cls=EVAL_STAGE_CLASS)
        spec.stages.append(_apply_overrides(eval_stage, cfg.stages[EVAL_STAGE_NAME])
                           if EVAL_STAGE_NAME in cfg.stages else eval_stage)
    validate_pipeline(spec, cfg)
    check_run(spec, cfg)
    return spec


def resolve_run_length(cfg: RunConfig) -> RunConfig:
    """The config with its run length final: ``algo.epochs`` turned into ``algo.steps`` from the
    task's train split (ceil(epochs x rows / prompts_per_step)), and the checks that need it
    (the lr schedule's length). The launcher calls it before anything starts."""
    import math

    a = cfg.algo
    if a.epochs is not None:
        try:
            task = _epoch_task(cfg)
        except ConfigError:
            # the run length stays unresolved: check_run reports why the task does not load, together
            # with every other problem (and this error itself if no other check catches it)
            return cfg
        size = getattr(task, "train_size", None)
        if not callable(size):
            raise ConfigError(f"run config: algo.epochs needs a task with a train split of fixed size (a dataset); "
                              f"task {cfg.task.name!r} makes prompts without end: set algo.steps instead")
        rows = int(size())
        steps = max(1, math.ceil(a.epochs * rows / a.prompts_per_step))
        log.info("algo.epochs=%s over %d rows at %d prompts per step: %d steps", a.epochs, rows,
                 a.prompts_per_step, steps)
        # epochs has served its purpose: the resolved config (config.yaml) says steps, and loads again as is
        a = msgspec.structs.replace(a, steps=steps, epochs=None)
        cfg = msgspec.structs.replace(cfg, algo=a)
    if a.total_steps is not None and a.total_steps < a.steps:
        raise ConfigError(f"run config: algo.total_steps={a.total_steps} is shorter than the run's {a.steps} steps: "
                          "the lr schedule would end before the run (linear at lr 0, cosine rising again); raise "
                          "it, or leave it out to use algo.steps")
    if a.warmup_steps > a.steps:
        raise ConfigError(f"run config: algo.warmup_steps={a.warmup_steps} is longer than the run's {a.steps} "
                          "steps: the lr would never reach algo.lr; lower it")
    return cfg


def _epoch_task(cfg: RunConfig) -> Any:
    """The task whose train split ``algo.epochs`` counts passes over (ConfigError where it does not load)."""
    from streamrl.config import task_options
    from streamrl.tasks.registry import TaskOptionError, UnknownTaskError, get_task

    try:
        return get_task(cfg.task.name, **task_options(cfg))
    except (UnknownTaskError, TaskOptionError, ValueError, TypeError) as exc:
        raise ConfigError(f"run config: task: {exc}") from None


def validate_pipeline(spec: PipelineSpec, cfg: RunConfig, *, import_classes: bool = True) -> None:
    where = spec.path or f"pipeline {spec.name!r}"
    if not spec.stages:
        raise ConfigError(f"{where}: the pipeline has no stages")
    seen: set[str] = set()
    writer: dict[str, str] = {}
    for i, s in enumerate(spec.stages):
        at = f"{where}: stage {s.name!r} (#{i})"
        if not s.name or not s.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{where}: stage #{i} name {s.name!r} must be letters, digits, '-' or '_'")
        if s.name in seen:
            raise ConfigError(f"{at}: name is not unique")
        seen.add(s.name)
        if s.workers < 1:
            raise ConfigError(f"{at}: workers must be >= 1, got {s.workers}")
        if s.micro_batch < 1:
            raise ConfigError(f"{at}: micro_batch must be >= 1, got {s.micro_batch}")
        if s.threads < 1:
            raise ConfigError(f"{at}: threads must be >= 1, got {s.threads}")
        if (s.is_source or s.is_side) and s.workers != 1:
            kind = "a source stage (no reads)" if s.is_source else "a side stage (no reads, no writes)"
            raise ConfigError(f"{at}: {kind} runs exactly one worker")
        for col in s.writes:
            if col in writer:
                raise ConfigError(f"{at}: writes {col!r}, which stage {writer[col]!r} already writes "
                                  "(columns are write-once)")
            writer[col] = s.name
        if s.device is not None:
            _check_device(s.device, f"{at}: device")
    _check_placement(spec, where)
    if spec.placement == "colocated":
        for s in spec.stages:
            if s.colocate_with is not None:
                try:
                    colocated_tensor_parallel(s, cfg.algo.max_staleness)
                except ValueError as exc:
                    raise ConfigError(f"{where}: {exc}") from None
    if spec.placement != "separate" and cfg.resources.launch == "inprocess":
        raise ConfigError(f"{where}: placement {spec.placement!r} joins a torch.distributed group per worker "
                          "process; it needs resources.launch: processes or ray (not inprocess)")
    sources = [s.name for s in spec.stages if s.is_source]
    if len(sources) != 1:
        raise ConfigError(f"{where}: exactly one stage must have no reads and some writes (the source); found "
                          f"{sources or 'none'}")
    for s in spec.stages:
        for col in s.reads:
            if col not in writer:
                raise ConfigError(f"{where}: stage {s.name!r} reads {col!r} but no stage writes it "
                                  f"(written: {sorted(writer)})")
    _check_acyclic(spec, writer, where)
    if cfg.algo.loss.kl_coef > 0 and "ref_logprobs" not in writer:
        raise ConfigError(f"{where}: algo.loss.kl_coef > 0 needs a stage that writes 'ref_logprobs' "
                          "(use pipelines/grpo_kl.yaml, which has the reference stage)")
    trainers = [s for s in spec.stages if s.cls == "streamrl.stages.train:TrainStage"]
    if cfg.output.checkpoint_every and cfg.algo.max_staleness > 0 and any("sample_key" not in t.reads for t in trainers):
        # without keys a checkpoint cannot say which samples in flight it has trained on
        raise ConfigError(f"{where}: output.checkpoint_every with algo.max_staleness > 0 needs the train stage to read "
                          "'sample_key' (and the source to write it), so that a resume neither repeats nor loses a "
                          "sample: add sample_key to both, as pipelines/grpo.yaml does")
    if import_classes:
        for s in spec.stages:
            _check_class(s, f"{where}: stage {s.name!r} class", spec)
    _check_device(cfg.resources.device, "run config: resources.device")


def _check_placement(spec: PipelineSpec, where: str) -> None:
    if spec.placement not in PLACEMENTS:
        raise ConfigError(f"{where}: placement {spec.placement!r} is not one of {list(PLACEMENTS)}")
    names = {s.name: s for s in spec.stages}
    _check_weights_from(spec, names, where)
    for s in spec.stages:
        if s.colocate_with is None:
            continue
        at = f"{where}: stage {s.name!r} colocate_with"
        host = names.get(s.colocate_with)
        if host is None:
            raise ConfigError(f"{at}: no stage named {s.colocate_with!r} (stages: {list(names)})")
        if host.name == s.name:
            raise ConfigError(f"{at}: a stage cannot be colocated with itself")
        if host.colocate_with is not None:
            raise ConfigError(f"{at}: {host.name!r} is itself colocated with {host.colocate_with!r}; "
                              f"name the host stage {host.colocate_with!r} instead")
        if s.is_source or host.is_source:
            raise ConfigError(f"{at}: the source stage cannot be colocated")
        if host.workers != s.workers:
            raise ConfigError(f"{at}: {s.name!r} has workers={s.workers} but {host.name!r} has "
                              f"workers={host.workers}; colocated stages need the same number of workers")
    if spec.placement == "colocated" and not any(s.colocate_with for s in spec.stages):
        raise ConfigError(f"{where}: placement 'colocated' needs a stage with colocate_with (e.g. the generate "
                          "stage with `colocate_with: train`)")
    for s in spec.stages:  # the inference layout's T, read by both sides of the reshard
        if s.colocate_with is not None or s.weights_from is not None:
            try:
                inference_tensor_parallel(s)
            except ValueError as exc:
                raise ConfigError(f"{where}: {exc}") from None


def inference_tensor_parallel(generate: StageSpec) -> int:
    """T of the inference layout: the generate stage's ``options.tensor_parallel`` (default 1). Both
    the generate and the train stage read it there, so they cannot disagree."""
    T = generate.options.get("tensor_parallel", 1)
    if not isinstance(T, int) or isinstance(T, bool) or T < 1:
        raise ValueError(f"stage {generate.name!r} options.tensor_parallel must be an int >= 1, got {T!r}")
    if generate.workers % T:
        raise ValueError(f"stage {generate.name!r} has workers={generate.workers}, which options.tensor_parallel={T} "
                         f"does not divide (each inference replica is T workers)")
    return T


def colocated_tensor_parallel(generate: StageSpec, max_staleness: int) -> int:
    """:func:`inference_tensor_parallel` of a colocated generate stage, which with T > 1 needs
    ``max_staleness`` 0: a follower cannot tell whether its leader still has an old-version batch to
    generate when its own train stage moves on to the next reshard; with 0 there is none (every
    prompt of the next step needs the next version), so the phases cannot deadlock."""
    T = inference_tensor_parallel(generate)
    if T > 1 and max_staleness != 0:
        raise ValueError(f"stage {generate.name!r} options.tensor_parallel={T} (colocated) needs "
                         f"algo.max_staleness: 0, got {max_staleness} (see docs/reshard.md §8, Inference TP)")
    return T


def _check_weights_from(spec: PipelineSpec, names: dict[str, StageSpec], where: str) -> None:
    receivers = [s for s in spec.stages if s.weights_from is not None]
    if spec.placement != "disaggregated":
        if receivers:
            raise ConfigError(f"{where}: stage {receivers[0].name!r} weights_from: {receivers[0].weights_from!r} "
                              f"needs `placement: disaggregated` at the top of the pipeline, which says "
                              f"{spec.placement!r}")
        return
    if len(receivers) != 1:
        found = [s.name for s in receivers] or "none"
        raise ConfigError(f"{where}: placement 'disaggregated' needs exactly one stage with weights_from (the "
                          f"generate stage, e.g. `weights_from: train`); found {found}")
    s = receivers[0]
    at = f"{where}: stage {s.name!r} weights_from"
    source = names.get(s.weights_from or "")
    if source is None:
        raise ConfigError(f"{at}: no stage named {s.weights_from!r} (stages: {list(names)})")
    if source.name == s.name or source.is_source or s.is_source:
        raise ConfigError(f"{at}: weights come from a train stage other than itself and the source")
    for stage in spec.stages:
        if stage.colocate_with is not None:
            raise ConfigError(f"{where}: stage {stage.name!r} colocate_with is not supported with placement "
                              "'disaggregated' (generation and training run in separate processes)")


def _check_acyclic(spec: PipelineSpec, writer: dict[str, str], where: str) -> None:
    deps = {s.name: {writer[c] for c in s.reads} for s in spec.stages}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            cycle = " -> ".join([*path[path.index(name):], name])
            raise ConfigError(f"{where}: the stages form a cycle through their columns: {cycle} "
                              "(only policy versions may feed back)")
        state[name] = 1
        for dep in deps[name]:
            visit(dep, [*path, name])
        state[name] = 2

    for name in deps:
        visit(name, [])


def _check_class(s: StageSpec, at: str, pipeline: PipelineSpec) -> None:
    try:
        cls = import_object(s.cls, "class")
    except ValueError as exc:
        raise ConfigError(f"{at}: {exc}") from None
    if not inspect.isclass(cls):
        raise ConfigError(f"{at}: {s.cls!r} is not a class")
    limit = getattr(cls, "max_workers", None)
    if isinstance(limit, int) and s.workers > limit:
        raise ConfigError(f"{at}: {s.cls!r} runs at most {limit} worker(s), got workers={s.workers}")
    placement = getattr(cls, "placement", None)  # a stage built for one weight path says so
    if isinstance(placement, str) and placement != pipeline.placement:
        raise ConfigError(f"{at}: {s.cls!r} works only with `placement: {placement}` at the top of the pipeline, "
                          f"which says {pipeline.placement!r}")
    _check_options(s, cls, at)
    if getattr(cls, "restartable", False) is True:
        s.restartable = True
    needed = ["setup", "close", "produce" if s.is_source else "run" if s.is_side else "process"]
    missing = [m for m in needed if not callable(getattr(cls, m, None))]
    if missing:
        kind = "source (no reads)" if s.is_source else "side stage (no reads, no writes)" if s.is_side else "stage"
        raise ConfigError(f"{at}: {s.cls!r} lacks {missing}; a {kind} class needs {needed} "
                          "(see streamrl.runtime.stage)")


def _check_device(device: str, at: str) -> None:
    from streamrl.models.build import DeviceUnavailableError, resolve_device

    try:
        resolve_device(device)
    except (DeviceUnavailableError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{at}: {exc}") from None


def pipeline_from_path(path: str | Path, cfg: RunConfig) -> PipelineSpec:
    """Load a pipeline from an explicit path (for tests and `streamrl validate`)."""
    return load_pipeline(msgspec.structs.replace(cfg, pipeline=str(path)))


# ------------------------------------------------------------------ stage options

class NoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A built-in stage that takes no options."""


class SourceOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the source stage (streamrl.stages.source:SourceStage)."""

    gate_on_policy: Annotated[bool, Meta(description=(
        "Wait for policy version step - algo.max_staleness before making each step's prompts"))] = True


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


class ReshardGenerateOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``options`` of the generate stage of placements colocated and disaggregated
    (streamrl.stages.colocated:ColocatedGenerateStage, streamrl.stages.disaggregated:DisaggregatedGenerateStage)."""

    tensor_parallel: Annotated[int, Meta(description=(
        "T: workers per inference replica (the built-in engine's own tensor parallelism); the train stage "
        "reads it too"))] = 1
    engine: Annotated[EngineName, Meta(description=(
        "Disaggregated only: builtin, or vllm fed by the reshard's bucket stream (T = 1; vLLM's own tensor "
        "parallelism is vllm.tensor_parallel_size). Colocated generation runs the built-in engine"))] = "builtin"
    vllm: Annotated[VllmOptions, Meta(description="vLLM engine settings (engine: vllm)")] = VllmOptions()


_BACKENDS = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


def _class_key(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _check_options(s: StageSpec, cls: type, at: str) -> None:
    """The stage's ``options`` against what its class takes, before a worker imports anything."""
    at = f"{at.rsplit(' class', 1)[0]} options"
    schema = getattr(cls, "Options", None)
    if isinstance(schema, type) and issubclass(schema, msgspec.Struct):
        try:
            opts = msgspec.convert(s.options, schema)
        except msgspec.ValidationError as exc:
            text = str(exc)
            known = [f.name for f in msgspec.structs.fields(schema)]
            if text.startswith("Object contains unknown field"):
                field = text.split("`")[1]
                if not known:
                    raise ConfigError(f"{at}: unknown option {field!r}: {cls.__name__} takes no options; remove "
                                      f"options.{field}") from None
                raise ConfigError(f"{at}: unknown option {field!r}{did_you_mean(field, known)}") from None
            problem, _, path = text.partition(" - at `$")
            name = path.rstrip("`").strip(".")
            value = s.options.get(name.split(".")[0].split("[")[0])
            raise ConfigError(f"{at}.{name}: {problem[0].lower()}{problem[1:]}, got {value!r}") from None
        _check_option_values(opts, at)
    # after the schema: a stage's own check (engine availability, placement rules) sees well-formed options
    check = getattr(cls, "check_options", None)
    if callable(check):
        try:
            check(dict(s.options))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{at}: {exc}") from None
    if _class_key(cls) == "streamrl.stages.score:ScoreStage":
        _check_endpoints(s.options.get("endpoints"), at)
        reward = s.options.get("reward")
        if isinstance(reward, str) and s.options.get("backend", "inprocess") == "inprocess":
            from streamrl.rewards.function import load_reward_function

            try:  # imports the user's module now rather than in the worker
                load_reward_function(reward)
            except Exception as exc:  # RewardFunctionLoadError, or whatever importing the module raised
                raise ConfigError(f"{at}.reward: {exc}") from None


def _check_option_values(opts: msgspec.Struct, at: str) -> None:
    if isinstance(opts, TrainOptions):
        if opts.tensor_parallel < 1:
            raise ConfigError(f"{at}.tensor_parallel must be >= 1 (workers per model replica), got "
                              f"{opts.tensor_parallel}")
        if opts.bucket_bytes < 1:
            raise ConfigError(f"{at}.bucket_bytes must be >= 1 (bytes), got {opts.bucket_bytes}")
        if not opts.collective_timeout_s > 0:
            raise ConfigError(f"{at}.collective_timeout_s must be > 0 seconds, got {opts.collective_timeout_s}")
        if opts.backend is not None and opts.backend not in _BACKENDS:
            raise ConfigError(f"{at}.backend must be one of {list(_BACKENDS)} (or left out), got {opts.backend!r}")


# tcp://HOST:PORT with HOST a name, an IPv4 address or [IPv6]; a connect address, so no '*'
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]+)$")


def _check_endpoints(endpoints: Any, at: str) -> None:
    """Reward-server addresses the client connects to: ``tcp://HOST:PORT`` or ``ipc://PATH``."""
    if endpoints is None:
        return
    if isinstance(endpoints, str):
        raise ConfigError(f"{at}.endpoints must be a list of addresses, e.g. [{endpoints!r}]")
    if not isinstance(endpoints, list):
        raise ConfigError(f"{at}.endpoints must be a list like [tcp://HOST:PORT, ...], got {endpoints!r}")
    for i, e in enumerate(endpoints):
        bad = f"{at}.endpoints[{i}] {e!r}"
        if not isinstance(e, str):
            raise ConfigError(f"{bad} must be a string like 'tcp://127.0.0.1:5555'")
        if e.startswith("tcp://"):
            m = _TCP.match(e)
            if m is None:
                raise ConfigError(f"{bad} is not tcp://HOST:PORT (e.g. 'tcp://127.0.0.1:5555'; no '*', which "
                                  "only a server binds)")
            if not 1 <= int(m["port"]) <= 65535:
                raise ConfigError(f"{bad}: port {m['port']} is not in 1..65535")
        elif e.startswith(("ipc://", "inproc://")):
            if not e.partition("://")[2]:
                raise ConfigError(f"{bad} has no path after '://'; e.g. 'ipc:///tmp/reward.sock'")
        else:
            raise ConfigError(f"{bad} must start with tcp:// or ipc:// (e.g. 'tcp://127.0.0.1:5555')")


# ------------------------------------------------------------------ the whole run, before it starts

def check_run(spec: PipelineSpec, cfg: RunConfig) -> None:
    """What the stages would find out only in their workers, found before any process starts: the
    batching each stage class needs, the reshard worlds, the task and its options or prompt file,
    the model directory, and that prompt + completion fit the model's positions."""
    where = spec.path or f"pipeline {spec.name!r}"
    problems: list[str] = []  # the independent checks all run; every problem is reported at once

    def attempt(check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except ConfigError as exc:
            problems.append(str(exc))
            return None

    if cfg.resources.launch == "ray":
        attempt(_check_ray, spec, cfg)
    classes = {s.name: _import_quietly(s.cls) for s in spec.stages}
    attempt(_check_batching, spec, cfg, classes, where)
    keys = {_class_key(c) for c in classes.values() if c is not None}
    if any(k.startswith("streamrl.stages.") for k in keys):  # else: the model and the task are the user's stages'
        model = attempt(_check_model, cfg)
        generates = any(k.startswith("streamrl.stages.") and "Generate" in k for k in keys)
        if model is not None:
            tokenizer, model_config, positions_key = model
            max_positions = model_config.get("max_positions")
            attempt(_check_task, cfg, tokenizer, max_positions if generates else None, positions_key)
            if spec.placement != "separate":
                attempt(_check_reshard_model, spec, cfg, model_config, where)
        else:  # no tokenizer to render prompts with: still check that the task and its rows load
            try:
                _check_task(cfg, None, None, "")
            except ConfigError as exc:
                problems.append(str(exc))
            except Exception:
                pass
    if cfg.algo.epochs is not None and not problems:  # resolve_run_length could not load the task: say why
        attempt(_epoch_task, cfg)
    if problems:
        raise ConfigErrors([ConfigProblem("", "", None, message) for message in problems])


def _check_ray(spec: PipelineSpec, cfg: RunConfig) -> None:
    """``resources.launch: ray``: Ray is installed, and the per-stage resources name real stages."""
    from streamrl.runtime.ray_cluster import import_ray

    import_ray()
    unknown = sorted(set(cfg.resources.ray.stage_resources) - {s.name for s in spec.stages})
    if unknown:
        raise ConfigError(f"resources.ray.stage_resources names stages {unknown} that the pipeline {spec.name!r} "
                          f"does not have; its stages: {[s.name for s in spec.stages]}")


def _import_quietly(spec: str) -> type | None:
    try:
        cls = import_object(spec, "class")
    except ValueError:
        return None  # validate_pipeline(import_classes=False) left it out on purpose
    return cls if inspect.isclass(cls) else None


def _is_trainer(cls: type | None) -> bool:
    """The built-in train stage (or a user's subclass of it): its workers split every step's samples."""
    return cls is not None and any(_class_key(c) == "streamrl.stages.train:TrainStage" for c in cls.__mro__)


def _check_batching(spec: PipelineSpec, cfg: RunConfig, classes: dict[str, type | None], where: str) -> None:
    a = cfg.algo
    G, batch = a.group_size, cfg.batch_size
    for s in spec.stages:
        cls = classes[s.name]
        at = f"{where}: stage {s.name!r}"
        key = _class_key(cls) if cls is not None else ""
        if key == "streamrl.stages.advantage:AdvantageStage" and not s.whole_groups:
            raise ConfigError(f"{at}: the advantage stage normalises rewards within a group; set whole_groups: true")
        share = batch
        if _is_trainer(cls):
            tp = msgspec.convert(s.options, TrainOptions).tensor_parallel
            if s.workers % tp:
                raise ConfigError(f"{at}: options.tensor_parallel={tp} must divide workers={s.workers} (each "
                                  "model replica is tensor_parallel workers)")
            if tp > 1 and spec.placement == "disaggregated":
                raise ConfigError(f"{at}: options.tensor_parallel={tp}: train tensor parallelism is built for "
                                  "placement separate and colocated, not disaggregated; set it to 1")
            replicas = s.workers // tp
            if batch % replicas:
                over = f"workers={s.workers}" if tp == 1 else f"{replicas} model replicas (workers / tensor_parallel)"
                raise ConfigError(f"{at}: algo.prompts_per_step x algo.group_size = {batch} samples per step must "
                                  f"divide evenly over its {over}; change one of them")
            share = batch // replicas
            if s.workers > 1 and cfg.resources.launch == "inprocess":
                raise ConfigError(f"{at}: workers={s.workers} train as one torch.distributed group, one process "
                                  "each; it needs resources.launch: processes or ray (not inprocess)")
            if spec.placement != "separate" and spec.weights_receiver(s.name) is None:
                link = "colocate_with" if spec.placement == "colocated" else "weights_from"
                raise ConfigError(f"{at}: no stage says `{link}: {s.name}`, so its policy versions reach no "
                                  f"generate stage; add `{link}: {s.name}` to the generate stage")
            _check_reshard_world(spec, s, cfg, at)
        # a stage that sizes its claims to complete its step exactly needs whole groups to add up to
        # every claim; otherwise a claim waits for a sample count no set of groups makes
        sized = cls is not None and callable(getattr(cls, "claim_size", None))
        if s.whole_groups and sized and (s.micro_batch % G or share % G):
            raise ConfigError(f"{at}: whole_groups: true with micro_batch={s.micro_batch} and {share} samples "
                                  f"per step: both must be multiples of algo.group_size={G}, or claims of whole "
                                  "groups never add up; change micro_batch, or set whole_groups: false")


def _check_reshard_world(spec: PipelineSpec, train: StageSpec, cfg: RunConfig, at: str) -> None:
    """nccl/hccl need one device per rank of the reshard world (train + disaggregated generate)."""
    from streamrl.models.build import DeviceUnavailableError, resolve_device

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
        import torch

        count = int(getattr(torch, need).device_count())
        if world > count:
            raise ConfigError(f"{at}: {world} reshard ranks (train + generation workers) but {count} {need} "
                              f"device(s): {backend} needs one device per rank; use fewer workers, or "
                              "options.backend: gloo")


def _check_model(cfg: RunConfig) -> tuple[Any, dict[str, Any], str]:
    """The tokenizer the stages will use, the model's config (``config.json`` keys, plus
    ``max_positions``) and the key that sets its positions."""
    if cfg.model.path is None:
        from streamrl.models.tokenizer import build_char_tokenizer

        t = cfg.model.tiny
        tokenizer = build_char_tokenizer(cfg.model.extra_chars)
        config = {"model_type": t.arch, "hidden_size": t.hidden, "num_attention_heads": t.heads,
                  "num_key_value_heads": t.kv_heads or t.heads, "intermediate_size": t.intermediate,
                  "num_hidden_layers": t.layers, "vocab_size": len(tokenizer), "tie_word_embeddings": t.tie_embeddings,
                  "max_positions": t.max_positions}
        return tokenizer, config, "model.tiny.max_positions"
    from streamrl.config import resolve_model_dir
    from streamrl.models.build import ModelLoadError, check_model_dir, max_positions_of

    if cfg.model.extra_chars:
        raise ConfigError("run config: model.extra_chars only extends the built-in character tokenizer; a "
                          "model.path brings its own tokenizer: remove model.extra_chars")
    try:
        directory = resolve_model_dir(cfg)
    except ConfigError as exc:
        raise ConfigError(f"run config: {exc}") from None
    try:
        config = check_model_dir(directory)
    except ModelLoadError as exc:
        raise ConfigError(f"run config: model.path {cfg.model.path!r}: {exc}") from None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds: name the directory and the fix
        raise ConfigError(f"run config: model.path {cfg.model.path!r}: cannot load its tokenizer from "
                          f"{str(directory)!r} ({type(exc).__name__}: {exc}); save one there with "
                          "tokenizer.save_pretrained") from None
    from streamrl.stages.common import TokenizerTokensError, with_pad_token

    try:
        tokenizer = with_pad_token(tokenizer)
    except TokenizerTokensError as exc:
        raise ConfigError(f"run config: model.path {cfg.model.path!r}: {exc}") from None
    vocab = config.get("vocab_size")
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ConfigError(f"run config: model.path {cfg.model.path!r}: its tokenizer has {len(tokenizer)} tokens but "
                          f"config.json says vocab_size={vocab}; token ids past it would index outside the "
                          "embeddings: save the tokenizer the model was trained with")
    config = {**config, "max_positions": max_positions_of(config)}
    return tokenizer, config, f"max_position_embeddings in {directory / 'config.json'}"


def _check_reshard_model(spec: PipelineSpec, cfg: RunConfig, model_config: dict[str, Any], where: str) -> None:
    """The reshard placements shard the model: its type needs a sharding spec, and the generate
    stage's tensor_parallel T must split its heads and MLP evenly (checked from the config alone)."""
    from types import SimpleNamespace

    from streamrl.reshard.spec import SUPPORTED_MODEL_TYPES, LayoutError, ModelShardingSpec

    model = f"model.path {cfg.model.path!r}" if cfg.model.path is not None else "model.tiny"
    if model_config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        # any other architecture reshards as whole parameters (a generic spec): T = 1 only
        for s in spec.stages:
            T = inference_tensor_parallel(s) if (s.colocate_with or s.weights_from) else 1
            if T > 1:
                raise ConfigError(f"{where}: stage {s.name!r} options.tensor_parallel={T}: inference tensor "
                                  f"parallelism needs a Llama-family model ({', '.join(SUPPORTED_MODEL_TYPES)}), "
                                  f"but {model} is {model_config.get('model_type')!r}; use tensor_parallel: 1")
        return
    try:
        sharding = ModelShardingSpec.from_config(SimpleNamespace(**model_config))
    except (LayoutError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: placement {spec.placement!r} shards the model, but {model}: {exc}") from None
    for s in spec.stages:
        if s.colocate_with is None and s.weights_from is None:
            continue
        T = inference_tensor_parallel(s)
        try:
            sharding.check_inference_tp(T)
        except LayoutError as exc:
            raise ConfigError(f"{where}: stage {s.name!r} options.tensor_parallel={T}: {exc} ({model}); pick a T "
                              "that divides them") from None


def _check_task(cfg: RunConfig, tokenizer: Any, max_positions: int | None, positions_key: str) -> None:
    from streamrl.config import task_options
    from streamrl.tasks.base import Prompt
    from streamrl.tasks.chat import render_prompt
    from streamrl.tasks.dataset import CHECK_ROWS, DatasetTask, PromptDatasetError, check_prompts_jsonl
    from streamrl.tasks.registry import TaskOptionError, UnknownTaskError, check_task

    name, options = cfg.task.name, task_options(cfg)
    try:
        task = check_task(name, options, tokenizer)
    except UnknownTaskError as exc:
        raise ConfigError(f"run config: task.name: {exc}; or register your own with "
                          "streamrl.tasks.register_task") from None
    except PromptDatasetError as exc:  # the dataset task's rows: the message starts with its option (task.options.path)
        raise ConfigError(f"run config: {exc}") from None
    except (TaskOptionError, ValueError, TypeError) as exc:
        raise ConfigError(f"run config: task.options: {exc}") from None
    if cfg.task.chat_template and cfg.model.path is None:  # the source stage renders every task's prompts
        raise ConfigError("run config: task.chat_template: true needs a tokenizer with a chat template, and the "
                          "built-in character tokenizer (model.path unset) has none: set model.path to a checkpoint "
                          "whose tokenizer has one (an instruct model), or set task.chat_template: false")
    new = cfg.algo.max_new_tokens

    def too_long(tokens: int) -> bool:
        return max_positions is not None and tokens + new > max_positions

    def fix(tokens: int) -> str:
        room = (max_positions or 0) - tokens
        lower = f"lower algo.max_new_tokens to {room} or less" if room >= 1 else "use shorter prompts"
        if cfg.model.path is not None:  # a pretrained model's positions are what it was trained for
            return lower
        return f"{lower}, or raise {positions_key} to {tokens + new} or more"

    if task is None:  # jsonl: read its rows now (bounded), with the messages the source stage would give
        try:
            rows, _ = check_prompts_jsonl(options["path"])
        except PromptDatasetError as exc:
            raise ConfigError(f"run config: task.options.path: {exc}") from None
        _check_prompt_rows(cfg, tokenizer, [(f"task.options.path: {options['path']}, line {lineno}", prompt)
                                            for lineno, prompt in rows], too_long, fix, max_positions, positions_key)
        return
    if isinstance(task, DatasetTask):  # its rows (bounded), as the source and eval stages will render them
        train = list(zip(task.origins, task.prompts, strict=True))[:CHECK_ROWS]
        evals = list(zip(task.eval_origins, task.eval, strict=True))[:CHECK_ROWS]
        _check_prompt_rows(cfg, tokenizer, train + evals, too_long, fix, max_positions, positions_key)
        return
    longest = getattr(task, "max_prompt_text", None)
    prompts = [Prompt(longest(), "")] if callable(longest) else task.make_prompts(cfg.task.seed, 64)
    t = cfg.task
    try:
        texts = [render_prompt(p, tokenizer, chat_template=t.chat_template, system_prompt=t.system_prompt)
                 for p in prompts]
    except ValueError as exc:  # ChatTemplateError: no template in model.path's tokenizer
        raise ConfigError(f"run config: task {name!r}: {exc}") from None
    tokens = max(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts)
    if too_long(tokens):
        label = "the longest prompt" if callable(longest) else "a prompt"
        raise ConfigError(f"run config: algo.max_new_tokens={new} + {label} of task {name!r} ({tokens} tokens"
                          f"{' with the chat template' if t.chat_template else ''}) = {tokens + new} > the model's "
                          f"{max_positions} positions ({positions_key}); {fix(tokens)}")


def _check_prompt_rows(cfg: RunConfig, tokenizer: Any, rows: list[tuple[str, Any]], too_long: Any, fix: Any,
                       max_positions: int | None, positions_key: str) -> None:
    """Each prompt renders (chat template), the built-in character tokenizer knows its characters,
    and it fits the model with algo.max_new_tokens. ``rows``: ``(where, Prompt)``, ``where`` naming
    the option, the file and the row."""
    from streamrl.tasks.chat import ChatTemplateError, render_prompt

    t = cfg.task
    texts = []
    for at, prompt in rows:
        try:
            texts.append(render_prompt(prompt, tokenizer, chat_template=t.chat_template, system_prompt=t.system_prompt))
        except ChatTemplateError as exc:
            raise ConfigError(f"run config: {at}: {exc}") from None
        except Exception as exc:  # the template's own Jinja error
            raise ConfigError(f"run config: {at}: the tokenizer's chat template failed on this prompt "
                              f"({type(exc).__name__}: {exc}); fix the row or the template") from None
    known = _char_vocabulary(cfg) if cfg.model.path is None else None
    if known is not None:  # one token per character
        lengths = [len(text) for text in texts]
    elif max_positions is not None and texts:  # a model's own tokenizer: one batched call, not one per row
        lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    else:
        lengths = [0] * len(texts)
    new = cfg.algo.max_new_tokens
    for (at, _), text, tokens in zip(rows, texts, lengths, strict=True):
        where = f"run config: {at}"
        if known is not None:
            unknown = "".join(sorted(set(text) - known))
            if "\n" in unknown or "\r" in unknown:
                raise ConfigError(f"{where}: the prompt has a line break, which the built-in character tokenizer "
                                  "cannot encode (it would be dropped); remove it from the prompt, or use a "
                                  "model.path with its own tokenizer")
            if unknown:
                raise ConfigError(f"{where}: the prompt has characters the built-in character tokenizer does not "
                                  f"know: {unknown!r} (each would read as <unk>); add them to "
                                  f"model.extra_chars, e.g. model.extra_chars: {unknown!r}")
        if too_long(tokens):
            raise ConfigError(f"{where}: the prompt is {tokens} tokens"
                              f"{' with the chat template' if t.chat_template else ''}; with algo.max_new_tokens={new} "
                              f"that is {tokens + new} > the model's {max_positions} positions ({positions_key}); "
                              f"shorten the prompt, or {fix(tokens)}")


def _char_vocabulary(cfg: RunConfig) -> set[str]:
    from streamrl.models.tokenizer import SPECIAL_TOKENS, VOCAB_TOKENS

    return {t for t in VOCAB_TOKENS if t not in SPECIAL_TOKENS} | set(cfg.model.extra_chars)
