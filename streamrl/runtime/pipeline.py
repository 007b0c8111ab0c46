"""Pipeline configs: the stage graph, loaded from YAML and checked before anything starts.

```yaml
name: grpo
stages:
  - name: generate
    class: my_package.stages:Generate   # module:Class: a built-in stage's or a user's own
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

This module knows the file format and the graph, not the stages: :func:`read_pipeline` (the
file, the run config's ``stages.<name>`` overrides) and :func:`validate_pipeline`, the generic
checks: names unique; every read column has exactly one writer stage; no column is written twice;
the column graph has no cycle (policy versions are the only way back); placements and their
links (``colocate_with``, ``weights_from``) are consistent; devices exist, workers >= 1; classes
import and have the right methods; each stage's ``options`` are the ones its class takes (an
``Options`` msgspec Struct and / or ``check_options`` on the class); whole groups add up to the
claims of a class that sizes them. Then what each stage class says of itself, as class
attributes and hooks (all optional):

- ``check_spec(spec, pipeline, cfg)`` (a classmethod): its own rules on its spec in this
  pipeline and run, raising ``ConfigError`` (e.g. the train stage's batch split and reshard
  world, the score stage's endpoints, the advantage stage's whole groups);
- ``step_samples(spec, pipeline, cfg)``: samples of each step one of its workers claims;
- ``publishes_policy``, ``restartable`` (True, or a function of the spec), ``max_workers``, ``placement``.

The checks that need the model, its tokenizer and the task are in :mod:`streamrl.runtime.prerun`
(``load_pipeline``, ``check_run``). Every error is a ``ConfigError`` naming the file, the stage
or dotted key, and what to change; ``streamrl validate``, ``streamrl run`` and ``streamrl.run``
all get it before anything starts. Nothing here imports ``streamrl.stages`` or ``streamrl.tasks``.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Collection
from typing import Any

import msgspec

from streamrl.config import (
    ConfigError,
    RunConfig,
    StageOverride,
    did_you_mean,
    read_yaml_mapping,
    resolve_path,
)


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
    # between micro-batches. Set from the class's ``restartable`` too (True, or True for this spec).
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
_PIPELINE_FIELDS = ["name", "stages", "placement"]


class PipelineSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    stages: list[StageSpec]
    # how weights reach generation: separate | colocated | disaggregated (see the module doc)
    placement: str = "separate"
    path: str = ""

    @property
    def where(self) -> str:
        """How errors name the pipeline: its file, else its name."""
        return self.path or f"pipeline {self.name!r}"

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


def is_plain_name(name: str) -> bool:
    """A stage's (or a chain link's) name: letters, digits, '-' and '_' only, since it names
    processes, log files, metrics and dock roles."""
    return bool(name) and name.replace("_", "").replace("-", "").isalnum()


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


def apply_overrides(stage: StageSpec, over: StageOverride) -> StageSpec:
    """``stage`` with the run config's ``stages.<name>`` fields set (its ``options`` merged)."""
    changes = {k: v for k, v in msgspec.structs.asdict(over).items() if v is not None}
    if "options" in changes:
        changes["options"] = {**stage.options, **changes["options"]}
    return msgspec.structs.replace(stage, **changes)


def read_pipeline(cfg: RunConfig, *, also_overridable: Collection[str] = ()) -> PipelineSpec:
    """The run's pipeline file with the run config's per-stage overrides (``stages.<name>``) applied,
    not yet validated (:func:`validate_pipeline`; ``streamrl.runtime.prerun.load_pipeline`` does both
    and checks the whole run). ``also_overridable``: stages the run adds after this (the eval
    stage), whose names ``stages.<name>`` may name too."""
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
        if name not in names and name not in also_overridable and _chain_of_link(spec, name) is None:
            raise ConfigError(f"run config: stages.{name} overrides a stage that {where} does not have "
                              f"(stages: {names})")
    spec.stages = [apply_overrides(s, cfg.stages[s.name]) if s.name in cfg.stages else s for s in spec.stages]
    for name, over in cfg.stages.items():
        chain = _chain_of_link(spec, name) if name not in names else None
        if chain is not None:
            _override_link(chain, name, over)
    return spec


def _links_holder(s: StageSpec) -> dict[str, Any]:
    """Where a stage's links are: a chain stage's ``options`` (``links``, streamrl.stages.chain), or
    the train stage's ``options.rollout`` (the links it runs before training, streamrl.stages.train)."""
    rollout = s.options.get("rollout")
    return rollout if isinstance(rollout, dict) else s.options


def _links(s: StageSpec) -> list[Any]:
    """The links of a chain stage or of a train stage's rollout, else []."""
    links = _links_holder(s).get("links")
    return links if isinstance(links, list) else []


def _chain_of_link(spec: PipelineSpec, name: str) -> StageSpec | None:
    """The stage with a link named ``name`` (a chain, or a train stage's rollout):
    ``stages.<link>.options`` in a run config sets that link's options, as it would the stage's
    were it not a link."""
    for s in spec.stages:
        if any(isinstance(link, dict) and link.get("name") == name for link in _links(s)):
            return s
    return None


def _override_link(chain: StageSpec, name: str, over: StageOverride) -> None:
    in_chain = _links_holder(chain) is chain.options  # else the train stage's options.rollout
    other = sorted(k for k, v in msgspec.structs.asdict(over).items() if v is not None and k != "options")
    if other:
        kind = "the chain stage" if in_chain else "the rollout of stage"
        raise ConfigError(f"run config: stages.{name} sets {other} of link {name!r}, which runs inside {kind} "
                          f"{chain.name!r} with its workers, micro-batch, device and threads: set "
                          f"stages.{chain.name}.{other[0]} instead (a link's own settings are its options)")
    def merged(link: Any) -> Any:
        own = link.get("options", {}) if isinstance(link, dict) and link.get("name") == name else None
        if not isinstance(own, dict):  # another link, or a malformed one (the options check says so)
            return link
        return {**link, "options": {**own, **(over.options or {})}}

    links = [merged(link) for link in _links(chain)]
    if in_chain:
        chain.options = {**chain.options, "links": links}
    else:
        chain.options = {**chain.options, "rollout": {**chain.options["rollout"], "links": links}}


def validate_pipeline(spec: PipelineSpec, cfg: RunConfig, *, import_classes: bool = True) -> None:
    """The generic checks of the module doc; with ``import_classes`` each stage's class too: its
    methods, its ``Options``, ``check_options`` and ``check_spec``."""
    where = spec.where
    if not spec.stages:
        raise ConfigError(f"{where}: the pipeline has no stages")
    seen: set[str] = set()
    writer: dict[str, str] = {}
    for i, s in enumerate(spec.stages):
        at = f"{where}: stage {s.name!r} (#{i})"
        if not is_plain_name(s.name):
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
    if import_classes:
        for s in spec.stages:
            check_stage_class(s, f"{where}: stage {s.name!r} class", spec, cfg)
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
        # generation and the policy's training run in separate processes here; other stages may
        # still share a process (PPO's value stage with its critic)
        if stage.colocate_with is not None and {stage.name, stage.colocate_with} & {s.name, source.name}:
            raise ConfigError(f"{where}: stage {stage.name!r} colocate_with: {stage.colocate_with!r}: with placement "
                              f"'disaggregated' the generate stage {s.name!r} and the train stage {source.name!r} "
                              "run in processes of their own")


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


def check_stage_class(s: StageSpec, at: str, pipeline: PipelineSpec, cfg: RunConfig) -> None:
    """Stage ``s``'s class in ``pipeline``: it imports, takes ``s.options``, accepts ``s`` (its
    ``check_spec``) and has the methods its kind needs; ``ConfigError`` at ``at`` if not. Sets
    ``s.restartable`` where the class says so. A chain stage checks each of its links with it."""
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
    # the class's own rules on its spec in this pipeline and run (its batching, its worlds, ...)
    check_spec = getattr(cls, "check_spec", None)
    if callable(check_spec):
        check_spec(s, pipeline, cfg)
    _check_whole_groups(s, cls, pipeline, cfg)
    if class_says(cls, "restartable", s):
        s.restartable = True
    needed = ["setup", "close", "produce" if s.is_source else "run" if s.is_side else "process"]
    missing = [m for m in needed if not callable(getattr(cls, m, None))]
    if missing:
        kind = "source (no reads)" if s.is_source else "side stage (no reads, no writes)" if s.is_side else "stage"
        raise ConfigError(f"{at}: {s.cls!r} lacks {missing}; a {kind} class needs {needed} "
                          "(see streamrl.runtime.stage)")


def _check_whole_groups(s: StageSpec, cls: type, pipeline: PipelineSpec, cfg: RunConfig) -> None:
    """A stage that sizes its claims to complete its step exactly (``claim_size``) needs whole groups
    to add up to every claim; otherwise a claim waits for a sample count no set of groups makes.
    Its class's ``step_samples(spec, pipeline, cfg)`` says how many samples of each step one of its
    workers claims (default: all of them)."""
    if not s.whole_groups or not callable(getattr(cls, "claim_size", None)):
        return
    G = cfg.algo.group_size
    share = step_share(s, cls, pipeline, cfg)
    if s.micro_batch % G or share % G:
        raise ConfigError(f"{pipeline.where}: stage {s.name!r}: whole_groups: true with micro_batch={s.micro_batch} "
                          f"and {share} samples per step: both must be multiples of algo.group_size={G}, or claims "
                          "of whole groups never add up; change micro_batch, or set whole_groups: false")


def _check_device(device: str, at: str) -> None:
    from streamrl.models.device import DeviceUnavailableError, resolve_device

    try:
        resolve_device(device)
    except (DeviceUnavailableError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{at}: {exc}") from None


# ------------------------------------------------------------------ stage options

class NoOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A built-in stage that takes no options."""


def _check_options(s: StageSpec, cls: type, at: str) -> None:
    """The stage's ``options`` against what its class takes, before a worker imports anything."""
    at = f"{at.rsplit(' class', 1)[0]} options"
    schema = getattr(cls, "Options", None)
    if isinstance(schema, type) and issubclass(schema, msgspec.Struct):
        try:
            msgspec.convert(s.options, schema)
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
    # after the schema: a stage's own check (engine availability, placement rules) sees well-formed options
    check = getattr(cls, "check_options", None)
    if callable(check):
        try:
            check(dict(s.options))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{at}: {exc}") from None


# ------------------------------------------------------------------ what a stage class says of itself

def import_stage_class(spec: str) -> type | None:
    """The class ``spec`` names, or None where it does not import (``validate_pipeline(import_classes=False)``
    left it out on purpose) or is no class."""
    try:
        cls = import_object(spec, "class")
    except ValueError:
        return None
    return cls if inspect.isclass(cls) else None


def class_says(cls: type | None, flag: str, spec: StageSpec) -> bool:
    """A stage class's yes/no attribute (``restartable``, ``discards``) for ``spec``: the attribute is
    True, or a function of the spec (e.g. of its placement) that returns True for it."""
    value = getattr(cls, flag, False)
    return value is True or (callable(value) and value(spec) is True)


def is_trainer(cls: type | None) -> bool:
    """A stage class that trains the policy and publishes its versions (``publishes_policy = True``:
    the built-in train stage and its subclasses): its worker 0 serves the policy channel."""
    return cls is not None and getattr(cls, "publishes_policy", False) is True


def trainer_stages(pipeline: PipelineSpec) -> list[StageSpec]:
    """The stages of ``pipeline`` whose class is a trainer (:func:`is_trainer`)."""
    return [s for s in pipeline.stages if is_trainer(import_stage_class(s.cls))]


def step_share(s: StageSpec, cls: type | None, pipeline: PipelineSpec, cfg: RunConfig) -> int:
    """Samples of each step one worker of stage ``s`` claims: its class's ``step_samples(spec,
    pipeline, cfg)``, or the whole step where the class does not say."""
    step_samples = getattr(cls, "step_samples", None)
    return int(step_samples(s, pipeline, cfg)) if callable(step_samples) else cfg.batch_size
