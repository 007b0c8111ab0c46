"""Run configs: typed (msgspec), validated once at load time, overridable with ``key=value``.

A run config picks a pipeline (the stage graph, ``pipelines/*.yaml``) and sets the model, the
task, the algorithm's hyper-parameters and the resources. Every field has a default documented
here; unknown keys are errors with a did-you-mean. ``streamrl run CONFIG algo.lr=3e-4`` sets a
field from the command line (values parse as YAML: ``true``, ``3e-4``, ``[1, 2]``).

``load_config`` checks the config alone (types, ranges, cross-field rules, output paths); the
checks that need the pipeline, the task or the model run in ``load_pipeline``
(:func:`streamrl.runtime.pipeline.check_run`). Errors are ``ConfigError`` naming the file, the
dotted key (``algo.max_new_tokens``) and the fix.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import typing
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from streamrl.algos.grpo import LossConfig
from streamrl.dock.limits import LIMIT_BOUNDS, DockLimits
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


def read_yaml_mapping(path: Path, kind: str, shape: str) -> dict[str, Any]:
    """The mapping at the top of YAML file ``path`` (a ``kind`` file: config, pipeline); a
    ConfigError naming the file, and the line for a YAML error, otherwise."""
    try:
        loaded = load_yaml(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the {kind} file: {exc}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: the top level must be {shape}, got a {type(loaded).__name__}")
    return loaded


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as ``line L, column C: <problem>`` (1-based; PyYAML counts from 0), so a user
    can jump to it; its own message repeats the line with a caret we do not need."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    text = f"{context}, {problem}" if context else str(problem)
    if mark is None:
        return text
    return f"line {mark.line + 1}, column {mark.column + 1}: {text}"


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # A local save_pretrained directory (safetensors). None: build `tiny` from a config.
    path: str | None = None
    tiny: TinyModelSpec = msgspec.field(default_factory=TinyModelSpec)
    # Compute dtype of every stage. The trainer keeps float32 master weights and AdamW state and
    # computes in this dtype (FSDP2 mixed precision, gradients reduced in float32, the loss's
    # log-softmax in float32); generation and the reference run in it. float16 has no loss
    # scaling: prefer bfloat16.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Characters the built-in character tokenizer knows beyond digits, '+' and '='.
    extra_chars: str = ""


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str = "digits-max"  # a built-in task (streamrl.tasks.registry) or "jsonl"
    options: dict[str, Any] = msgspec.field(default_factory=dict)  # passed to the task factory
    seed: int = 0  # prompt stream seed (and the per-epoch shuffle of a dataset)
    # Render each prompt through the tokenizer's chat template (model.path's tokenizer must have
    # one): a plain prompt becomes one user message; a dataset row may give whole messages.
    chat_template: bool = False
    # With chat_template: a system message put before every prompt's messages (None: none).
    system_prompt: str | None = None


class AlgoConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    steps: int = 300  # optimizer steps; each publishes a new policy version
    prompts_per_step: int = 8  # prompts per optimizer step
    group_size: int = 8  # completions per prompt (GRPO's G); the advantage normalises within a group
    max_new_tokens: int = 4  # completion length cap (tokens)
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    # Run length in passes over the task's train split, instead of algo.steps (set one of the two):
    # steps = ceil(epochs * rows / prompts_per_step), resolved when the run starts.
    epochs: float | None = None
    lr: float = 1e-3  # AdamW peak learning rate (after warmup)
    # Learning rate per optimizer step (transformers' schedulers): linear warmup from 0 over
    # warmup_steps, then constant, or a linear / cosine decay to lr * min_lr_ratio at total_steps.
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # the decay's floor, as a fraction of lr (linear and cosine)
    total_steps: int | None = None  # the schedule's length in optimizer steps; None = algo.steps
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


def _limit(name: str) -> Any:
    """``int`` bounded as DockLimits bounds the dock limit ``name``."""
    lo, hi = LIMIT_BOUNDS[name]
    return typing.Annotated[int, msgspec.Meta(ge=lo, le=hi)]


_MessageMib = _limit("max_message_mib")
_HeaderMib = _limit("max_header_mib")
_MaxClients = _limit("max_clients")
_MaxParked = _limit("max_parked")


class DockConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    capacity: int | None = None  # samples in flight; None = (max_staleness + 2) steps' worth
    # lower bounds of warehouses and lease_ttl_s are checked in _check; the upper ones are the dock's
    warehouses: typing.Annotated[int, msgspec.Meta(le=65536)] = 1
    transport: Literal["ipc", "tcp"] = "ipc"
    # a worker silent this long loses its leased samples to others (the dock accepts up to an hour)
    lease_ttl_s: typing.Annotated[float, msgspec.Meta(le=3600)] = 30.0
    # limits of the dock servers (streamrl.dock.limits.DockLimits, which gives their defaults and
    # ranges; docs/dock-protocol.md §6.1):
    # largest tensor frame a warehouse/client accepts (ZMQ_MAXMSGSIZE; 1 GiB holds any real tensor)
    max_message_mib: _MessageMib = DockLimits.max_message_mib
    # largest header, and largest message the controller accepts (it only receives headers)
    max_header_mib: _HeaderMib = DockLimits.max_header_mib
    # client ids the controller keeps state for at once (idle ones are forgotten after their TTL)
    max_clients: _MaxClients = DockLimits.max_clients
    # claims/reserves the controller holds open at once (long-polls)
    max_parked: _MaxParked = DockLimits.max_parked


class StageOverride(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    workers: int | None = None
    micro_batch: int | None = None
    device: str | None = None
    threads: int | None = None
    options: dict[str, Any] | None = None


class RayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``resources.launch: ray`` (pip install 'streamrl[ray]'): where the run's processes go."""

    # None: start a Ray instance on this machine for the run, stopped at its end; "auto": the
    # cluster this machine joined with `ray start`; "HOST:PORT": that cluster's head (GCS address)
    address: str | None = None
    # how the workers' bundles spread over the nodes (a Ray placement-group strategy): PACK fills
    # a node before the next; SPREAD / STRICT_SPREAD put bundles on different nodes
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # Ray resources each worker of a stage needs beyond its CPUs (stage threads) and accelerator
    # (one GPU for device cuda, one NPU for npu), e.g. {generate: {node_b: 1}} to pin generation
    # to the nodes that offer the custom resource node_b
    stage_resources: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    # a Ray started for the run (address None): the CPUs it offers; None = every core
    num_cpus: int | None = None
    # one warehouse per node that runs workers (data stays on its node); false: one warehouse, on
    # the controller's node
    warehouse_per_node: bool = True
    # the ownership block of the dock (docs/dock-protocol.md): samples a producer reserves are
    # numbered inside blocks of this many indices that its own node's warehouse owns
    dock_block: int = 4096


class ResourcesConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # "processes": controller, warehouses and every stage worker are separate local processes.
    # "inprocess": stages run as tasks in this process (dock servers in threads), for debugging.
    # "ray": every process is placed on a Ray cluster (resources.ray); the dock runs over tcp,
    # every socket with CURVE and the run's keys (see docs/ray.md)
    launch: Literal["processes", "inprocess", "ray"] = "processes"
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    device: str = "cpu"  # default device of model stages: cpu, cuda, cuda:N, npu, auto
    dock: DockConfig = msgspec.field(default_factory=DockConfig)
    start_timeout_s: float = 120.0  # worker start-up (imports, model build) must finish within this
    # a worker of a restartable stage (generate, score, reference, advantage: no training state)
    # whose process dies is started again, at most this many times per run; 0 = the run stops
    max_restarts: int = 3
    # no optimizer step for this long (seconds) after the last one = a stall: the run stops,
    # reporting the stack of every worker busy in a batch (faulthandler); 0 = never. The first
    # step may take longer (warm-up): it gets twice this.
    stall_timeout_s: float = 1800.0
    # a run whose trainer dies resumes from its newest checkpoint (output.checkpoint_every) up
    # to this many times, in the same run directory; 0 = stop and say how to resume
    auto_resume: int = 0


class EvalConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Held-out evaluation: a stage of its own generates on the task's eval split with the newest
    policy version while training goes on, and writes ``eval/...`` rows to metrics.jsonl."""

    every: int = 0  # evaluate policy versions every, 2*every, ... (optimizer steps); 0 = no evaluation
    # also evaluate the final version (when every > 0), from the exported checkpoint (output.checkpoint)
    at_end: bool = True
    end_timeout_s: float = 600.0  # the final evaluation must finish within this after training ends
    max_prompts: int | None = None  # eval prompts per evaluation (the first of the eval split); None = all
    samples: int = 1  # completions per eval prompt: mean@k and pass@k with k = samples
    pass_threshold: float = 1.0  # pass@k counts a prompt when one of its k rewards is >= this
    temperature: float = 0.0  # 0 = greedy (then samples must be 1)
    max_new_tokens: int | None = None  # None = algo.max_new_tokens
    seed: int = 0  # sampling seed (temperature > 0), and the prompts of a task without an eval split


class WandbConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Weights & Biases logging (pip install wandb). offline: files under <run dir>/wandb, no
    network (upload later with `wandb sync`)."""

    project: str = "streamrl"
    mode: Literal["online", "offline"] = "online"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = msgspec.field(default_factory=list)


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    run_dir: str = "runs"  # each run writes to <run_dir>/<name>-<timestamp>/
    name: str = "run"
    tensorboard: bool = True
    wandb: WandbConfig | None = None  # None: no Weights & Biases run
    plot: bool = True  # reward_curve.png at the end
    checkpoint: bool = True  # final policy as a transformers save_pretrained directory
    # a resumable checkpoint (policy, optimizer, schedule, RNG, data position) every N optimizer
    # steps, and on SIGTERM; 0 = none (`streamrl run --resume` needs one)
    checkpoint_every: int = 0
    keep_checkpoints: int = 2  # the newest N are kept; older ones are deleted once a newer one is complete
    progress: Literal["auto", "tty", "lines", "none"] = "auto"  # none: silent
    # a timeline of every worker's batches, dock waits and policy versions: trace/<stage>-<k>.json as
    # the run goes, merged into trace.json at its end (docs/observability.md, `streamrl trace`)
    trace: bool = True


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pipeline: str = "pipelines/grpo.yaml"  # relative to the config file, the cwd, or the package
    seed: int = 0
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    task: TaskConfig = msgspec.field(default_factory=TaskConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    resources: ResourcesConfig = msgspec.field(default_factory=ResourcesConfig)
    output: OutputConfig = msgspec.field(default_factory=OutputConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
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
    """Cross-field and range checks of the config alone (no files, no imports): each rule names
    its dotted key and says what to write instead. Checks that need the pipeline, the task or the
    model are in :func:`streamrl.runtime.pipeline.check_run`."""
    a = cfg.algo
    r = cfg.resources
    rules: list[tuple[bool, str]] = [
        (a.steps >= 1, f"algo.steps must be >= 1, got {a.steps}"),
        (a.prompts_per_step >= 1, f"algo.prompts_per_step must be >= 1, got {a.prompts_per_step}"),
        (a.group_size >= 1, f"algo.group_size must be >= 1, got {a.group_size}"),
        (a.group_size >= 2 or not a.normalize_std,
         "algo.group_size must be >= 2 to normalise rewards in a group (or set algo.normalize_std: false)"),
        (a.max_new_tokens >= 1, f"algo.max_new_tokens must be >= 1, got {a.max_new_tokens}"),
        (a.temperature > 0 and math.isfinite(a.temperature), f"algo.temperature must be > 0 and finite, got {a.temperature}"),
        (0 < a.top_p <= 1, f"algo.top_p must be in (0, 1] (1.0 = off), got {a.top_p}"),
        (a.top_k >= 0, f"algo.top_k must be >= 0 (0 = off), got {a.top_k}"),
        (a.lr > 0 and math.isfinite(a.lr), f"algo.lr must be > 0 and finite, e.g. 1e-3; got {a.lr}"),
        (all(0 <= b < 1 for b in a.betas), f"algo.betas must both be in [0, 1), e.g. [0.9, 0.999]; got {list(a.betas)}"),
        (a.weight_decay >= 0 and math.isfinite(a.weight_decay), f"algo.weight_decay must be >= 0, got {a.weight_decay}"),
        (a.max_grad_norm is None or (a.max_grad_norm > 0 and math.isfinite(a.max_grad_norm)),
         f"algo.max_grad_norm must be > 0, or null for no clipping; got {a.max_grad_norm}"),
        (a.max_staleness >= 0, f"algo.max_staleness must be >= 0 (0 = synchronous on-policy), got {a.max_staleness}"),
        (a.stop_reward is None or math.isfinite(a.stop_reward),
         f"algo.stop_reward must be a finite number, or null to run all algo.steps; got {a.stop_reward}"),
        (a.loss.temperature == a.temperature or a.loss.temperature == 1.0,
         "algo.loss.temperature must equal algo.temperature (logprobs are recomputed at the sampling one); "
         "leave algo.loss.temperature out"),
        (a.epochs is None or (a.epochs > 0 and math.isfinite(a.epochs)),
         f"algo.epochs must be > 0 (passes over the train split, e.g. 1 or 0.5), or null; got {a.epochs}"),
        (a.warmup_steps >= 0, f"algo.warmup_steps must be >= 0, got {a.warmup_steps}"),
        (0 <= a.min_lr_ratio <= 1, f"algo.min_lr_ratio must be in [0, 1] (a fraction of algo.lr), got {a.min_lr_ratio}"),
        (a.total_steps is None or a.total_steps >= 1,
         f"algo.total_steps must be >= 1, or null for algo.steps; got {a.total_steps}"),
        (a.total_steps is None or a.warmup_steps <= a.total_steps,
         f"algo.warmup_steps ({a.warmup_steps}) must be <= algo.total_steps ({a.total_steps})"),
        (cfg.eval.every >= 0, f"eval.every must be >= 0 (0 = no evaluation), got {cfg.eval.every}"),
        (cfg.eval.max_prompts is None or cfg.eval.max_prompts >= 1,
         f"eval.max_prompts must be >= 1, or null for the whole eval split; got {cfg.eval.max_prompts}"),
        (cfg.eval.end_timeout_s > 0 and math.isfinite(cfg.eval.end_timeout_s),
         f"eval.end_timeout_s must be > 0 seconds, got {cfg.eval.end_timeout_s}"),
        (math.isfinite(cfg.eval.pass_threshold), f"eval.pass_threshold must be a finite number, got "
         f"{cfg.eval.pass_threshold}"),
        (cfg.eval.samples >= 1, f"eval.samples must be >= 1, got {cfg.eval.samples}"),
        (cfg.eval.temperature >= 0 and math.isfinite(cfg.eval.temperature),
         f"eval.temperature must be >= 0 (0 = greedy), got {cfg.eval.temperature}"),
        (cfg.eval.temperature > 0 or cfg.eval.samples == 1,
         f"eval.samples={cfg.eval.samples} with eval.temperature 0 (greedy) would repeat one completion; "
         "set eval.temperature > 0 (e.g. 0.7) or eval.samples: 1"),
        (cfg.eval.max_new_tokens is None or cfg.eval.max_new_tokens >= 1,
         f"eval.max_new_tokens must be >= 1, or null for algo.max_new_tokens; got {cfg.eval.max_new_tokens}"),
        (cfg.output.wandb is None or bool(cfg.output.wandb.project.strip()),
         "output.wandb.project is empty; name the W&B project, e.g. streamrl"),
        (r.dock.warehouses >= 1, f"resources.dock.warehouses must be >= 1, got {r.dock.warehouses}"),
        (r.dock.capacity is None or r.dock.capacity >= 1,
         f"resources.dock.capacity must be >= 1, or null for (max_staleness + 2) steps' worth; got {r.dock.capacity}"),
        (cfg.dock_capacity >= cfg.batch_size,
         f"resources.dock.capacity ({cfg.dock_capacity}) must hold one step: >= algo.prompts_per_step * "
         f"algo.group_size ({cfg.batch_size}); raise it or leave it out (null)"),
        (r.dock.lease_ttl_s >= 0.05 and math.isfinite(r.dock.lease_ttl_s),  # the dock's MIN_TTL_S
         f"resources.dock.lease_ttl_s must be >= 0.05 seconds (the dock's lower bound), got {r.dock.lease_ttl_s}"),
        (r.start_timeout_s > 0 and math.isfinite(r.start_timeout_s),
         f"resources.start_timeout_s must be > 0 seconds, got {r.start_timeout_s}"),
        (r.max_restarts >= 0, f"resources.max_restarts must be >= 0 (0 = no restarts), got {r.max_restarts}"),
        (r.stall_timeout_s >= 0 and math.isfinite(r.stall_timeout_s),
         f"resources.stall_timeout_s must be >= 0 seconds (0 = no stall detection), got {r.stall_timeout_s}"),
        (r.auto_resume >= 0, f"resources.auto_resume must be >= 0 (0 = never), got {r.auto_resume}"),
        (r.ray.num_cpus is None or r.ray.num_cpus >= 1,
         f"resources.ray.num_cpus must be >= 1, or null for every core; got {r.ray.num_cpus}"),
        (r.ray.address is None or bool(r.ray.address.strip()),
         "resources.ray.address is empty; write auto (the cluster this machine joined), HOST:PORT, or null "
         "to start Ray for this run"),
        (r.ray.dock_block >= cfg.algo.group_size,
         f"resources.ray.dock_block ({r.ray.dock_block}) must hold a group: >= algo.group_size ({cfg.algo.group_size})"),
        (all(v >= 0 and math.isfinite(v) for res in r.ray.stage_resources.values() for v in res.values()),
         f"resources.ray.stage_resources amounts must be >= 0, got {r.ray.stage_resources}"),
        (r.auto_resume == 0 or cfg.output.checkpoint_every > 0,
         "resources.auto_resume needs checkpoints to resume from: set output.checkpoint_every, e.g. 50"),
        (cfg.output.checkpoint_every >= 0,
         f"output.checkpoint_every must be >= 0 steps (0 = no checkpoints), got {cfg.output.checkpoint_every}"),
        (cfg.output.keep_checkpoints >= 1,
         f"output.keep_checkpoints must be >= 1 (the newest is what --resume reads), got {cfg.output.keep_checkpoints}"),
        (bool(cfg.task.name.strip()), "task.name is empty; name a task, e.g. digits-max, or jsonl with task.options.path"),
        (bool(cfg.pipeline.strip()), "pipeline is empty; name a pipeline file, e.g. pipelines/grpo.yaml"),
        (cfg.model.path is None or bool(cfg.model.path.strip()),
         "model.path is empty; leave it out (null) to build model.tiny, or give a save_pretrained directory"),
    ]
    for ok, message in rules:
        if not ok:
            raise ConfigError(f"{where}: {message}")
    _check_output(cfg.output, where)
    _check_extra_chars(cfg.model.extra_chars, where)


def _check_output(out: OutputConfig, where: str) -> None:
    name = out.name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(f"{where}: output.name {name!r} must be a plain file name (no '/'): each run writes "
                          "<output.run_dir>/<output.name>-<timestamp>/")
    if not out.run_dir.strip():
        raise ConfigError(f"{where}: output.run_dir is empty; give a directory, e.g. runs")
    # runs are made under the cwd's run_dir (the launcher's Path(run_dir)): the directory, or the
    # first of its ancestors that exists, must be a directory we may write into
    path = Path(out.run_dir).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == path else f"is under {str(probe)!r}, which is a file"
        raise ConfigError(f"{where}: output.run_dir {out.run_dir!r} {what}, not a directory; "
                          "set output.run_dir to a directory (it is created if missing)")
    if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: output.run_dir {out.run_dir!r}: cannot write into {str(probe)!r} "
                          "(permission denied); choose another output.run_dir")


def _check_extra_chars(extra_chars: str, where: str) -> None:
    from streamrl.models.tokenizer import TokenizerConfigError, check_extra_chars

    try:
        check_extra_chars(extra_chars)
    except TokenizerConfigError as exc:
        raise ConfigError(f"{where}: model.{exc}") from None


def did_you_mean(word: str, options: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, else `` (known: a, b, ...)`` in their order."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(options)})"


def _fields_of(struct_type: Any) -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(struct_type)}


_PREFIXES = {"LossConfig.": "algo.loss.", "TinyModelSpec.": "model.tiny."}


def _stage_path(path: str, raw: dict[str, Any]) -> str:
    """msgspec says ``stages[...]`` for a dict value: find the stage override that fails on its own."""
    if not path.startswith(".stages[...]"):
        return path
    stages = raw.get("stages") if isinstance(raw.get("stages"), dict) else {}
    for name, value in (stages or {}).items():
        try:
            msgspec.convert(value, StageOverride)
        except msgspec.ValidationError:
            return f".stages.{name}" + path[len(".stages[...]"):]
    return path


def _type_at(parts: list[str]) -> Any:
    """The declared type of a dotted config path (None where it cannot be followed)."""
    struct_type: Any = RunConfig
    if len(parts) >= 2 and parts[0] == "stages":
        struct_type, parts = StageOverride, parts[2:]  # stages.<name>: a dict of overrides
    for part in parts:
        if "[" in part or not (isinstance(struct_type, type) and issubclass(struct_type, msgspec.Struct)):
            return None
        struct_type = _fields_of(struct_type).get(part)
    return struct_type


def _value_at(raw: Any, parts: list[str]) -> tuple[bool, Any]:
    node = raw
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _allowed_values(tp: Any) -> list[Any]:
    """The literal values a field accepts (``Literal[...]``, possibly inside ``X | None``)."""
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in _allowed_values(arg)]


def _explain(exc: msgspec.ValidationError, raw: dict[str, Any], where: str) -> ConfigError:
    """Turn msgspec's message into one that names the dotted key, the value given and the fix."""
    text = str(exc)
    problem, _, at = text.partition(" - at `$")
    path = _stage_path(at.rstrip("`"), raw)
    parts = [p for p in path.strip(".").split(".") if p]
    key = ".".join(parts)
    if text.startswith("Object contains unknown field"):
        field = text.split("`")[1]
        struct_type = _type_at(parts)
        is_struct = isinstance(struct_type, type) and issubclass(struct_type, msgspec.Struct)
        options = list(_fields_of(struct_type)) if is_struct else []
        full = f"{key}.{field}".strip(".")
        return ConfigError(f"{where}: unknown key {full!r}{did_you_mean(field, sorted(options))}")
    for prefix, dotted in _PREFIXES.items():  # __post_init__ checks of nested structs name their class
        if problem.startswith(prefix):
            return ConfigError(f"{where}: {dotted}{problem[len(prefix):]}")
    found, value = _value_at(raw, parts)
    given = f" (given: {value!r})" if found else ""
    if problem.startswith("Invalid enum value"):
        allowed = _allowed_values(_type_at(parts))
        return ConfigError(f"{where}: {key} must be one of {allowed}, got {value!r}")
    if problem.startswith("Object missing required field"):
        return ConfigError(f"{where}: {key or 'the config'} misses the required key {problem.split('`')[1]!r}")
    if problem.startswith("Expected `"):
        hint = ""
        if problem.startswith("Expected `object`"):
            hint = f"; write it as a mapping, e.g. {key}: {{key: value}}"
        elif "of length" in problem:
            hint = f"; e.g. {key}: [0.9, 0.999]" if key.endswith("betas") else ""
        return ConfigError(f"{where}: {key}: {problem[0].lower()}{problem[1:]}{given}{hint}")
    return ConfigError(f"{where}: {key}: {problem}{given}" if key else f"{where}: {problem}")


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["algo.lr=3e-4", "resources.launch=inprocess"]`` -> nested dict (values parse as YAML)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not KEY=VALUE (e.g. algo.lr=3e-4)")
        parts = key.split(".")
        if any(not part or part != part.strip() for part in parts):
            raise ConfigError(f"override {item!r}: the key {key!r} must be dotted names without spaces or empty "
                              "parts, e.g. algo.lr=3e-4")
        try:
            parsed = load_yaml(value) if value else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({yaml_problem(exc)}); quote it, "
                              f"e.g. {key}='\"...\"'") from None
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override of {part!r}")
        node[parts[-1]] = parsed
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
        raw = read_yaml_mapping(path, "config", "a mapping of config fields (key: value lines)")
        raw.setdefault("config_dir", str(path.parent.resolve()))
    if overrides:
        raw = _merge(raw, parse_overrides(overrides))
        where += " + overrides"
    try:
        cfg = msgspec.convert(raw, RunConfig)
    except msgspec.ValidationError as exc:
        raise _explain(exc, raw, where) from None
    except ValueError as exc:  # __post_init__ checks of nested structs (TinyModelSpec, LossConfig)
        text = str(exc)
        for prefix, dotted in _PREFIXES.items():
            text = text.replace(prefix, dotted)
        raise ConfigError(f"{where}: {text}") from None
    algo_raw = raw.get("algo") if isinstance(raw.get("algo"), dict) else {}
    if cfg.algo.epochs is not None and "steps" in algo_raw:
        raise ConfigError(f"{where}: algo.epochs and algo.steps both set the run's length; keep one (algo.epochs "
                          "counts passes over the train split, algo.steps optimizer steps)")
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


# A Hugging Face hub id: "name" or "owner/name" (letters, digits, '-', '_', '.'; no '..' or '--').
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]*/)?[A-Za-z0-9][A-Za-z0-9_.-]*$")


def _looks_like_hub_id(text: str) -> bool:
    return bool(_HUB_ID.match(text)) and ".." not in text and "--" not in text and not text.endswith((".", "-"))


def resolve_model_dir(cfg: RunConfig) -> Path:
    """The directory ``model.path`` names: a local save_pretrained directory (absolute, or relative
    to the config file or the cwd), or a hub id ``owner/name`` already in the local Hugging Face
    cache (streamrl never downloads). Validation and every stage resolve it here, so they agree;
    the error says everything that was tried."""
    text = cfg.model.path
    if text is None:
        raise ConfigError("model.path is not set (the run builds model.tiny)")
    p = Path(text).expanduser()
    bases = dict.fromkeys([Path(cfg.config_dir).resolve(), Path.cwd().resolve()])
    candidates = [p] if p.is_absolute() else [base / p for base in bases]
    for c in candidates:
        if c.is_dir():
            return c.resolve()
    files = [c for c in candidates if c.exists()]
    if files:
        raise ConfigError(f"model.path {text!r}: {str(files[0])!r} is a file, not a save_pretrained directory "
                          "(a directory with config.json and *.safetensors)")
    tried = " and ".join(repr(str(c)) for c in candidates)
    if not _looks_like_hub_id(text) or p.is_absolute():
        raise ConfigError(f"model.path {text!r}: no such directory (looked at {tried}); give a save_pretrained "
                          "directory (config.json + *.safetensors), or a hub id like 'owner/name' already in the "
                          "local Hugging Face cache")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE

    try:
        return Path(snapshot_download(text, local_files_only=True))
    except Exception as exc:  # not cached (LocalEntryNotFoundError), or an id the hub library refuses
        raise ConfigError(
            f"model.path {text!r}: not a local directory (looked at {tried}) and not in the Hugging Face cache "
            f"({HF_HUB_CACHE}: {type(exc).__name__}); streamrl does not download models: run "
            f"`huggingface-cli download {text}` first, or set model.path to a save_pretrained directory"
        ) from None


def task_options(cfg: RunConfig) -> dict[str, Any]:
    """``task.options`` as the task factory gets them: a ``jsonl`` task's ``path``, and a ``dataset``
    task's ``path`` / ``eval_path`` where they name a file or directory, resolved like the pipeline
    (relative to the config file, the cwd or the checkout), so validation reads the same file the
    source stage will."""
    options = dict(cfg.task.options)
    if cfg.task.name == "jsonl" and isinstance(options.get("path"), str) and options["path"]:
        options["path"] = str(resolve_path(cfg, options["path"]))
    if cfg.task.name == "dataset":
        for key in ("path", "eval_path"):  # a file or directory: found like the pipeline; else a hub name
            value = options.get(key)
            if isinstance(value, str) and value and resolve_path(cfg, value).exists():
                options[key] = str(resolve_path(cfg, value))
    return options
