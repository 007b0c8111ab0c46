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

The checks: names unique; every read column has exactly one writer stage; no column is
written twice; the column graph has no cycle (policy versions are the only way back); classes
import and have the right methods; resources are satisfiable (devices exist, workers >= 1).
Each error names the file, the stage and the field.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrl.config import ConfigError, RunConfig, StageOverride, load_yaml, resolve_path


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

    @property
    def is_source(self) -> bool:
        return not self.reads


PLACEMENTS = ("separate", "colocated", "disaggregated")


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
        return [s.name for s in self.stages if not s.is_source]

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
        return text.replace("$.", "")
    k = int(m.group(1))
    stage = raw["stages"][k] if k < len(raw["stages"]) else {}
    name = stage.get("name", "?") if isinstance(stage, dict) else "?"
    field = m.group(2)
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        known = [f.encode_name for f in msgspec.structs.fields(StageSpec)]
        close = difflib.get_close_matches(field, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(known)})"
        return f"stage {name!r} (stages[{k}]): unknown field {field!r}{hint}"
    return f"stage {name!r} (stages[{k}]): field {field!r}: {text.split(' - at ')[0]}"


def import_object(spec: str, what: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}") from None


def _apply_overrides(stage: StageSpec, over: StageOverride) -> StageSpec:
    changes = {k: v for k, v in msgspec.structs.asdict(over).items() if v is not None}
    if "options" in changes:
        changes["options"] = {**stage.options, **changes["options"]}
    return msgspec.structs.replace(stage, **changes)


def load_pipeline(cfg: RunConfig) -> PipelineSpec:
    """The run's pipeline with its per-stage overrides applied, validated."""
    path = resolve_path(cfg, cfg.pipeline)
    where = str(path)
    if not path.is_file():
        raise ConfigError(f"pipeline {cfg.pipeline!r}: no such file (looked relative to {cfg.config_dir}, the cwd "
                          "and the streamrl checkout)")
    try:
        raw = load_yaml(path.read_text()) or {}
        spec = msgspec.convert({**raw, "path": where}, PipelineSpec)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from exc
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_explain_stage_error(str(exc), raw)}") from None
    names = [s.name for s in spec.stages]
    for name in cfg.stages:
        if name not in names:
            raise ConfigError(f"run config: stages.{name} overrides a stage that {where} does not have "
                              f"(stages: {names})")
    spec.stages = [_apply_overrides(s, cfg.stages[s.name]) if s.name in cfg.stages else s for s in spec.stages]
    validate_pipeline(spec, cfg)
    return spec


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
        if s.is_source and s.workers != 1:
            raise ConfigError(f"{at}: a source stage (no reads) runs exactly one worker")
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
    if spec.placement != "separate" and cfg.resources.launch != "processes":
        raise ConfigError(f"{where}: placement {spec.placement!r} joins a torch.distributed group per worker "
                          "process; it needs resources.launch: processes (not inprocess)")
    sources = [s.name for s in spec.stages if s.is_source]
    if len(sources) != 1:
        raise ConfigError(f"{where}: exactly one stage must have no reads (the source); found {sources or 'none'}")
    for s in spec.stages:
        for col in s.reads:
            if col not in writer:
                raise ConfigError(f"{where}: stage {s.name!r} reads {col!r} but no stage writes it "
                                  f"(written: {sorted(writer)})")
    _check_acyclic(spec, writer, where)
    if cfg.algo.loss.kl_coef > 0 and "ref_logprobs" not in writer:
        raise ConfigError(f"{where}: algo.loss.kl_coef > 0 needs a stage that writes 'ref_logprobs' "
                          "(use pipelines/grpo_kl.yaml, which has the reference stage)")
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
    needed = ["setup", "close", "produce" if s.is_source else "process"]
    missing = [m for m in needed if not callable(getattr(cls, m, None))]
    if missing:
        kind = "source (no reads)" if s.is_source else "stage"
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
