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
```

The checks: names unique; every read column has exactly one writer stage; no column is
written twice; the column graph has no cycle (policy versions are the only way back); classes
import and have the right methods; resources are satisfiable (devices exist, workers >= 1).
Each error names the file, the stage and the field.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrl.config import ConfigError, RunConfig, StageOverride, resolve_path


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

    @property
    def is_source(self) -> bool:
        return not self.reads


class PipelineSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    stages: list[StageSpec]
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
        raw = yaml.safe_load(path.read_text()) or {}
        spec = msgspec.convert({**raw, "path": where}, PipelineSpec)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from exc
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {str(exc).replace('$.', '')}") from None
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
            _check_class(s, f"{where}: stage {s.name!r} class")
    _check_device(cfg.resources.device, "run config: resources.device")


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


def _check_class(s: StageSpec, at: str) -> None:
    try:
        cls = import_object(s.cls, "class")
    except ValueError as exc:
        raise ConfigError(f"{at}: {exc}") from None
    if not inspect.isclass(cls):
        raise ConfigError(f"{at}: {s.cls!r} is not a class")
    limit = getattr(cls, "max_workers", None)
    if isinstance(limit, int) and s.workers > limit:
        raise ConfigError(f"{at}: {s.cls!r} runs at most {limit} worker(s), got workers={s.workers}")
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
