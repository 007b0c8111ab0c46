"""Run configs: typed (msgspec), validated once at load time, overridable with ``key=value``.

A run config picks a pipeline (the stage graph, ``pipelines/*.yaml``) and sets the model, the
task, the algorithm's hyper-parameters and the resources. Every field has a default documented
here; unknown keys are errors with a did-you-mean. ``streamrl run CONFIG algo.lr=3e-4`` sets a
field from the command line (values parse as YAML: ``true``, ``3e-4``, ``[1, 2]``).
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from streamrl.algos.grpo import LossConfig
from streamrl.models.build import TinyModelSpec


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the file, the field and the fix."""


class YamlLoader(yaml.SafeLoader):
    """Safe YAML with YAML 1.2 floats: ``3e-4`` is a number (YAML 1.1 wants ``3.0e-4``)."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=YamlLoader)  # a SafeLoader subclass: no arbitrary objects


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A local save_pretrained directory (safetensors). None: build `tiny` from a config.
    path: str | None = None
    tiny: TinyModelSpec = msgspec.field(default_factory=TinyModelSpec)
    # Characters the built-in character tokenizer knows beyond digits, '+' and '='.
    extra_chars: str = ""


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "digits-max"  # a built-in task (streamrl.tasks.registry) or "jsonl"
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # passed to the task factory
    seed: int = 0  # prompt stream seed


class AlgoConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    steps: int = 300  # optimizer steps; each publishes a new policy version
    prompts_per_step: int = 8  # prompts per optimizer step
    group_size: int = 8  # completions per prompt (GRPO's G); the advantage normalises within a group
    max_new_tokens: int = 4  # completion length cap (tokens)
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    lr: float = 1e-3  # AdamW learning rate (constant)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # clip the global gradient norm; None = no clipping
    normalize_std: bool = True  # divide group-centred rewards by the group's std (GRPO); False = Dr.GRPO
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    # Where the trainer's "old" logprobs come from: the generator's sampled-token logprobs
    # ("rollout", no extra forward) or a no-grad forward in the trainer ("recompute").
    old_logprobs: Literal["rollout", "recompute"] = "rollout"
    # 0: synchronous on-policy (step s is generated with the weights of step s). k >= 1:
    # generation runs up to k policy versions ahead of training; the trainer drops anything
    # older. Off-policy samples are corrected against their rollout logprobs: by the clipped
    # ratio pi/pi_rollout (old_logprobs: rollout), or with old_logprobs: recompute by the
    # truncated importance weight min(pi_old/pi_rollout, loss.tis_cap).
    max_staleness: int = 0
    stop_reward: float | None = None  # stop early once a step's mean reward >= this


class DockConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    capacity: int | None = None  # samples in flight; None = (max_staleness + 2) steps' worth
    warehouses: int = 1
    transport: Literal["ipc", "tcp"] = "ipc"
    lease_ttl_s: float = 30.0  # a worker silent this long loses its leased samples to others


class StageOverride(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    workers: int | None = None
    micro_batch: int | None = None
    device: str | None = None
    threads: int | None = None
    options: dict[str, Any] | None = None


class ResourcesConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # "processes": controller, warehouses and every stage worker are separate local processes.
    # "inprocess": stages run as tasks in this process (dock servers in threads), for debugging.
    launch: Literal["processes", "inprocess"] = "processes"
    device: str = "cpu"  # default device of model stages: cpu, cuda, cuda:N, npu, auto
    dock: DockConfig = msgspec.field(default_factory=DockConfig)
    start_timeout_s: float = 120.0  # worker start-up (imports, model build) must finish within this


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    run_dir: str = "runs"  # each run writes to <run_dir>/<name>-<timestamp>/
    name: str = "run"
    tensorboard: bool = True
    plot: bool = True  # reward_curve.png at the end
    checkpoint: bool = True  # final policy as a transformers save_pretrained directory
    progress: Literal["auto", "tty", "lines", "none"] = "auto"  # none: silent


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pipeline: str = "pipelines/grpo.yaml"  # relative to the config file, the cwd, or the package
    seed: int = 0
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    resources: ResourcesConfig = msgspec.field(default_factory=ResourcesConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)
    stages: dict[str, StageOverride] = msgspec.field(default_factory=dict)  # per-stage overrides
    config_dir: str = "."  # set by the loader: where relative paths in the config resolve

    @property
    def batch_size(self) -> int:
        return self.algo.prompts_per_step * self.algo.group_size

    @property
    def dock_capacity(self) -> int:
        cap = self.resources.dock.capacity
        return cap if cap is not None else (self.algo.max_staleness + 2) * self.batch_size


def _check(cfg: RunConfig, where: str) -> None:
    a = cfg.algo
    rules: list[tuple[bool, str]] = [
        (a.steps >= 1, "algo.steps must be >= 1"),
        (a.prompts_per_step >= 1, "algo.prompts_per_step must be >= 1"),
        (a.group_size >= 2 or not a.normalize_std, "algo.group_size must be >= 2 to normalise rewards in a group"),
        (a.max_new_tokens >= 1, "algo.max_new_tokens must be >= 1"),
        (a.temperature > 0, "algo.temperature must be > 0"),
        (0 < a.top_p <= 1, "algo.top_p must be in (0, 1]"),
        (a.top_k >= 0, "algo.top_k must be >= 0 (0 = off)"),
        (a.lr > 0, "algo.lr must be > 0"),
        (a.max_staleness >= 0, "algo.max_staleness must be >= 0 (0 = synchronous on-policy)"),
        (a.loss.temperature == a.temperature or a.loss.temperature == 1.0,
         "algo.loss.temperature must equal algo.temperature (logprobs are recomputed at the sampling one)"),
        (cfg.resources.dock.warehouses >= 1, "resources.dock.warehouses must be >= 1"),
        (cfg.dock_capacity >= cfg.batch_size,
         f"resources.dock.capacity ({cfg.dock_capacity}) must hold one step: >= prompts_per_step * group_size "
         f"({cfg.batch_size})"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(f"{where}: {message}")


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(options))})"


def _fields_of(struct_type: Any) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(struct_type)}


def _explain(exc: msgspec.ValidationError, raw: dict[str, Any], where: str) -> ConfigError:
    """Turn msgspec's message into one that names the field and offers a did-you-mean."""
    text = str(exc)
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        path = text.split("at `$")[-1].rstrip("`") if "at `$" in text else ""
        if path.startswith(".stages[...]"):
            # msgspec does not name the dict key: find the stage override that fails on its own
            stages = raw.get("stages") if isinstance(raw.get("stages"), dict) else {}
            for name, value in stages.items():
                try:
                    msgspec.convert(value, StageOverride)
                except msgspec.ValidationError:
                    path = f".stages.{name}" + path[len(".stages[...]"):]
                    break
        struct_type: Any = RunConfig
        parts = [p for p in path.strip(".").split(".") if p]
        if len(parts) >= 2 and parts[0] == "stages":
            struct_type, parts = StageOverride, parts[2:]  # stages.<name>: a dict of overrides
        for part in parts:
            if "[" in part:
                struct_type = None
                break
            struct_type = _fields_of(struct_type).get(part)
            if not isinstance(struct_type, type) or not issubclass(struct_type, msgspec.Struct):
                struct_type = None
                break
        options = list(_fields_of(struct_type)) if struct_type is not None else []
        full = f"{path.strip('.')}.{field}".strip(".")
        return ConfigError(f"{where}: unknown key {full!r}{_did_you_mean(field, options)}")
    return ConfigError(f"{where}: {text.replace('$.', '')}")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["algo.lr=3e-4", "resources.launch=inprocess"]`` -> nested dict."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. algo.lr=3e-4)")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {part!r}")
        node[parts[-1]] = load_yaml(value) if value else ""
    return out


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(source: str | Path | dict[str, Any] | RunConfig, overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig from a YAML path, a dict or a RunConfig, with ``key=value`` overrides."""
    if isinstance(source, RunConfig):
        raw: dict[str, Any] = msgspec.to_builtins(source)
        where = "config"
    elif isinstance(source, dict):
        raw, where = dict(source), "config"
    else:
        path = Path(source)
        where = str(path)
        if not path.is_file():
            raise ConfigError(f"{where}: no such config file")
        try:
            loaded = load_yaml(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{where}: the top level must be a mapping of config fields")
        raw = loaded
        raw.setdefault("config_dir", str(path.parent.resolve()))
    if overrides:
        raw = _merge(raw, parse_overrides(overrides))
        where += " + overrides"
    try:
        cfg = msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as exc:
        raise _explain(exc, raw, where) from None
    except ValueError as exc:  # __post_init__ checks of nested structs (TinyModelSpec, LossConfig)
        raise ConfigError(f"{where}: {exc}") from None
    _check(cfg, where)
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(msgspec.to_builtins(cfg), sort_keys=False)


def resolve_path(cfg: RunConfig, path: str) -> Path:
    """A path from a config: absolute, or relative to the config file, the cwd, or the package root."""
    p = Path(path)
    if p.is_absolute():
        return p
    for base in (Path(cfg.config_dir), Path.cwd(), Path(__file__).resolve().parent.parent):
        if (base / p).exists():
            return (base / p).resolve()
    return (Path(cfg.config_dir) / p).resolve()
