"""Run configs: typed (msgspec), validated once at load time, overridable with ``key=value``.

A run config picks a pipeline (the stage graph, ``pipelines/*.yaml``) and sets the model, the
task, the algorithm's hyper-parameters and the resources. Every field has a default and a
description in its type (``Annotated[float, msgspec.Meta(description=...)]``), from which
:mod:`streamrl.config_reference` renders docs/config.md and ``streamrl config --help``; unknown
keys are errors with a did-you-mean. ``streamrl run CONFIG algo.lr=3e-4`` sets a field from the
command line (values parse as YAML: ``true``, ``3e-4``, ``[1, 2]``).

``load_config`` checks the config alone: unknown keys and each field's type and range, field by
field so that one bad field does not hide another, then every cross-field rule and the output
paths. It raises :class:`ConfigErrors` (a ``ConfigError``) listing every problem, each with the
file, the dotted key (``algo.max_new_tokens``), its line in the file and the fix. The checks that
need the pipeline, the task or the model run afterwards in
:func:`streamrl.runtime.prerun.load_pipeline` (the pipeline's checks, each stage class's
``check_spec``, then ``check_run``), which raises a ``ConfigError``.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml
from msgspec import Meta

from streamrl.algos.grpo import LossConfig
from streamrl.dock.limits import LIMIT_BOUNDS, DockLimits
from streamrl.models.spec import TinyModelSpec


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


# torch.set_float32_matmul_precision's settings (streamrl.models.matmul_precision applies them)
MatmulPrecision = Literal["highest", "high", "medium"]


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The policy model: a pretrained directory, or a tiny model built from ``tiny``."""

    path: Annotated[str | None, Meta(description=(
        "A local save_pretrained directory (safetensors), or a hub id already in the local Hugging Face cache "
        "(streamrl never downloads). null: build model.tiny from its config"))] = None
    tiny: Annotated[TinyModelSpec, Meta(description="The tiny model built when model.path is null")] = (
        msgspec.field(default_factory=TinyModelSpec))
    dtype: Annotated[Literal["float32", "bfloat16", "float16"], Meta(description=(
        "Compute dtype of every stage. The trainer keeps float32 master weights and AdamW state and computes in "
        "this dtype (FSDP2 mixed precision, gradients reduced in float32, the loss's log-softmax in float32); "
        "generation and the reference run in it; on a CPU their attention computes in float32 (the half-precision "
        "attention kernels are slower there) and the linear layers in this dtype, several times faster than "
        "float32 on CPUs with AMX or AVX512-BF16. float16 has no loss scaling: prefer bfloat16"))] = "float32"
    matmul_precision: Annotated[MatmulPrecision, Meta(description=(
        "Precision inside the float32 matmuls of every stage (torch.set_float32_matmul_precision), model.dtype "
        "float32 only. highest: float32. high: TF32 where the hardware has it (NVIDIA Ampere and later). medium: "
        "inputs rounded to bfloat16, accumulated in float32 (GPUs, and CPUs with AMX or AVX512-BF16 through "
        "oneDNN: the linear layers 2-4x faster). Tensors, master weights and AdamW state stay float32, and "
        "attention keeps highest. Below highest, logprobs differ across layouts (packed vs padded rows, R=2 vs "
        "R=1) by the rounding, so runs are not bit-exact across them"))] = "highest"
    extra_chars: Annotated[str, Meta(description=(
        "Characters the built-in character tokenizer knows beyond digits, '+' and '=' (model.path unset)"))] = ""


class TaskConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where prompts and their rewards come from."""

    name: Annotated[str, Meta(description=(
        "A built-in task (streamrl.tasks.registry, e.g. digits-max), jsonl (a prompt file) or dataset, or one "
        "registered with streamrl.tasks.register_task"))] = "digits-max"
    options: Annotated[dict[str, Any], Meta(description=(
        "Keyword arguments of the task factory, e.g. {n_digits: 3}; checked against the task when the run "
        "is validated"))] = msgspec.field(default_factory=dict)
    seed: Annotated[int, Meta(description="Prompt stream seed (and the per-epoch shuffle of a dataset)")] = 0
    chat_template: Annotated[bool, Meta(description=(
        "Render each prompt through the tokenizer's chat template (model.path's tokenizer must have one): a "
        "plain prompt becomes one user message; a dataset row may give whole messages"))] = False
    system_prompt: Annotated[str | None, Meta(description=(
        "With chat_template: a system message put before every prompt's messages (null: none)"))] = None


def overlong_buffer_tokens(algo: AlgoConfig) -> int:
    """``algo.overlong_buffer`` in tokens. A float is a fraction of ``max_new_tokens`` in whole tokens,
    rounded down: a cap of a few tokens gets no buffer rather than a one-token cliff at the cap."""
    if isinstance(algo.overlong_buffer, float):
        return math.floor(algo.overlong_buffer * algo.max_new_tokens)
    return algo.overlong_buffer


class DynamicSamplingConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """DAPO's dynamic sampling: a group whose rewards are all equal has zero advantage and teaches
    nothing, so the pipeline's filter stage drops it and the source generates more until every step
    has its batch_size samples of informative groups (or, with ``token_budget``, its response tokens)."""

    enabled: Annotated[bool, Meta(description=(
        "Generate more prompts whenever a stage drops samples, until each optimizer step has "
        "prompts_per_step x group_size samples; needs a stage that drops: the filter of "
        "pipelines/dapo_rollout.yaml or pipelines/dapo.yaml (groups whose rewards are all equal), or an agent stage with "
        "options.lost_sessions: drop (sessions lost with a worker)"))] = False
    max_rounds: Annotated[int, Meta(description=(
        "Cap on over-generation: the source makes at most this many rounds of prompts_per_step prompts per "
        "optimizer step (counted over the run); past it the run fails saying so, as the task is then too "
        "easy or too hard for the policy. 0 = no cap"))] = 10
    token_budget: Annotated[int, Meta(description=(
        "Response tokens trained per optimizer step (loss_mask 1, where a stage writes one), summed over the "
        "train stage's workers; 0 = a step is "
        "prompts_per_step x group_size samples. With a budget a step's size varies: each model replica "
        "claims micro-batch after micro-batch (the same count on every rank) until the step's response "
        "tokens reach the budget, and prompts_per_step x group_size is only the source's estimate of a "
        "step. Needs algo.max_staleness >= 1: the samples a step leaves when it reaches its budget train "
        "in the next one"))] = 0


class CriticConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """PPO's critic (pipelines/ppo.yaml's value and critic stages): a value model built like the
    policy, trained on FSDP2 with its own AdamW."""

    lr: Annotated[float, Meta(description=(
        "The critic's AdamW peak learning rate; it follows the policy's algo.lr_schedule, warmup_steps and "
        "total_steps"))] = 1e-3
    betas: Annotated[tuple[float, float], Meta(description="The critic's AdamW (beta1, beta2)")] = (0.9, 0.999)
    weight_decay: Annotated[float, Meta(description="The critic's AdamW decoupled weight decay")] = 0.0
    max_grad_norm: Annotated[float | None, Meta(description=(
        "Clip the critic's gradient norm to this; null = no clipping"))] = 1.0
    value_clip: Annotated[float | None, Meta(description=(
        "PPO's value clip c: the loss is max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), V_old the value "
        "the advantages used; null = plain squared error"))] = 0.2


class AlgoConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The algorithm (GRPO) and its optimizer: run length, sampling, learning rate, staleness."""

    steps: Annotated[int, Meta(description="Optimizer steps; each publishes a new policy version")] = 300
    prompts_per_step: Annotated[int, Meta(description="Prompts per optimizer step")] = 8
    group_size: Annotated[int, Meta(description=(
        "Completions per prompt (GRPO's G); the advantage normalises within a group"))] = 8
    max_new_tokens: Annotated[int, Meta(description="Completion length cap (tokens)")] = 4
    temperature: Annotated[float, Meta(description="Sampling temperature of generation (> 0)")] = 1.0
    top_p: Annotated[float, Meta(description="Nucleus sampling: keep the smallest token set of this probability "
                                             "mass; 1.0 = off")] = 1.0
    top_k: Annotated[int, Meta(description="Sample among the k most likely tokens; 0 = off")] = 0
    epochs: Annotated[float | None, Meta(description=(
        "Run length in passes over the task's train split, instead of algo.steps (set one of the two): "
        "steps = ceil(epochs * rows / prompts_per_step), resolved when the run starts"))] = None
    lr: Annotated[float, Meta(description="AdamW peak learning rate (after warmup)")] = 1e-3
    lr_schedule: Annotated[Literal["constant", "linear", "cosine"], Meta(description=(
        "Learning rate per optimizer step (transformers' schedulers): linear warmup from 0 over warmup_steps, "
        "then constant, or a linear / cosine decay to lr * min_lr_ratio at total_steps"))] = "constant"
    warmup_steps: Annotated[int, Meta(description="Optimizer steps of linear warmup from 0 to lr")] = 0
    min_lr_ratio: Annotated[float, Meta(description=(
        "The decay's floor, as a fraction of lr (linear and cosine)"))] = 0.0
    total_steps: Annotated[int | None, Meta(description=(
        "The schedule's length in optimizer steps; null = algo.steps"))] = None
    betas: Annotated[tuple[float, float], Meta(description="AdamW's (beta1, beta2)")] = (0.9, 0.999)
    weight_decay: Annotated[float, Meta(description="AdamW's decoupled weight decay")] = 0.0
    max_grad_norm: Annotated[float | None, Meta(description=(
        "Clip the global gradient norm to this; null = no clipping"))] = 1.0
    overlong_buffer: Annotated[int | float, Meta(description=(
        "DAPO's overlong reward shaping: a response longer than max_new_tokens - overlong_buffer loses up to "
        "overlong_penalty of its reward, linearly, the whole of it at max_new_tokens. An integer is tokens; a "
        "float in (0, 1) is a fraction of max_new_tokens, rounded down (DAPO: 0.2, 4096 of 20480); 0 = off"))] = 0
    overlong_penalty: Annotated[float, Meta(description=(
        "The reward a response at the length cap loses (with overlong_buffer > 0)"))] = 1.0
    advantage: Annotated[str, Meta(description=(
        "The advantage estimator the advantage stage calls on each group's rewards: grpo (centred, divided by "
        "the group's std), dr_grpo (centred only), rloo (leave-one-out baseline), reinforce_pp (group mean "
        "removed, then whitened over the micro-batch) or module:function (docs/algorithms.md)"))] = "grpo"
    advantage_options: Annotated[dict[str, Any], Meta(description=(
        "Keyword arguments of the advantage estimator, e.g. {eps: 1e-4}; checked against its signature when "
        "the config loads"))] = msgspec.field(default_factory=dict)
    loss: Annotated[LossConfig, Meta(description="The policy loss's hyper-parameters")] = (
        msgspec.field(default_factory=LossConfig))
    old_logprobs: Annotated[Literal["rollout", "recompute"], Meta(description=(
        "Where the trainer's 'old' logprobs come from: the generator's sampled-token logprobs (rollout, no "
        "extra forward) or a no-grad forward in the trainer (recompute)"))] = "rollout"
    dynamic_sampling: Annotated[DynamicSamplingConfig, Meta(description=(
        "DAPO's dynamic sampling (variable generation per step, fixed trained samples per step)"))] = (
        msgspec.field(default_factory=DynamicSamplingConfig))
    max_staleness: Annotated[int, Meta(description=(
        "How many policy versions generation may run ahead of training. 0: synchronous on-policy (step s is "
        "generated with the weights of step s). k >= 1: generation runs up to k policy versions ahead of "
        "training; the trainer drops anything older. Off-policy samples are "
        "corrected against their rollout logprobs: by the clipped ratio pi/pi_rollout (old_logprobs: rollout), "
        "or with old_logprobs: recompute by loss.correction's importance weight (capped at loss.is_cap)"))] = 0
    stop_reward: Annotated[float | None, Meta(description=(
        "Stop early once a step's mean reward >= this; null = run every step"))] = None
    critic: Annotated[CriticConfig, Meta(description=(
        "PPO's critic (used by pipelines/ppo.yaml's critic stage; ignored without one)"))] = (
        msgspec.field(default_factory=CriticConfig))


def _limit(name: str, description: str) -> Any:
    """``int`` bounded as DockLimits bounds the dock limit ``name``, with its description."""
    lo, hi = LIMIT_BOUNDS[name]
    return Annotated[int, Meta(ge=lo, le=hi, description=description)]


_MessageMib = _limit("max_message_mib", (
    "Largest tensor frame a warehouse or client accepts (MiB; ZMQ_MAXMSGSIZE; 1 GiB holds any real tensor)"))
_HeaderMib = _limit("max_header_mib", (
    "Largest header, and largest message the controller accepts (MiB; it only receives headers)"))
_MaxClients = _limit("max_clients", (
    "Client ids the controller keeps state for at once (idle ones are forgotten after their TTL)"))
_MaxParked = _limit("max_parked", "Claims, reserves and stats requests the controller holds open at once (long-polls)")


class DockConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The transfer dock (controller and warehouses) that holds samples between stages. The server
    limits' defaults and ranges are streamrl.dock.limits.DockLimits' (docs/dock-protocol.md §6.1)."""

    capacity: Annotated[int | None, Meta(description=(
        "Samples in flight; null = (algo.max_staleness + 2) steps' worth"))] = None
    # the lower bounds of warehouses and lease_ttl_s are checked in _check; the upper ones are the dock's
    warehouses: Annotated[int, Meta(le=65536, description="Warehouse processes that store the samples' tensors")] = 1
    transport: Annotated[Literal["ipc", "tcp"], Meta(description=(
        "Socket transport of the dock: ipc (one machine) or tcp"))] = "ipc"
    lease_ttl_s: Annotated[float, Meta(le=3600, description=(
        "Seconds a worker may stay silent before its leased samples go to others (the dock accepts up to an "
        "hour)"))] = 30.0
    max_message_mib: _MessageMib = DockLimits.max_message_mib
    max_header_mib: _HeaderMib = DockLimits.max_header_mib
    max_clients: _MaxClients = DockLimits.max_clients
    max_parked: _MaxParked = DockLimits.max_parked


class StageOverride(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Per-stage overrides of the pipeline file's settings (``stages.<name>``); null keeps the pipeline's. A link of
    a chain stage (streamrl.stages.chain) takes ``stages.<link>.options``; the chain's other settings are its own."""

    workers: Annotated[int | None, Meta(description="Worker processes of the stage")] = None
    micro_batch: Annotated[int | None, Meta(description="Samples per claim from the dock")] = None
    device: Annotated[str | None, Meta(description=(
        "Device of the stage's workers (cpu, cuda, cuda:N, npu, auto); the pipeline's default is "
        "resources.device"))] = None
    threads: Annotated[int | None, Meta(description=(
        "The most torch intra-op threads a worker computes with; with resources.core_share, fewer while other "
        "stages compute on the host (an equal share of its cores)"))] = None
    options: Annotated[dict[str, Any] | None, Meta(description=(
        "Stage options, merged over the pipeline's options of that stage (built-in stages' options: see "
        "the options.* sections)"))] = None


class RayConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``resources.launch: ray`` (pip install 'streamrl[ray]'): where the run's processes go."""

    address: Annotated[str | None, Meta(description=(
        "null: start a Ray instance on this machine for the run, stopped at its end; auto: the cluster this "
        "machine joined with `ray start`; HOST:PORT: that cluster's head (GCS address)"))] = None
    strategy: Annotated[Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"], Meta(description=(
        "How the workers' bundles spread over the nodes (a Ray placement-group strategy): PACK fills a node "
        "before the next; SPREAD / STRICT_SPREAD put bundles on different nodes"))] = "PACK"
    stage_resources: Annotated[dict[str, dict[str, float]], Meta(description=(
        "Ray resources each worker of a stage needs beyond its CPUs (stage threads) and accelerator (one GPU for "
        "device cuda, one NPU for npu), e.g. {generate: {node_b: 1}} to pin generation to the nodes that offer "
        "the custom resource node_b"))] = msgspec.field(default_factory=dict)
    num_cpus: Annotated[int | None, Meta(description=(
        "A Ray started for the run (address null): the CPUs it offers; null = every core"))] = None
    connect_timeout_s: Annotated[float, Meta(description=(
        "An address (auto or HOST:PORT): how long joining the cluster may take before the run fails naming "
        "resources.ray.address (joining takes seconds; Ray itself retries an unreachable cluster without end)"))] = 60.0
    warehouse_per_node: Annotated[bool, Meta(description=(
        "One warehouse per node that runs workers (data stays on its node); false: one warehouse, on the "
        "controller's node"))] = True
    dock_block: Annotated[int, Meta(description=(
        "The dock's ownership block (docs/dock-protocol.md): samples a producer reserves are numbered inside "
        "blocks of this many indices that its own node's warehouse owns; >= algo.group_size"))] = 4096


class ResourcesConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How and where the run's processes start, and when a stuck or dead one stops the run."""

    launch: Annotated[Literal["processes", "inprocess", "ray"], Meta(description=(
        "processes: controller, warehouses and every stage worker are separate local processes. inprocess: "
        "stages run as tasks in this process (dock servers in threads), for debugging. ray: every process is "
        "placed on a Ray cluster (resources.ray); the dock runs over tcp, every socket with CURVE and the run's "
        "keys (docs/ray.md)"))] = "processes"
    encryption: Annotated[Literal["auto", "off", "curve"], Meta(description=(
        "Every ZeroMQ socket of the run admits only the run's own processes, in every launch mode. off: "
        "authentication without encryption (ZAP PLAIN, a password per role), for links that never leave the "
        "host; curve: CURVE, every connection encrypted and authenticated, for links across machines; auto: "
        "curve with launch: ray, off otherwise (docs/guide.md, Security)"))] = "auto"
    ray: Annotated[RayConfig, Meta(description="Placement on a Ray cluster (launch: ray)")] = (
        msgspec.field(default_factory=RayConfig))
    device: Annotated[str, Meta(description=(
        "Default device of model stages: cpu, cuda, cuda:N, npu, auto"))] = "cpu"
    core_share: Annotated[bool, Meta(description=(
        "CPU stages share the host's cores at each decoder layer and decode step: a compute call uses its "
        "stage's threads while it computes alone, an equal share of the cores while other stages compute "
        "too (docs/architecture.md §7, Threads). false: each stage keeps its threads"))] = True
    loop_affinity: Annotated[bool, Meta(description=(
        "Each local process's event loop and ZeroMQ I/O threads on one core, round robin over the host's cores "
        "in launch order (the dock's controller and warehouses, then the workers); compute threads keep every "
        "core. A message between processes then wakes threads on known cores instead of wherever the kernel "
        "finds room (docs/benchmarks.md §39). Linux, resources.launch: processes. false: the kernel places them "
        "(a host whose cores other jobs pin)"))] = True
    dock: Annotated[DockConfig, Meta(description="The transfer dock")] = msgspec.field(default_factory=DockConfig)
    start_timeout_s: Annotated[float, Meta(description=(
        "Seconds within which worker start-up (imports, model build) must finish"))] = 120.0
    max_restarts: Annotated[int, Meta(description=(
        "A worker of a restartable stage (generate, score, reference, advantage: no training state) whose "
        "process dies is started again, at most this many times per run; 0 = the run stops"))] = 3
    stall_timeout_s: Annotated[float, Meta(description=(
        "Seconds without an optimizer step after the last one that count as a stall: the run stops, reporting "
        "the stack of every worker busy in a batch (faulthandler); 0 = never. The first step may take twice "
        "this (warm-up)"))] = 1800.0
    exit_grace_s: Annotated[float, Meta(description=(
        "When the run ends, seconds its workers get to exit by themselves (they close their stages: the "
        "trainer's final export) before the launcher sends SIGTERM, then SIGKILL 5 s later; a worker whose "
        "event loop is blocked (a stall) waits this out. A worker whose launcher died exits hard after this "
        "or 10 s, whichever is shorter"))] = 30.0
    auto_resume: Annotated[int, Meta(description=(
        "A run whose trainer dies resumes from its newest checkpoint (output.checkpoint_every) up to this many "
        "times, in the same run directory; 0 = stop and say how to resume"))] = 0


class EvalConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Held-out evaluation: a stage of its own generates on the task's eval split with the newest
    policy version while training goes on, and writes ``eval/...`` rows to metrics.jsonl."""

    every: Annotated[int, Meta(description=(
        "Evaluate policy versions every, 2*every, ... (optimizer steps); 0 = no evaluation"))] = 0
    at_end: Annotated[bool, Meta(description=(
        "Also evaluate the final version (when every > 0), from the exported checkpoint (output.checkpoint)"))] = True
    end_timeout_s: Annotated[float, Meta(description=(
        "Seconds within which the final evaluation must finish after training ends"))] = 600.0
    max_prompts: Annotated[int | None, Meta(description=(
        "Eval prompts per evaluation (the first of the eval split); null = all"))] = None
    samples: Annotated[int, Meta(description=(
        "Completions per eval prompt: mean@k and pass@k with k = samples"))] = 1
    pass_threshold: Annotated[float, Meta(description=(
        "pass@k counts a prompt when one of its k rewards is >= this"))] = 1.0
    temperature: Annotated[float, Meta(description="Sampling temperature; 0 = greedy (then samples must be 1)")] = 0.0
    max_new_tokens: Annotated[int | None, Meta(description=(
        "Completion length cap (tokens); null = algo.max_new_tokens"))] = None
    seed: Annotated[int, Meta(description=(
        "Sampling seed (temperature > 0), and the prompts of a task without an eval split"))] = 0


class WandbConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Weights & Biases logging (pip install wandb). offline: files under <run dir>/wandb, no
    network (upload later with `wandb sync`)."""

    project: Annotated[str, Meta(description="The W&B project")] = "streamrl"
    mode: Annotated[Literal["online", "offline"], Meta(description=(
        "online: log to the W&B server; offline: files under <run dir>/wandb, uploaded later with "
        "`wandb sync`"))] = "online"
    entity: Annotated[str | None, Meta(description="The W&B entity (user or team); null = your default")] = None
    group: Annotated[str | None, Meta(description="A W&B run group; null = none")] = None
    tags: Annotated[list[str], Meta(description="Tags of the W&B run")] = msgspec.field(default_factory=list)


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a run writes, and where."""

    run_dir: Annotated[str, Meta(description="Each run writes to <run_dir>/<name>-<timestamp>/")] = "runs"
    name: Annotated[str, Meta(description="The run's name: a plain file name (no '/')")] = "run"
    tensorboard: Annotated[bool, Meta(description="Write TensorBoard event files into the run directory")] = True
    wandb: Annotated[WandbConfig | None, Meta(description="Weights & Biases logging; null = no W&B run")] = None
    plot: Annotated[bool, Meta(description="Plot reward_curve.png at the end")] = True
    checkpoint: Annotated[bool, Meta(description=(
        "Export the final policy as a transformers save_pretrained directory"))] = True
    checkpoint_every: Annotated[int, Meta(description=(
        "A resumable checkpoint (policy, optimizer, schedule, RNG, data position) every N optimizer steps, and "
        "on SIGTERM; 0 = none (`streamrl run --resume` needs one)"))] = 0
    keep_checkpoints: Annotated[int, Meta(description=(
        "The newest N checkpoints are kept; older ones are deleted once a newer one is complete"))] = 2
    progress: Annotated[Literal["auto", "tty", "lines", "none"], Meta(description=(
        "Progress display on the terminal: auto picks tty (a live line) on a terminal, else lines; "
        "none: silent"))] = "auto"
    status_page: Annotated[bool, Meta(description=(
        "Serve a live status page while the run trains (127.0.0.1, a port from the OS, the run's token); its URL "
        "is printed and written to <run dir>/status.url (mode 0600); `streamrl status RUN_DIR` reads it"))] = True
    trace: Annotated[bool, Meta(description=(
        "Record a timeline of every worker's batches, dock waits and policy versions: trace/<stage>-<k>.json as "
        "the run goes, merged into trace.json at its end (`streamrl trace RUN_DIR`; docs/observability.md)"))] = True


# RunConfig.pipeline: "auto" stands for one of the two files below (streamrl.runtime.prerun.choose_pipeline)
AUTO_PIPELINE = "auto"
SYNC_PIPELINE = "pipelines/grpo_sync.yaml"  # algo.max_staleness 0: a step in one process
STREAMING_PIPELINE = "pipelines/grpo_rollout.yaml"  # generation in a process of its own, free to run ahead


class RunConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A run: the pipeline it runs and every setting of its stages."""

    preset: Annotated[str | None, Meta(description=(
        "A named algorithm whose settings this config starts from (its own values win): grpo, dr_grpo, rloo, "
        "reinforce_pp, gspo, cispo, dapo, ppo (streamrl/algos/presets/<name>.yaml), or a path to a YAML file of "
        "config fields; null = the defaults"))] = None
    pipeline: Annotated[str, Meta(description=(
        "The pipeline file (the stage graph), relative to the config file, the cwd, or the package. auto: "
        "pipelines/grpo_sync.yaml (each step generated, scored and trained in one process) for algo.max_staleness "
        "0 on a CPU host where it fits (one train worker, the built-in engine, no dynamic sampling), else "
        "pipelines/grpo_rollout.yaml; the run's config.yaml records the file chosen"))] = "auto"
    seed: Annotated[int, Meta(description=(
        "Sampling seed of generation (each worker and batch derive their generator's seed from it)"))] = 0
    model: Annotated[ModelConfig, Meta(description="The policy model")] = msgspec.field(default_factory=ModelConfig)
    task: Annotated[TaskConfig, Meta(description="The task: prompts and rewards")] = (
        msgspec.field(default_factory=TaskConfig))
    algo: Annotated[AlgoConfig, Meta(description="The algorithm's hyper-parameters")] = (
        msgspec.field(default_factory=AlgoConfig))
    resources: Annotated[ResourcesConfig, Meta(description="Processes, devices and the dock")] = (
        msgspec.field(default_factory=ResourcesConfig))
    output: Annotated[OutputConfig, Meta(description="What the run writes")] = (
        msgspec.field(default_factory=OutputConfig))
    eval: Annotated[EvalConfig, Meta(description="Held-out evaluation")] = msgspec.field(default_factory=EvalConfig)
    stages: Annotated[dict[str, StageOverride], Meta(description=(
        "Per-stage overrides, by stage name: stages.<name>.<field>"))] = msgspec.field(default_factory=dict)
    config_dir: Annotated[str, Meta(description=(
        "Set by the loader: the directory relative paths in the config resolve against"))] = "."

    @property
    def batch_size(self) -> int:
        return self.algo.prompts_per_step * self.algo.group_size

    @property
    def dock_capacity(self) -> int:
        cap = self.resources.dock.capacity
        return cap if cap is not None else (self.algo.max_staleness + 2) * self.batch_size


def _optimizer_rules(o: AlgoConfig | CriticConfig, at: str) -> list[tuple[bool, str]]:
    """AdamW's settings, the policy's (``algo``) or the critic's (``algo.critic``)."""
    return [
        (o.lr > 0 and math.isfinite(o.lr), f"{at}.lr must be > 0 and finite, e.g. 1e-3; got {o.lr}"),
        (all(0 <= b < 1 for b in o.betas), f"{at}.betas must both be in [0, 1), e.g. [0.9, 0.999]; got {list(o.betas)}"),
        (o.weight_decay >= 0 and math.isfinite(o.weight_decay), f"{at}.weight_decay must be >= 0, got {o.weight_decay}"),
        (o.max_grad_norm is None or (o.max_grad_norm > 0 and math.isfinite(o.max_grad_norm)),
         f"{at}.max_grad_norm must be > 0, or null for no clipping; got {o.max_grad_norm}"),
    ]


def _advantage_rules(a: AlgoConfig) -> list[tuple[bool, str]]:
    """algo.advantage names a registered estimator or a module:function that takes the options."""
    from streamrl.algos.advantages import ADVANTAGES, takes_values
    from streamrl.algos.registry import UnknownAlgorithmError

    try:
        estimator = ADVANTAGES.resolve(a.advantage)
    except UnknownAlgorithmError as exc:
        return [(False, f"algo.advantage: {exc}")]
    try:
        inputs = {"values": None} if takes_values(estimator) else {}
        inspect.signature(estimator).bind(rewards=None, group_ids=None, **inputs, **a.advantage_options)
    except TypeError as exc:
        return [(False, f"algo.advantage_options {sorted(a.advantage_options)} do not fit {a.advantage!r}: {exc}")]
    except ValueError:  # no signature to check
        pass
    return []


def _check(cfg: RunConfig) -> list[str]:
    """Cross-field and range checks of the config alone (no files, no imports): the message of
    every failing rule, each starting with its dotted key and saying what to write instead. Checks
    that need the pipeline, the task or the model are in :func:`streamrl.runtime.prerun.check_run`."""
    a = cfg.algo
    r = cfg.resources
    rules: list[tuple[bool, str]] = [
        (a.steps >= 1, f"algo.steps must be >= 1, got {a.steps}"),
        (a.prompts_per_step >= 1, f"algo.prompts_per_step must be >= 1, got {a.prompts_per_step}"),
        (a.group_size >= 1, f"algo.group_size must be >= 1, got {a.group_size}"),
        (a.group_size >= 2 or a.advantage not in ("grpo", "rloo"),
         f"algo.group_size must be >= 2 for algo.advantage: {a.advantage} (it compares the samples of a group)"),
        *_advantage_rules(a),
        (a.dynamic_sampling.max_rounds >= 0,
         f"algo.dynamic_sampling.max_rounds must be >= 0 (0 = no cap), got {a.dynamic_sampling.max_rounds}"),
        (a.dynamic_sampling.token_budget >= 0,
         f"algo.dynamic_sampling.token_budget must be >= 0 (response tokens per step; 0 = a step is "
         f"prompts_per_step x group_size samples), got {a.dynamic_sampling.token_budget}"),
        (a.dynamic_sampling.token_budget <= 0 or a.dynamic_sampling.enabled,
         "algo.dynamic_sampling.token_budget needs algo.dynamic_sampling.enabled: true (the source's waves, "
         "pipelines/dapo.yaml's filter); enable it, or set token_budget: 0"),
        (a.dynamic_sampling.token_budget <= 0 or a.max_staleness >= 1,
         f"algo.dynamic_sampling.token_budget={a.dynamic_sampling.token_budget} needs algo.max_staleness >= 1: "
         "a step ends inside the samples generated for it, and those left over train in the next step, one "
         "version later (a synchronous run could not train them); set max_staleness: 1, or token_budget: 0 "
         "for steps of prompts_per_step x group_size samples"),
        (0 <= a.overlong_buffer <= a.max_new_tokens and (isinstance(a.overlong_buffer, int) or a.overlong_buffer < 1),
         f"algo.overlong_buffer must be an integer in [0, algo.max_new_tokens={a.max_new_tokens}] (tokens; 0 = off) "
         f"or a float in (0, 1) (a fraction of max_new_tokens), got {a.overlong_buffer!r}"),
        (a.overlong_penalty >= 0 and math.isfinite(a.overlong_penalty),
         f"algo.overlong_penalty must be a finite number >= 0, got {a.overlong_penalty}"),
        (not (a.max_staleness > 0 and a.old_logprobs == "recompute" and a.loss.is_cap is None),
         "algo.max_staleness > 0 with algo.old_logprobs: recompute trains on off-policy samples without a "
         "correction: set algo.loss.is_cap (e.g. 2.0), or algo.old_logprobs: rollout"),
        (a.max_new_tokens >= 1, f"algo.max_new_tokens must be >= 1, got {a.max_new_tokens}"),
        (a.temperature > 0 and math.isfinite(a.temperature), f"algo.temperature must be > 0 and finite, got {a.temperature}"),
        (0 < a.top_p <= 1, f"algo.top_p must be in (0, 1] (1.0 = off), got {a.top_p}"),
        (a.top_k >= 0, f"algo.top_k must be >= 0 (0 = off), got {a.top_k}"),
        *_optimizer_rules(a, "algo"),  # the policy's AdamW
        *_optimizer_rules(a.critic, "algo.critic"),  # PPO's critic has its own
        (a.critic.value_clip is None or a.critic.value_clip > 0,
         f"algo.critic.value_clip must be > 0, or null for an unclipped value loss; got {a.critic.value_clip}"),
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
        (r.exit_grace_s >= 0 and math.isfinite(r.exit_grace_s),
         f"resources.exit_grace_s must be >= 0 seconds, got {r.exit_grace_s}"),
        (r.auto_resume >= 0, f"resources.auto_resume must be >= 0 (0 = never), got {r.auto_resume}"),
        (r.ray.num_cpus is None or r.ray.num_cpus >= 1,
         f"resources.ray.num_cpus must be >= 1, or null for every core; got {r.ray.num_cpus}"),
        (r.ray.connect_timeout_s > 0 and math.isfinite(r.ray.connect_timeout_s),
         f"resources.ray.connect_timeout_s must be > 0 seconds, got {r.ray.connect_timeout_s}"),
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
        (cfg.model.matmul_precision == "highest" or cfg.model.dtype == "float32",
         f"model.matmul_precision {cfg.model.matmul_precision} lowers float32 matmuls, but model.dtype is "
         f"{cfg.model.dtype}: its matmuls already compute in it; leave model.matmul_precision highest"),
    ]
    failed = [message for ok, message in rules if not ok]
    return failed + _check_output(cfg.output) + _check_extra_chars(cfg.model.extra_chars)


def _check_output(out: OutputConfig) -> list[str]:
    problems = []
    name = out.name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        problems.append(f"output.name {name!r} must be a plain file name (no '/'): each run writes "
                        "<output.run_dir>/<output.name>-<timestamp>/")
    if not out.run_dir.strip():
        return [*problems, "output.run_dir is empty; give a directory, e.g. runs"]
    # runs are made under the cwd's run_dir (the launcher's Path(run_dir)): the directory, or the
    # first of its ancestors that exists, must be a directory we may write into
    path = Path(out.run_dir).expanduser()
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == path else f"is under {str(probe)!r}, which is a file"
        problems.append(f"output.run_dir {out.run_dir!r} {what}, not a directory; "
                        "set output.run_dir to a directory (it is created if missing)")
    elif probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        problems.append(f"output.run_dir {out.run_dir!r}: cannot write into {str(probe)!r} "
                        "(permission denied); choose another output.run_dir")
    return problems


def _check_extra_chars(extra_chars: str) -> list[str]:
    from streamrl.models.tokenizer import TokenizerConfigError, check_extra_chars

    try:
        check_extra_chars(extra_chars)
    except TokenizerConfigError as exc:
        return [f"model.{exc}"]
    return []


def did_you_mean(word: str, options: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, else `` (known: a, b, ...)`` in their order."""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(options)})"


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


def bare_type(tp: Any) -> Any:
    """``tp`` without its ``Annotated[...]`` metadata (descriptions, bounds)."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def field_types(struct_type: Any) -> dict[str, Any]:
    """Field name -> declared type of a Struct, with its ``Annotated`` metadata (msgspec validates
    against this: bounds included)."""
    hints = typing.get_type_hints(struct_type, include_extras=True)
    return {f.name: hints[f.name] for f in msgspec.structs.fields(struct_type)}


def field_description(tp: Any) -> str:
    """The ``msgspec.Meta(description=...)`` of an annotated field type ("" without one)."""
    text = ""
    while typing.get_origin(tp) is Annotated:
        args = typing.get_args(tp)
        for meta in args[1:]:
            if isinstance(meta, msgspec.Meta) and meta.description:
                text = meta.description
        tp = args[0]
    return text


def struct_in(tp: Any) -> Any:
    """The Struct a field holds (``S`` or ``S | None``), else None."""
    tp = bare_type(tp)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    structs = [a for a in typing.get_args(tp) if isinstance(bare_type(a), type) and issubclass(bare_type(a), msgspec.Struct)]
    return bare_type(structs[0]) if len(structs) == 1 and typing.get_origin(tp) in (typing.Union, types.UnionType) else None


def _fields_of(struct_type: Any) -> dict[str, Any]:
    return {name: bare_type(tp) for name, tp in field_types(struct_type).items()}


_PREFIXES = {"LossConfig.": "algo.loss.", "TinyModelSpec.": "model.tiny."}


def _type_at(parts: list[str]) -> Any:
    """The declared type of a dotted config path (None where it cannot be followed)."""
    struct_type: Any = RunConfig
    if len(parts) >= 2 and parts[0] == "stages":
        struct_type, parts = StageOverride, parts[2:]  # stages.<name>: a dict of overrides
    for part in parts:
        if "[" in part or struct_in(struct_type) is None:
            return None
        struct_type = _fields_of(struct_in(struct_type)).get(part)
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
    tp = bare_type(tp)
    if typing.get_origin(tp) is Literal:
        return list(typing.get_args(tp))
    return [v for arg in typing.get_args(tp) for v in _allowed_values(arg)]


def _explain(text: str, raw: dict[str, Any]) -> str:
    """msgspec's message (``... - at `$.algo.lr```) as one that names the dotted key, the value
    given and the fix."""
    problem, _, at = text.partition(" - at `$")
    parts = [p for p in at.rstrip("`").strip(".").split(".") if p]
    key = ".".join(parts)
    for prefix, dotted in _PREFIXES.items():  # __post_init__ checks of nested structs name their class
        if problem.startswith(prefix):
            return f"{dotted}{problem[len(prefix):]}"
    found, value = _value_at(raw, parts)
    given = f" (given: {value!r})" if found else ""
    if problem.startswith("Invalid enum value"):
        return f"{key} must be one of {_allowed_values(_type_at(parts))}, got {value!r}"
    if problem.startswith("Expected `"):
        hint = ""
        if problem.startswith("Expected `object`"):
            hint = f"; write it as a mapping, e.g. {key}: {{key: value}}"
        elif "of length" in problem:
            hint = f"; e.g. {key}: [0.9, 0.999]" if key.endswith("betas") else ""
        return f"{key}: {problem[0].lower()}{problem[1:]}{given}{hint}"
    return f"{key}: {problem}{given}" if key else problem


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong in a config: where (the file, the dotted key and its line) and what to do."""

    file: str  # the config file ("config" for a dict), "+ overrides" when the key came from key=value;
    # "" where the message names its source itself (the pre-run checks' "run config: ...")
    key: str  # the dotted key ("" for the config as a whole)
    line: int | None  # 1-based line of the key in the file; None: not written in the file
    message: str  # what is wrong, naming the key; most say what to write instead
    hint: str = ""  # more help where the message has none (the field's description)

    def __str__(self) -> str:
        at = f"{self.file}, line {self.line}" if self.line is not None else self.file
        return (f"{at}: " if at else "") + self.message + (f"; {self.hint}" if self.hint else "")


class ConfigErrors(ConfigError):
    """Every problem found in one config (at least one); its text lists them all, one a line."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = list(problems)
        if len(self.problems) == 1:
            text = str(self.problems[0])
        else:
            text = f"{len(self.problems)} problems:\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(text)


def key_lines(text: str) -> dict[str, int]:
    """Dotted key -> the 1-based line it is written on in YAML ``text`` (mappings only: keys of
    nested mappings are dotted, list items are not followed); {} where ``text`` does not compose."""
    try:
        root = yaml.compose(text, Loader=YamlLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                dotted = prefix + str(key_node.value)
                lines[dotted] = key_node.start_mark.line + 1
                walk(value_node, dotted + ".")

    if root is not None:
        walk(root, "")
    return lines


class _Problems:
    """Collects a config's problems with their file, line and origin (the file or an override)."""

    def __init__(self, where: str, lines: dict[str, int], overridden: set[str]) -> None:
        self.where, self.lines, self.overridden = where, lines, overridden
        self.found: list[ConfigProblem] = []
        self.bad_keys: list[str] = []  # keys whose value was refused: dropped before the cross-field rules

    def from_override(self, key: str) -> bool:
        parts = key.split(".")
        return any(".".join(parts[:i]) in self.overridden for i in range(1, len(parts) + 1))

    def add(self, key: str, message: str, hint: str = "") -> None:
        if self.from_override(key):
            file, line = f"{self.where} + overrides", None
        else:
            file = self.where
            parts = key.split(".")  # the key's own line, else its nearest written parent's
            line = next((self.lines[".".join(parts[:i])] for i in range(len(parts), 0, -1)
                         if ".".join(parts[:i]) in self.lines), None)
        self.found.append(ConfigProblem(file=file, key=key, line=line, message=message, hint=hint))


def _field_problems(raw: dict[str, Any], struct_type: Any, prefix: list[str], out: _Problems,
                    root: dict[str, Any]) -> None:
    """Check mapping ``raw`` against ``struct_type`` field by field, so that one bad field does not
    hide another: unknown keys, each value's type and bounds, then the struct's own
    ``__post_init__`` rules where its fields are all good."""
    fields = field_types(struct_type)
    before = len(out.found)
    for name, value in raw.items():
        path = [*prefix, str(name)]
        key = ".".join(path)
        if name not in fields:
            out.add(key, f"unknown key {key!r}{did_you_mean(str(name), sorted(fields))}")
            out.bad_keys.append(key)
            continue
        tp = fields[name]
        sub = struct_in(tp)
        if sub is not None and isinstance(value, dict):
            _field_problems(value, sub, path, out, root)
            continue
        if struct_type is RunConfig and name == "stages" and isinstance(value, dict):
            for stage, over in value.items():
                if isinstance(over, dict):
                    _field_problems(over, StageOverride, [*path, str(stage)], out, root)
                else:
                    _value_problem(over, StageOverride, [*path, str(stage)], out, root)
            continue
        _value_problem(value, tp, path, out, root)
    if len(out.found) == before and prefix:  # the struct's own rules (TinyModelSpec, LossConfig)
        try:
            msgspec.convert(raw, struct_type)
        except ValueError as exc:  # msgspec.ValidationError included
            text = str(exc).partition(" - at `$")[0]
            for cls_prefix, dotted in _PREFIXES.items():
                text = text.replace(cls_prefix, dotted)
            key = ".".join(prefix)
            named = _KEY_AT_START.match(text)
            out.add(named.group(0) if named and named.group(0).startswith(key + ".") else key,
                    text if text.startswith(key) else f"{key}: {text}")
            out.bad_keys.append(key)  # the whole struct: its rule may tie several of its fields


def _value_problem(value: Any, tp: Any, path: list[str], out: _Problems, root: dict[str, Any]) -> None:
    key = ".".join(path)
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError as exc:
        text = str(exc)
        problem, _, inner = text.partition(" - at `$")
        where = key + inner.rstrip("`")
        description = field_description(tp).split(". ")[0]  # its first sentence
        section = "stages" if path[0] == "stages" else ".".join(path[:-1]) or "top"
        hint = f"{description} (streamrl config --help {section})" if description else ""
        out.add(key, _explain(f"{problem} - at `$.{where}`", root), hint=hint)
        out.bad_keys.append(key)


_KEY_AT_START = re.compile(r"^[A-Za-z_]+(?:\.[A-Za-z_]+)*")
_DOTTED = re.compile(r"(?<![\w.])[a-z_]+(?:\.[a-z_]+)+")


def _rule_key(message: str, out: _Problems) -> str:
    """The key a cross-field rule's message is about: the first one it names that the file or an
    override sets, else the one it starts with."""
    start = _KEY_AT_START.match(message)
    named = ([start.group(0)] if start else []) + _DOTTED.findall(message)
    for key in named:
        if key in out.lines or out.from_override(key):
            return key
    return named[0] if named else ""


def _mentions(message: str, key: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) is not None


def _drop(raw: dict[str, Any], key: str) -> dict[str, Any]:
    """``raw`` without dotted ``key`` (copies the mappings on its path)."""
    parts = key.split(".")
    out = dict(raw)
    node = out
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            return out
        node[part] = dict(node[part])
        node = node[part]
    node.pop(parts[-1], None)
    return out


PRESETS_DIR = Path(__file__).parent / "algos" / "presets"


def preset_names() -> list[str]:
    """The named algorithm presets shipped with streamrl."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def read_preset(name: object, config_dir: Path) -> dict[str, Any]:
    """The config fields of preset ``name``: a shipped preset's name, or a YAML file's path
    (relative to the config's directory or the cwd). A preset names no preset itself."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"preset must be a preset's name or a YAML file's path, got {name!r}")
    if name.endswith((".yaml", ".yml")):
        candidates = [config_dir / name, Path(name)]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ConfigError(f"preset: no such file {name!r} (looked in {config_dir} and the cwd)")
    else:
        path = PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            raise ConfigError(f"preset: unknown preset {name!r}{did_you_mean(name, preset_names())}; presets: "
                              f"{', '.join(preset_names())}, or a YAML file's path")
    raw = read_yaml_mapping(path, "preset", "a mapping of config fields (key: value lines)")
    if "preset" in raw:
        raise ConfigError(f"{path}: a preset cannot name another preset (preset: {raw['preset']!r})")
    return raw


def load_config(source: str | Path | dict[str, Any] | RunConfig, overrides: list[str] | None = None) -> RunConfig:
    """A validated RunConfig from a YAML path, a dict or a RunConfig, with ``key=value`` overrides.

    Raises :class:`ConfigErrors` (a ConfigError) listing every problem found: unknown keys, each
    field's type and range, and every failing cross-field rule, each with its file, dotted key and
    line in the file."""
    lines: dict[str, int] = {}
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
        lines = key_lines(path.read_text())
        raw.setdefault("config_dir", str(path.parent.resolve()))
    overridden: set[str] = set()
    if overrides:
        parsed = parse_overrides(overrides)
        overridden = {item.partition("=")[0] for item in overrides}
        raw = _merge(raw, parsed)
    if raw.get("preset") is not None:
        raw = _merge(read_preset(raw["preset"], Path(str(raw.get("config_dir", ".")))), raw)
    out = _Problems(where, lines, overridden)
    _field_problems(raw, RunConfig, [], out, raw)
    good = raw
    for key in out.bad_keys:  # the cross-field rules judge what is left (refused values take their defaults)
        good = _drop(good, key)
    try:
        cfg = msgspec.convert(good, RunConfig)
    except ValueError as exc:  # not expected after the field checks; report it rather than hide it
        out.add("", _explain(str(exc), raw))
        raise ConfigErrors(out.found) from None
    algo_raw = raw.get("algo") if isinstance(raw.get("algo"), dict) else {}
    rules = _check(cfg)
    if cfg.algo.epochs is not None and "steps" in algo_raw:
        rules.insert(0, "algo.epochs and algo.steps both set the run's length; keep one (algo.epochs counts "
                        "passes over the train split, algo.steps optimizer steps)")
    for message in rules:
        if any(_mentions(message, key) for key in out.bad_keys):
            continue  # it would judge a refused value's default, not what was written
        out.add(_rule_key(message, out), message)
    if out.found:  # in the file's order; those from overrides (no line) last
        raise ConfigErrors(sorted(out.found, key=lambda p: (p.line is None, p.line or 0)))
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
            f"model.path {text!r}: not a local directory (looked at {tried}), nor, read as a hub id, in the "
            f"Hugging Face cache ({HF_HUB_CACHE}: {type(exc).__name__}); streamrl does not download models. "
            f"If {text!r} is the directory to load from, download the model into it: `hf download OWNER/NAME "
            f"--local-dir {text}`; if it is a hub id: `hf download {text}`"
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
