"""The run as a whole, checked before anything starts: the pre-run checks that need the model,
its tokenizer and the task, on top of the pipeline file's own checks
(:func:`streamrl.runtime.pipeline.validate_pipeline`, which also runs each stage class's
``check_spec``).

:func:`load_pipeline` is where ``streamrl validate``, ``streamrl run`` and ``streamrl.run`` begin:
the pipeline file with the run config's overrides (plus the eval stage ``eval.every > 0`` adds),
validated, then :func:`check_run`: Ray and its per-stage resources, the model directory and its
tokenizer, the model's sharding vs the generate stage's tensor_parallel, the task and its options,
a JSONL prompt file's rows (bounded: see ``streamrl.tasks.dataset``), and prompt +
``algo.max_new_tokens`` vs the model's positions. Every error is a ``ConfigError`` naming the
file, the stage or dotted key, or the row, and what to change.

Which stages use the run's model and task, and which generate, their classes say
(``uses_model_and_task``, ``generates``); a pipeline of a user's own stages only leaves the model
and the task to them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from streamrl.config import (
    AUTO_PIPELINE,
    STREAMING_PIPELINE,
    SYNC_PIPELINE,
    ConfigError,
    ConfigErrors,
    ConfigProblem,
    RunConfig,
    resolve_model_dir,
    task_options,
)
from streamrl.runtime.pipeline import (
    PipelineSpec,
    class_says,
    import_stage_class,
    inference_tensor_parallel,
    read_pipeline,
    validate_pipeline,
)

log = logging.getLogger("streamrl.pipeline")


def load_pipeline(cfg: RunConfig) -> PipelineSpec:
    """The run's pipeline (``auto``: the one :func:`choose_pipeline` picks) with its per-stage overrides
    applied, validated, and the whole run checked (:func:`check_run`): everything that can be known
    before a process starts."""
    cfg = choose_pipeline(cfg)
    spec = _validated_pipeline(cfg)
    check_run(spec, cfg)
    return spec


def _validated_pipeline(cfg: RunConfig) -> PipelineSpec:
    """The pipeline file with the config's overrides (and the eval stage), validated."""
    if cfg.eval.every > 0:
        from streamrl.stages.evaluate import EVAL_STAGE_NAME, add_eval_stage

        spec = read_pipeline(cfg, also_overridable=(EVAL_STAGE_NAME,))
        add_eval_stage(spec, cfg)
    else:
        spec = read_pipeline(cfg)
    validate_pipeline(spec, cfg)
    return spec


def choose_pipeline(cfg: RunConfig) -> RunConfig:
    """The config with ``pipeline: auto`` replaced by the file it stands for (any other value as is).

    At ``algo.max_staleness`` 0 nothing can run ahead: every hand-over between a generator's process
    and the trainer's is on the step's path, the weights' install and the samples' hop among them.
    So a synchronous run on a CPU host gets :data:`SYNC_PIPELINE`, where the train stage generates,
    scores and trains in one process, wherever that pipeline's checks pass (one train worker, the
    built-in engine, no dynamic sampling, overrides that name its stages); anything else gets
    :data:`STREAMING_PIPELINE`. Accelerators and Ray keep the streaming one: each generator may have
    a device or a node of its own there. The log says which and why."""
    if cfg.pipeline != AUTO_PIPELINE:
        return cfg
    sync = msgspec.structs.replace(cfg, pipeline=SYNC_PIPELINE)
    if cfg.algo.max_staleness != 0:
        why = f"algo.max_staleness {cfg.algo.max_staleness}: generation runs ahead in a stage of its own"
    elif cfg.resources.device != "cpu" or cfg.resources.launch == "ray":
        why = (f"resources.device {cfg.resources.device}, resources.launch {cfg.resources.launch}: "
               "generation may have a device or node of its own")
    else:
        try:
            _validated_pipeline(sync)
        except ConfigError as exc:
            why = f"{SYNC_PIPELINE} does not fit: {exc}"
        else:
            log.info("pipeline auto: %s (algo.max_staleness 0 on a CPU host: one process a step)", SYNC_PIPELINE)
            return sync
    log.info("pipeline auto: %s (%s)", STREAMING_PIPELINE, why)
    return msgspec.structs.replace(cfg, pipeline=STREAMING_PIPELINE)


def pipeline_from_path(path: str | Path, cfg: RunConfig) -> PipelineSpec:
    """Load a pipeline from an explicit path (for tests and `streamrl validate`)."""
    return load_pipeline(msgspec.structs.replace(cfg, pipeline=str(path)))


def resolve_run_length(cfg: RunConfig) -> RunConfig:
    """The config with its run length final: ``algo.epochs`` turned into ``algo.steps`` from the
    task's train split (ceil(epochs x rows / prompts_per_step)), and the checks that need it
    (the lr schedule's length). The launcher calls it before anything starts."""

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
    from streamrl.tasks.registry import TaskOptionError, UnknownTaskError, get_task

    try:
        return get_task(cfg.task.name, **task_options(cfg))
    except (UnknownTaskError, TaskOptionError, ValueError, TypeError) as exc:
        raise ConfigError(f"run config: task: {exc}") from None


# ------------------------------------------------------------------ the whole run, before it starts

def check_run(spec: PipelineSpec, cfg: RunConfig) -> None:
    """What the stages would find out only in their workers, found before any process starts:
    Ray, the task and its options or prompt file, the model directory, the model's sharding, and
    that prompt + completion fit the model's positions. (Each stage's own rules, its batching and
    reshard world among them, its class's ``check_spec`` checked in ``validate_pipeline``.)"""
    where = spec.where
    problems: list[str] = []  # the independent checks all run; every problem is reported at once

    def attempt(check: Callable[..., Any], *args: Any) -> Any:
        try:
            return check(*args)
        except ConfigError as exc:
            problems.append(str(exc))
            return None

    if cfg.resources.launch == "ray":
        attempt(_check_ray, spec, cfg)
    classes = [(import_stage_class(s.cls), s) for s in spec.stages]
    if any(class_says(c, "uses_model_and_task", s) for c, s in classes):  # else: the model and task are the user's
        model = attempt(_check_model, cfg)
        generates = any(class_says(c, "generates", s) for c, s in classes)
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
