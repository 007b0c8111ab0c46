"""Bad configs, pipeline files and prompt rows are caught before anything starts.

Each case writes what it needs into a temp dir and validates in this process the way
``streamrl validate``, ``streamrl run`` and ``streamrl.run`` all begin (``load_config`` then
``load_pipeline``): one ConfigError that names the file / dotted key / row and says what to do,
in under 2 s (nothing is started, no model is loaded). A few go through the real command line in
a subprocess (exit code 2, stderr), and one checks that ``streamrl run`` on a bad config starts no
process and makes no run or temp directory.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.runtime.prerun import load_pipeline

REPO = Path(__file__).resolve().parents[1]
GRPO = REPO / "pipelines" / "grpo.yaml"
GRPO_KL = REPO / "pipelines" / "grpo_kl.yaml"
COLOCATED = REPO / "pipelines" / "grpo_colocated.yaml"
DISAGGREGATED = REPO / "pipelines" / "grpo_disaggregated.yaml"
DAPO = REPO / "pipelines" / "dapo.yaml"
PPO = REPO / "pipelines" / "ppo.yaml"
AGENT = REPO / "pipelines" / "agent.yaml"
VALIDATION_BUDGET_S = 2.0  # nothing starts: validation is file reads and imports already done
CLI_TIMEOUT_S = 120  # a fresh interpreter imports torch + transformers (several seconds on 2 busy cores)


@dataclass(frozen=True)
class Case:
    """One bad input. Strings may hold ``{tmp}`` (the case's temp dir) and ``{model}`` (a tiny
    save_pretrained directory whose config.json advertises 12 positions)."""

    needles: tuple[str, ...]  # all must be in the message: the file/key/row and the hint
    config: dict[str, Any] = field(default_factory=dict)  # merged over the base config
    overrides: tuple[str, ...] = ()
    files: dict[str, str | bytes] = field(default_factory=dict)  # written into {tmp} first
    source: str | None = None  # load this file of `files` as the config instead of the dict
    pipeline_edit: dict[str, dict[str, Any]] | None = None  # stage name -> fields set in edit_of
    edit_of: Path = GRPO  # the pipeline pipeline_edit changes


def _base(tmp: Path) -> dict[str, Any]:
    return {"pipeline": str(GRPO), "output": {"run_dir": str(tmp / "runs"), "progress": "none"}}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _fill(value: Any, subs: dict[str, str]) -> Any:
    if isinstance(value, str):
        for key, text in subs.items():
            value = value.replace("{" + key + "}", text)
        return value
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, subs) for v in value)
    return value


def _rows(*lines: object) -> str:
    """JSONL text: dicts/lists are dumped, strings kept as written (to make broken lines)."""
    return "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n"


GOOD_ROW = {"prompt": "12=", "answer": "21"}


def _jsonl(rows: str, **options: Any) -> dict[str, Any]:
    """A case config for the jsonl task over {tmp}/p.jsonl (files={"p.jsonl": rows})."""
    return {"task": {"name": "jsonl", "options": {"path": "{tmp}/p.jsonl", "reward": "digits-reverse", **options}}}


def _agent(options: dict[str, Any]) -> dict[str, Any]:
    """A case config for the agent pipeline on digits-guess with these agent stage options."""
    return {"pipeline": str(AGENT), "model": {"extra_chars": "?:|uat"}, "task": {"name": "digits-calc"},
            "stages": {"agent": {"options": options}}}


def _pipeline_with(p: Path, edits: dict[str, dict[str, Any]]) -> str:
    spec = yaml.safe_load(p.read_text())
    for stage in spec["stages"]:
        stage.update(edits.get(stage["name"], {}))
    return yaml.safe_dump(spec, sort_keys=False)


CASES: dict[str, Case] = {
    # ---------------------------------------------------------------- the task and its options
    "unknown-task": Case(("task.name", "'digit-max'", "did you mean 'digits-max'"),
                         config={"task": {"name": "digit-max"}}),
    "task-option-wrong-type": Case(("task.options", "n_digits must be an int", "got str '3'", "n_digits: 3"),
                                   config={"task": {"options": {"n_digits": "3"}}}),
    "task-option-unknown": Case(("task.options", "'n_digts'", "accepted options: ['n_digits'"),
                                config={"task": {"options": {"n_digts": 3}}}),
    "task-option-range": Case(("task.options", "min_digits <= max_digits", "raise max_digits"),
                              config={"task": {"name": "digits-reverse", "options": {"min_digits": 5, "max_digits": 2}}}),
    "task-option-tokenizer": Case(("task.options", "'tokenizer' is set by streamrl", "remove it"),
                                  config={"task": {"options": {"tokenizer": "gpt2"}}}),
    # ---------------------------------------------------------------- the model
    "model-path-missing": Case(("model.path", "'/nonexistent-srl-model'", "no such directory",
                                "save_pretrained directory"),
                               config={"model": {"path": "/nonexistent-srl-model"}}),
    "model-path-relative-missing": Case(("model.path", "'models/mine'", "{tmp}/models/mine", "not a local directory",
                                         "Hugging Face cache"),
                                        files={"c.yaml": "model: {path: models/mine}\npipeline: " + str(GRPO) + "\n"},
                                        source="c.yaml"),
    "model-hub-id-not-cached": Case(("model.path", "'streamrl-tests/no-such-model'", "Hugging Face cache",
                                     "`hf download streamrl-tests/no-such-model`"),
                                    config={"model": {"path": "streamrl-tests/no-such-model"}}),
    "model-path-is-a-file": Case(("model.path", "{tmp}/weights.bin", "is a file"),
                                 files={"weights.bin": "x"}, config={"model": {"path": "{tmp}/weights.bin"}}),
    "model-dir-without-config": Case(("model.path", "{tmp}/m", "has no config.json"),
                                     files={"m/README": "not a model"}, config={"model": {"path": "{tmp}/m"}}),
    "model-positions-from-config-json": Case(("algo.max_new_tokens=7", "13 > the model's 12 positions",
                                              "max_position_embeddings", "config.json",
                                              "lower algo.max_new_tokens to 6 or less"),
                                             config={"model": {"path": "{model}"}, "algo": {"max_new_tokens": 7}}),
    "tiny-positions": Case(("algo.max_new_tokens=60", "6 tokens", "66 > the model's 64 positions",
                            "model.tiny.max_positions", "lower algo.max_new_tokens to 58 or less"),
                           overrides=("algo.max_new_tokens=60",)),
    "reverse-prompts-beyond-positions": Case(("task 'digits-reverse'", "71 tokens", "model.tiny.max_positions",
                                              "use shorter prompts", "to 75 or more"),
                                             config={"task": {"name": "digits-reverse",
                                                              "options": {"max_digits": 70}}}),
    "model-path-with-extra-chars": Case(("model.extra_chars", "brings its own tokenizer", "remove model.extra_chars"),
                                        config={"model": {"path": "{model}", "extra_chars": "ab"}}),
    "extra-chars-repeated": Case(("model.extra_chars[1]", "appears twice", "list each character once"),
                                 config={"model": {"extra_chars": "aa"}}),
    "matmul-precision-with-bfloat16": Case(("model.matmul_precision medium", "model.dtype is bfloat16",
                                            "leave model.matmul_precision highest"),
                                           config={"model": {"dtype": "bfloat16", "matmul_precision": "medium"}}),
    "matmul-precision-unknown": Case(("model.matmul_precision", "'bf16'"),
                                     overrides=("model.matmul_precision=bf16",)),
    # ---------------------------------------------------------------- algorithm values
    "temperature-zero": Case(("algo.temperature must be > 0",), overrides=("algo.temperature=0",)),
    "top-p-above-one": Case(("algo.top_p must be in (0, 1]", "got 1.5"), overrides=("algo.top_p=1.5",)),
    "lr-infinite": Case(("algo.lr must be > 0 and finite", "e.g. 1e-3"), overrides=("algo.lr=.inf",)),
    "lr-not-a-number": Case(("algo.lr", "expected `float`", "'abc'"), overrides=("algo.lr=abc",)),
    "steps-zero": Case(("algo.steps must be >= 1", "got 0"), overrides=("algo.steps=0",)),
    "clip-low": Case(("algo.loss.clip_low must be in [0, 1]", "1.5"), overrides=("algo.loss.clip_low=1.5",)),
    "loss-agg-name": Case(("algo.loss.loss_agg: unknown loss aggregation 'mean'", "did you mean 'token-mean'?",
                           "module:function"),
                          overrides=("algo.loss.loss_agg=mean",)),
    "group-size-one": Case(("algo.group_size must be >= 2", "algo.advantage: grpo"),
                           overrides=("algo.group_size=1",)),
    "advantage-name": Case(("algo.advantage", "unknown advantage estimator 'rlo'", "did you mean 'rloo'",
                            "registered: dr_grpo, gae, grpo, reinforce_pp, rloo"), overrides=("algo.advantage=rlo",)),
    # an estimator that needs a critic, without one (the issue's pre-run check)
    "gae-without-critic": Case(("algo.advantage: gae needs a critic", "no stage writes 'values'", "pipelines/ppo.yaml"),
                               config={"preset": "ppo"}),
    "value-stage-not-colocated": Case(("stage 'value'", "set `colocate_with:` to the critic stage", "pipelines/ppo.yaml"),
                                      config={"preset": "ppo"}, edit_of=PPO,
                                      pipeline_edit={"value": {"colocate_with": None}}),
    "gae-advantage-without-returns": Case(("stage 'advantage'", "algo.advantage: gae", "['returns']",
                                           "pipelines/ppo.yaml"),
                                          config={"preset": "ppo"}, edit_of=PPO,
                                          pipeline_edit={"advantage": {"writes": ["advantage"]},
                                                         "critic": {"reads": ["prompt_ids", "response_ids", "values",
                                                                              "advantage"]}}),
    "critic-weight-decay-inf": Case(("algo.critic.weight_decay must be >= 0", "got inf"),
                                    overrides=("algo.critic.weight_decay=.inf",)),
    "critic-max-grad-norm": Case(("algo.critic.max_grad_norm must be > 0", "null for no clipping"),
                                 overrides=("algo.critic.max_grad_norm=0",)),
    "critic-value-clip": Case(("algo.critic.value_clip must be > 0", "null"),
                              config={"preset": "ppo", "pipeline": str(PPO)}, overrides=("algo.critic.value_clip=0",)),
    "advantage-module": Case(("algo.advantage", "no function 'nope'"), overrides=("algo.advantage=streamrl.algos:nope",)),
    "advantage-options": Case(("algo.advantage_options ['epsilon'] do not fit 'grpo'", "epsilon"),
                              overrides=("algo.advantage_options={epsilon: 0.1}",)),
    "policy-loss-name": Case(("algo.loss.policy_loss", "did you mean 'cispo'", "ppo_clip"),
                             overrides=("algo.loss.policy_loss=cipso",)),
    "policy-loss-signature": Case(("algo.loss.policy_loss", "streamrl.algos.kl:kl_penalty", "lacks the parameter"),
                                  overrides=("algo.loss.policy_loss=streamrl.algos.kl:kl_penalty",)),
    "preset-name": Case(("preset: unknown preset 'gspo2'", "did you mean 'gspo'", "cispo"), overrides=("preset=gspo2",)),
    "preset-chain": Case(("cannot name another preset",), config={"preset": "{tmp}/p.yaml"},
                         files={"p.yaml": "preset: grpo\n"}),
    "off-policy-uncorrected": Case(("algo.max_staleness > 0", "without a correction", "algo.loss.is_cap"),
                                   overrides=("algo.max_staleness=1", "algo.old_logprobs=recompute",
                                              "algo.loss.is_cap=null")),
    "kl-in-reward-reads": Case(("stage 'advantage'", "algo.loss.kl_in: reward", "['ref_logprobs', 'rollout_logprobs']",
                                "pipelines/grpo_kl_reward.yaml"),
                               config={"pipeline": str(GRPO_KL)}, overrides=("algo.loss.kl_coef=0.1", "algo.loss.kl_in=reward")),
    "overlong-buffer": Case(("algo.overlong_buffer must be an integer in [0, algo.max_new_tokens=4]", "got 5"),
                            overrides=("algo.overlong_buffer=5",)),
    "overlong-buffer-fraction": Case(("algo.overlong_buffer", "a float in (0, 1)", "got 1.5"),
                                     overrides=("algo.overlong_buffer=1.5",)),
    "dynamic-sampling-without-filter": Case(("algo.dynamic_sampling.enabled needs a stage that drops",
                                             "streamrl.stages.filter:FilterStage", "pipelines/dapo_rollout.yaml",
                                             "pipelines/dapo.yaml"),
                                            overrides=("preset=dapo",)),
    "filter-without-dynamic-sampling": Case(("stage 'filter'", "set algo.dynamic_sampling.enabled: true"),
                                            config={"pipeline": str(DAPO)}),
    "filter-not-whole-groups": Case(("stage 'filter'", "set whole_groups: true"),
                                    files={"dapo.yaml": _pipeline_with(DAPO, {"filter": {"whole_groups": False}})},
                                    config={"pipeline": "{tmp}/dapo.yaml",
                                            "algo": {"dynamic_sampling": {"enabled": True}}}),
    "dynamic-sampling-cap": Case(("algo.dynamic_sampling.max_rounds must be >= 0", "got -1"),
                                 overrides=("algo.dynamic_sampling.max_rounds=-1",)),
    "token-budget-negative": Case(("algo.dynamic_sampling.token_budget must be >= 0", "got -5"),
                                  overrides=("algo.dynamic_sampling.token_budget=-5",)),
    "token-budget-without-dynamic-sampling": Case(("algo.dynamic_sampling.token_budget needs "
                                                   "algo.dynamic_sampling.enabled: true", "token_budget: 0"),
                                                  overrides=("algo.dynamic_sampling.token_budget=100",
                                                             "algo.max_staleness=1")),
    "token-budget-synchronous": Case(("algo.dynamic_sampling.token_budget=100 needs algo.max_staleness >= 1",
                                      "set max_staleness: 1"),
                                     config={"pipeline": str(DAPO)},
                                     overrides=("preset=dapo", "algo.dynamic_sampling.token_budget=100")),
    "max-grad-norm-zero": Case(("algo.max_grad_norm must be > 0", "null for no clipping"),
                               overrides=("algo.max_grad_norm=0",)),
    "betas-out-of-range": Case(("algo.betas must both be in [0, 1)", "[0.9, 0.999]"),
                               overrides=("algo.betas=[0.9, 1.5]",)),
    "betas-wrong-length": Case(("algo.betas", "length 2", "[0.9, 0.999]"), overrides=("algo.betas=[0.9]",)),
    "kl-without-reference": Case(("algo.loss.kl_coef > 0", "'ref_logprobs'", "grpo_kl.yaml"),
                                 overrides=("algo.loss.kl_coef=0.1",)),
    # ---------------------------------------------------------------- resources and outputs
    "dock-capacity-below-a-step": Case(("resources.dock.capacity (32)", ">= algo.prompts_per_step * algo.group_size",
                                        "(64)"), overrides=("resources.dock.capacity=32",)),
    "dock-lease-ttl": Case(("resources.dock.lease_ttl_s must be >= 0.05",), overrides=("resources.dock.lease_ttl_s=0.01",)),
    "start-timeout": Case(("resources.start_timeout_s must be > 0",), overrides=("resources.start_timeout_s=-1",)),
    "device-unknown": Case(("resources.device", "'tpu'", "use 'auto', 'cpu'"), overrides=("resources.device=tpu",)),
    "ray-stage-resources": Case(("resources.ray.stage_resources names stages ['trian']", "its stages:"),
                                overrides=("resources.launch=ray", "resources.ray.stage_resources={trian: {GPU: 1}}")),
    "ray-dock-block": Case(("resources.ray.dock_block (4) must hold a group",),
                           overrides=("resources.ray.dock_block=4",)),
    "launch-value": Case(("resources.launch must be one of ['processes', 'inprocess', 'ray']", "got 'threads'"),
                         overrides=("resources.launch=threads",)),
    "run-dir-is-a-file": Case(("output.run_dir", "{tmp}/f", "is a file", "set output.run_dir to a directory"),
                              files={"f": "x"}, config={"output": {"run_dir": "{tmp}/f"}}),
    "run-dir-under-a-file": Case(("output.run_dir", "is under", "{tmp}/f", "which is a file"),
                                 files={"f": "x"}, config={"output": {"run_dir": "{tmp}/f/runs"}}),
    "output-name-with-slash": Case(("output.name 'a/b'", "plain file name"), config={"output": {"name": "a/b"}}),
    # ---------------------------------------------------------------- overrides and the config file
    "override-without-value": Case(("override 'algo.lr'", "KEY=VALUE", "algo.lr=3e-4"), overrides=("algo.lr",)),
    "override-empty-key-part": Case(("override 'algo..lr=1'", "dotted names"), overrides=("algo..lr=1",)),
    "override-value-not-yaml": Case(("override 'algo.betas=[0.9,'", "not valid YAML", "line 1", "quote it"),
                                    overrides=("algo.betas=[0.9,",)),
    "override-unknown-key": Case(("unknown key 'algo.lrr'", "did you mean 'lr'"), overrides=("algo.lrr=1",)),
    "config-yaml-error-line": Case(("{tmp}/c.yaml", "not valid YAML", "line 3"),
                                   files={"c.yaml": "algo:\n  steps: 3\n lr: 1e-3\n"}, source="c.yaml"),
    "config-not-a-mapping": Case(("{tmp}/c.yaml", "top level must be a mapping", "got a list"),
                                 files={"c.yaml": "- algo\n- steps\n"}, source="c.yaml"),
    "config-nested-unknown-key": Case(("{tmp}/c.yaml", "unknown key 'algo.loss.kl_coeff'", "did you mean 'kl_coef'"),
                                      files={"c.yaml": "algo:\n  loss: {kl_coeff: 0.1}\n"}, source="c.yaml"),
    # ---------------------------------------------------------------- pipeline files
    "pipeline-missing": Case(("pipeline '{tmp}/absent.yaml'", "no such file", "pipelines/grpo.yaml"),
                             config={"pipeline": "{tmp}/absent.yaml"}),
    "pipeline-not-yaml": Case(("{tmp}/p.yaml", "not valid YAML", "line 3"),
                              files={"p.yaml": "name: x\nstages: [\n"}, config={"pipeline": "{tmp}/p.yaml"}),
    "pipeline-not-a-mapping": Case(("{tmp}/p.yaml", "mapping with `name:` and `stages:`", "got a list"),
                                   files={"p.yaml": "- source\n- train\n"}, config={"pipeline": "{tmp}/p.yaml"}),
    "pipeline-unknown-top-level-key": Case(("{tmp}/p.yaml", "unknown top-level field 'stagez'",
                                            "did you mean 'stages'"),
                                           files={"p.yaml": GRPO.read_text().replace("stages:", "stagez:", 1)},
                                           config={"pipeline": "{tmp}/p.yaml"}),
    "pipeline-without-name": Case(("{tmp}/p.yaml", "required field 'name' is missing", "name: my_pipeline"),
                                  files={"p.yaml": GRPO.read_text().replace("name: grpo\n", "", 1)},
                                  config={"pipeline": "{tmp}/p.yaml"}),
    "stage-unknown-field": Case(("stage 'score'", "unknown field 'worker'", "did you mean 'workers'"),
                                pipeline_edit={"score": {"worker": 2}}),
    "stage-override-unknown-stage": Case(("stages.scorer", "does not have", "'score'"),
                                         overrides=("stages.scorer.workers=2",)),
    "stage-option-for-a-stage-without-options": Case(("stage 'advantage' options", "unknown option 'tensor_parallel'",
                                                      "AdvantageStage takes no options"),
                                                     overrides=("stages.advantage.options={tensor_parallel: 2}",)),
    "generate-writes-more": Case(("stage 'generate' writes ['response_ids', 'rollout_logprobs', 'texts']",
                                  "the generate stage writes ['response_ids', 'rollout_logprobs'], no more"),
                                 pipeline_edit={"generate": {"writes": ["response_ids", "rollout_logprobs", "texts"]}}),
    "generate-engine-unknown": Case(("stage 'generate' options.engine", "'vllm2'"),
                                    overrides=("stages.generate.options.engine=vllm2",)),
    "stage-option-misspelt": Case(("stage 'source' options", "unknown option 'gate_on_polcy'",
                                   "did you mean 'gate_on_policy'"),
                                  pipeline_edit={"source": {"options": {"gate_on_polcy": False}}}),
    "stage-option-wrong-type": Case(("stage 'source' options.gate_on_policy", "expected `bool`", "'sometimes'"),
                                    pipeline_edit={"source": {"options": {"gate_on_policy": "sometimes"}}}),
    "advantage-without-whole-groups": Case(("stage 'advantage'", "set whole_groups: true"),
                                           pipeline_edit={"advantage": {"whole_groups": False}}),
    "train-whole-groups-split": Case(("stage 'train'", "micro_batch=12", "multiples of algo.group_size=8",
                                      "set whole_groups: false"),
                                     pipeline_edit={"train": {"whole_groups": True, "micro_batch": 12}}),
    "train-step-split": Case(("stage 'train'", "9 samples per step", "divide evenly over its workers=2"),
                             config={"algo": {"prompts_per_step": 3, "group_size": 3}},
                             overrides=("stages.train.workers=2",)),
    "train-tp-vs-workers": Case(("stage 'train'", "options.tensor_parallel=2 must divide workers=3"),
                                overrides=("stages.train.workers=3", "stages.train.options={tensor_parallel: 2}")),
    "disaggregated-train-tp": Case(("stage 'train'", "options.tensor_parallel=2", "not disaggregated"),
                                   config={"pipeline": str(DISAGGREGATED)},
                                   overrides=("stages.train.options={tensor_parallel: 2}",)),
    "train-tp-zero": Case(("stage 'train' options.tensor_parallel must be >= 1",),
                          overrides=("stages.train.options={tensor_parallel: 0}",)),
    "train-mmap-threshold": Case(("stage 'train' options.mmap_threshold_bytes must be in 1..33554432", "or null"),
                                 overrides=("stages.train.options={mmap_threshold_bytes: 67108864}",)),
    "train-workers-inprocess": Case(("stage 'train'", "workers=2", "resources.launch: processes"),
                                    config={"resources": {"launch": "inprocess"}},
                                    overrides=("stages.train.workers=2",)),
    "colocated-step-split": Case(("stage 'train'", "9 samples per step", "divide evenly over its workers=2"),
                                 config={"pipeline": str(COLOCATED), "algo": {"prompts_per_step": 3,
                                                                              "group_size": 3}}),
    "colocated-workers-mismatch": Case(("stage 'generate' colocate_with", "workers=1", "'train' has workers=2"),
                                       config={"pipeline": str(COLOCATED)}, overrides=("stages.generate.workers=1",)),
    "colocated-bucket-bytes": Case(("stage 'train' options.bucket_bytes must be >= 1",),
                                   config={"pipeline": str(COLOCATED)},
                                   overrides=("stages.train.options={bucket_bytes: 0}",)),
    "colocated-nccl-on-cpu": Case(("stage 'train' options.backend", "'nccl' needs cuda", "backend: gloo"),
                                  config={"pipeline": str(COLOCATED)}, overrides=("stages.train.options={backend: nccl}",)),
    "colocated-tp-vs-heads": Case(("stage 'generate' options.tensor_parallel=2", "num_attention_heads=1",
                                   "model.tiny", "pick a T"),
                                  config={"pipeline": str(COLOCATED), "model": {"tiny": {"heads": 1, "hidden": 32}}},
                                  overrides=("stages.generate.options={tensor_parallel: 2}",)),
    "colocated-inprocess": Case(("placement 'colocated'", "resources.launch: processes"),
                                config={"pipeline": str(COLOCATED), "resources": {"launch": "inprocess"}}),
    "score-endpoint-wildcard": Case(("stage 'score' options.endpoints[0] 'tcp://*:5555'", "tcp://HOST:PORT",
                                     "tcp://127.0.0.1:5555"),
                                    overrides=("stages.score.options={backend: zmq, endpoints: ['tcp://*:5555']}",)),
    "score-endpoint-port": Case(("options.endpoints[1]", "port 70000", "1..65535"),
                                overrides=("stages.score.options={backend: zmq, endpoints: "
                                           "['tcp://127.0.0.1:5555', 'tcp://127.0.0.1:70000']}",)),
    "score-endpoint-scheme": Case(("options.endpoints[0] 'http://127.0.0.1:5555'", "must start with tcp:// or ipc://"),
                                  overrides=("stages.score.options={backend: zmq, endpoints: "
                                             "['http://127.0.0.1:5555']}",)),
    "score-zmq-without-endpoints": Case(("stage 'score' options", "backend zmq needs options.endpoints"),
                                        overrides=("stages.score.options={backend: zmq}",)),
    "score-reward-not-importable": Case(("stage 'score' options.reward", "no_such_module_srl", "cannot import"),
                                        overrides=("stages.score.options={reward: 'no_such_module_srl:fn'}",)),
    # ---------------------------------------------------------------- the agent stage
    "agent-without-rollout": Case(("stage 'agent'", "options.rollout is required", "'module:function'"),
                                  config=_agent({})),
    "agent-rollout-not-async": Case(("options.rollout 'streamrl.tasks.calculator:calculator' must be an async function",),
                                    config=_agent({"rollout": "streamrl.tasks.calculator:calculator"})),
    "agent-rollout-args": Case(("options.rollout_args {'turn': 4} do not fit", "unexpected keyword argument 'turn'"),
                               config=_agent({"rollout": "streamrl.tasks.calculator:solve", "rollout_args": {"turn": 4}})),
    "agent-drop-without-dynamic-sampling": Case(
        ("stage 'agent'", "options.lost_sessions: drop", "algo.dynamic_sampling.enabled: true"),
        config=_agent({"rollout": "streamrl.tasks.calculator:solve", "lost_sessions": "drop"})),
    "agent-tool-parser": Case(("stage 'agent'", "'hermez'"),
                              config=_agent({"rollout": "streamrl.tasks.calculator:solve", "tool_parser": "hermez"})),
    "agent-writes-unknown": Case(("stage 'agent'", "it cannot write ['values']"),
                                 config=_agent({"rollout": "streamrl.tasks.calculator:solve"}), edit_of=AGENT,
                                 pipeline_edit={"agent": {"writes": ["prompt_ids", "response_ids", "rollout_logprobs",
                                                                     "loss_mask", "reward", "values"]}}),
    "source-writes-unknown": Case(("stage 'source' writes ['sample_id']", "which the source does not make"),
                                  pipeline_edit={"source": {"writes": ["prompt_ids", "prompt", "answer", "step",
                                                                       "sample_key", "sample_id"]}}),
    # ---------------------------------------------------------------- prompt files (jsonl task)
    "jsonl-without-path": Case(("task.options", "task 'jsonl'", "'path'"),
                               config={"task": {"name": "jsonl", "options": {"reward": "digits-reverse"}}}),
    "jsonl-file-missing": Case(("task.options.path", "{tmp}/p.jsonl", "does not exist"), config=_jsonl("")),
    "jsonl-reward-unknown": Case(("task.options", "reward", "did you mean 'digits-reverse'", "'module:function'"),
                                 files={"p.jsonl": _rows(GOOD_ROW)}, config=_jsonl("", reward="digits-revers")),
    "jsonl-empty": Case(("task.options.path", "{tmp}/p.jsonl", "has no rows"), files={"p.jsonl": "\n\n"},
                        config=_jsonl("")),
    "row-invalid-json": Case(("{tmp}/p.jsonl, line 2", "not valid JSON", "one JSON object"),
                             files={"p.jsonl": _rows(GOOD_ROW, '{"prompt": "1=", "answer": "1"')}, config=_jsonl("")),
    "row-not-an-object": Case(("{tmp}/p.jsonl, line 4", "must be a JSON object, got list", '{"prompt": "..."'),
                              files={"p.jsonl": _rows(GOOD_ROW, GOOD_ROW, "", ["1=", "1"])}, config=_jsonl("")),
    "row-without-prompt": Case(("{tmp}/p.jsonl, line 1", "field 'prompt' is missing"),
                               files={"p.jsonl": _rows({"answer": "1"})}, config=_jsonl("")),
    "row-prompt-not-a-string": Case(("{tmp}/p.jsonl, line 2", "'prompt' must be a non-empty string", "got int 12"),
                                    files={"p.jsonl": _rows(GOOD_ROW, {"prompt": 12, "answer": "21"})},
                                    config=_jsonl("")),
    "row-answer-not-a-string": Case(("{tmp}/p.jsonl, line 2", "'answer' must be a string, got int", 'e.g. "21"'),
                                    files={"p.jsonl": _rows(GOOD_ROW, {"prompt": "12=", "answer": 21})},
                                    config=_jsonl("")),
    "row-reserved-field": Case(("{tmp}/p.jsonl, line 1", "'response' is reserved", "rename it"),
                               files={"p.jsonl": _rows({**GOOD_ROW, "response": "x"})}, config=_jsonl("")),
    "row-unknown-characters": Case(("{tmp}/p.jsonl, line 2", "' ehlo'", "model.extra_chars: ' ehlo'"),
                                   files={"p.jsonl": _rows(GOOD_ROW, {"prompt": "hello 1=", "answer": "1"})},
                                   config=_jsonl("")),
    "row-with-a-line-break": Case(("{tmp}/p.jsonl, line 1", "line break", "remove it from the prompt"),
                                  files={"p.jsonl": _rows({"prompt": "1\n2=", "answer": "21"})}, config=_jsonl("")),
    "row-beyond-the-models-positions": Case(("{tmp}/p.jsonl, line 2", "10 tokens", "14 > the model's 12 positions",
                                             "max_position_embeddings", "lower algo.max_new_tokens to 2 or less"),
                                            files={"p.jsonl": _rows(GOOD_ROW, {"prompt": "123456789=", "answer": "1"})},
                                            config=_merge(_jsonl(""), {"model": {"path": "{model}"}})),
    "row-beyond-positions": Case(("{tmp}/p.jsonl, line 2", "62 tokens", "66 > the model's 64 positions",
                                  "lower algo.max_new_tokens to 2 or less"),
                                 files={"p.jsonl": _rows(GOOD_ROW, {"prompt": "1" * 61 + "=", "answer": "1"})},
                                 config=_jsonl("")),
    "row-not-utf8": Case(("{tmp}/p.jsonl", "not UTF-8", "save it as UTF-8"),
                         files={"p.jsonl": b'{"prompt": "\xff\xfe", "answer": "1"}\n'}, config=_jsonl("")),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny save_pretrained directory (weights, tokenizer) advertising 12 positions."""
    from streamrl.models.build import TinyModelSpec, build_model, save_pretrained_dir
    from streamrl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_model(TinyModelSpec(hidden=16, layers=1, heads=2, intermediate=32, max_positions=12), tok)
    return save_pretrained_dir(model, tok, tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module", autouse=True)
def _imports_done() -> None:
    """What validation imports lazily, imported once up front: the 2 s budget is for the checks,
    not for a first import of transformers' tokenizer classes or the reshard stages."""
    import huggingface_hub  # noqa: F401
    import transformers  # noqa: F401

    import streamrl.rewards.function
    import streamrl.stages.colocated  # noqa: F401


def _prepare(case: Case, tmp: Path, model: Path) -> tuple[Any, list[str], list[str]]:
    subs = {"tmp": str(tmp), "model": str(model)}
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(_fill(content, subs))
    source: Any
    if case.source is not None:
        source = tmp / case.source
    else:
        source = _merge(_base(tmp), _fill(case.config, subs))
        if case.pipeline_edit is not None:
            edited = tmp / "edited.yaml"
            edited.write_text(_pipeline_with(case.edit_of, case.pipeline_edit))
            source["pipeline"] = str(edited)
    return source, list(case.overrides), [_fill(n, subs) for n in case.needles]


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_specific_error_before_anything_starts(name: str, tmp_path: Path, model_dir: Path) -> None:
    source, overrides, needles = _prepare(CASES[name], tmp_path, model_dir)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        load_pipeline(load_config(source, overrides))
    elapsed = time.perf_counter() - t0
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert "$." not in message and "Traceback" not in message
    assert elapsed < VALIDATION_BUDGET_S, f"validation took {elapsed:.2f} s"
    assert not (tmp_path / "runs").exists()  # nothing was started, no run dir was made


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 30


def test_the_good_variants_pass(tmp_path: Path, model_dir: Path) -> None:
    """The same inputs, fixed, validate: the checks refuse the fault, not the feature."""
    (tmp_path / "p.jsonl").write_text(_rows(GOOD_ROW, {"prompt": "hello 1=", "answer": "1", "level": 2}))
    good = [
        ({"model": {"path": str(model_dir)}, "algo": {"max_new_tokens": 6}}, []),
        ({"task": {"name": "digits-reverse", "options": {"max_digits": 59}}}, []),
        (_fill(_jsonl(""), {"tmp": str(tmp_path)}), ["model.extra_chars=' ehlo'"]),
        ({"pipeline": str(GRPO_KL)}, ["algo.loss.kl_coef=0.1"]),
        ({"pipeline": str(REPO / "pipelines" / "grpo_kl_reward.yaml")}, ["algo.loss.kl_coef=0.1", "algo.loss.kl_in=reward"]),
        ({"preset": "gspo"}, ["algo.advantage=rloo"]),
        ({"preset": "ppo", "pipeline": str(PPO)}, []),
        (_agent({"rollout": "streamrl.tasks.calculator:solve", "rollout_args": {"turns": 2}}), []),
        ({"preset": "ppo", "pipeline": str(PPO)}, ["output.checkpoint_every=5"]),
        ({}, ["algo.max_staleness=1", "algo.old_logprobs=recompute"]),
        ({}, ["stages.train.options={mmap_threshold_bytes: 1048576}"]),
        ({"pipeline": str(COLOCATED)}, ["stages.train.options={backend: gloo, bucket_bytes: 1024}"]),
        ({}, ["stages.score.options={backend: zmq, endpoints: ['tcp://127.0.0.1:5555', 'ipc:///tmp/r.sock', "
              "'tcp://[::1]:6000']}"]),
    ]
    for config, overrides in good:
        t0 = time.perf_counter()
        load_pipeline(load_config(_merge(_base(tmp_path), config), overrides))
        assert time.perf_counter() - t0 < VALIDATION_BUDGET_S


def test_a_large_prompt_file_is_checked_up_to_a_bound_and_the_rest_at_load(tmp_path: Path) -> None:
    """Validation reads a big file only up to CHECK_ROWS rows; a bad row beyond them is reported by
    the source stage's loader with the same file + line message."""
    from streamrl.tasks import PromptDatasetError, check_prompts_jsonl, load_prompts_jsonl

    path = tmp_path / "big.jsonl"
    path.write_text(_rows(*([GOOD_ROW] * 50), {"prompt": 3, "answer": "1"}))
    rows, whole = check_prompts_jsonl(path, max_bytes=100, max_rows=10)
    assert len(rows) == 10 and not whole and rows[-1][0] == 10
    with pytest.raises(PromptDatasetError, match=r"big\.jsonl, line 51: field 'prompt' must be a non-empty string"):
        load_prompts_jsonl(path)
    cfg = load_config(_merge(_base(tmp_path), {"task": {"name": "jsonl", "options": {
        "path": str(path), "reward": "digits-reverse"}}}))
    with pytest.raises(ConfigError, match="line 51"):  # small enough: validation reads all of it
        load_pipeline(cfg)


def test_the_python_api_refuses_a_bad_config_before_starting(tmp_path: Path) -> None:
    cfg = _merge(_base(tmp_path), {"task": {"name": "digit-max"}})
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"task\.name"):
        streamrl.run(cfg)
    assert time.perf_counter() - t0 < VALIDATION_BUDGET_S
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- the real command line


def _cli(args: list[str], cwd: Path, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize(
    ("files", "args", "needles"),
    [
        pytest.param({"c.yaml": f"pipeline: {GRPO}\ntask: {{name: digit-max}}\n"}, ["c.yaml"],
                     ["task.name", "did you mean 'digits-max'"], id="unknown-task"),
        pytest.param({"c.yaml": "algo:\n  steps: 3\n lr: 1e-3\n"}, ["c.yaml"],
                     ["c.yaml", "not valid YAML", "line 3"], id="yaml-error"),
        pytest.param({"c.yaml": f"pipeline: {GRPO}\ntask: {{name: jsonl, options: {{path: p.jsonl, "
                                "reward: digits-reverse}}\n",
                      "p.jsonl": _rows(GOOD_ROW, {"prompt": "1=", "answer": 1})}, ["c.yaml"],
                     ["p.jsonl, line 2", "'answer' must be a string"], id="dataset-row"),
        pytest.param({"c.yaml": f"pipeline: {GRPO}\n"}, ["c.yaml", "model.path=/nonexistent"],
                     ["model.path '/nonexistent'", "no such directory"], id="model-path-override"),
    ],
)
def test_validate_on_the_command_line_exits_2(tmp_path: Path, files: dict[str, str], args: list[str],
                                               needles: list[str]) -> None:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    proc = _cli(["validate", *args], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("streamrl: config error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


# Runs `streamrl run` in this interpreter with an audit hook that records every process start and
# directory creation, and times main() alone (the imports come first, as in any real start).
_AUDITED_RUN = textwrap.dedent("""
    import json, sys, time
    events, watching = [], []
    WATCH = ("subprocess.Popen", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec",
             "os.system", "tempfile.mkdtemp", "os.mkdir")

    def hook(event, args):
        if watching and event in WATCH:
            events.append([event, repr(args)[:300]])

    sys.addaudithook(hook)
    import importlib.util
    import streamrl.cli, streamrl.runtime.launcher, streamrl.runtime.pipeline, streamrl.rewards.cli
    import streamrl.models.build, streamrl.stages.source, streamrl.stages.train  # imported on first use
    import transformers, huggingface_hub
    if importlib.util.find_spec("trio"):  # its import probes libc with `ldconfig -p`: not a start of ours
        import trio
    watching.append(True)  # from here on: what `streamrl run` itself does
    t0 = time.perf_counter()
    try:
        code = streamrl.cli.main(sys.argv[2:])
    finally:
        elapsed = time.perf_counter() - t0
        import multiprocessing, os
        multiprocessing.active_children()  # (joins any that ended)
        children = [c for t in os.listdir(f"/proc/{os.getpid()}/task")  # every child still there, any kind
                    for c in open(f"/proc/{os.getpid()}/task/{t}/children").read().split()]
        cmdlines = [open(f"/proc/{c}/cmdline").read().replace("\\0", " ")[:200] for c in children]
        with open(sys.argv[1], "w") as f:
            json.dump({"elapsed_s": elapsed, "events": events, "children": cmdlines,
                       # multiprocessing's temporary directory: the forkserver's socket's
                       "mp_tempdir": multiprocessing.process.current_process()._config.get("tempdir")}, f)
    sys.exit(code)
""")


def test_run_on_a_bad_config_exits_2_and_starts_nothing(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"pipeline: {GRPO}\noutput: {{run_dir: {tmp_path / 'runs'}, progress: none}}\n"
                      "algo: {max_new_tokens: 61}\n")
    report = tmp_path / "audit.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _AUDITED_RUN, str(report), "run", str(config)],
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr
    assert "streamrl: config error:" in proc.stderr and "algo.max_new_tokens=61" in proc.stderr
    assert "Traceback" not in proc.stderr
    audit = json.loads(report.read_text())
    # `streamrl run` starts the workers' forkserver while it checks the pipeline (its imports overlap
    # the checks); a failed check stops it again: no process left, its socket dir removed
    # (streamrl.runtime.forkserver.use_private_temp_dir: a /tmp/srl-* dir of the launcher's)
    mp_tempdir = audit["mp_tempdir"]
    forkserver_dirs = [e for e in audit["events"] if e[0] == "tempfile.mkdtemp" and mp_tempdir and mp_tempdir in e[1]]
    assert forkserver_dirs and all(not Path(e[1].split("'")[1]).exists() for e in forkserver_dirs), forkserver_dirs
    assert audit["children"] == [], audit["children"]  # no process started by the failed run is left
    started = [e for e in audit["events"] if e[0] != "os.mkdir" and e not in forkserver_dirs]
    assert started == [], started  # no worker, dock server or /tmp/srl-* control dir was made
    made = [e for e in audit["events"] if e[0] == "os.mkdir" and mp_tempdir not in e[1]]  # (the forkserver's: above)
    assert made == [], made
    assert not (tmp_path / "runs").exists()  # no run dir, so no worker logs
    assert audit["elapsed_s"] < VALIDATION_BUDGET_S, audit["elapsed_s"]
    assert wall < CLI_TIMEOUT_S
