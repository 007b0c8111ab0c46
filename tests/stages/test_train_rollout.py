"""The train stage that makes its own samples (``options.rollout``, pipelines/grpo_sync.yaml): its
rules checked before anything starts. Its run takes the steps of the default pipeline's
(tests/stages/test_chain.py::test_a_chained_grpo_run_takes_the_steps_of_the_unchained_one)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.runtime.pipeline import PipelineSpec, class_says
from streamrl.runtime.prerun import load_pipeline
from streamrl.stages.common import source_runs_ahead
from streamrl.stages.train import TrainStage, rollout_spec
from tests.stages.test_chain import _load as load_with

REPO = Path(__file__).resolve().parents[2]
SYNC = yaml.safe_load((REPO / "pipelines" / "grpo_sync.yaml").read_text())


def _load(tmp_path: Path, mutate: Any = None, overrides: list[str] | None = None) -> PipelineSpec:
    return load_with(tmp_path, mutate, overrides, base=SYNC)


def _train(p: dict[str, Any]) -> dict[str, Any]:
    return next(s for s in p["stages"] if s["name"] == "train")


def test_the_shipped_sync_pipeline_is_valid_and_its_source_runs_ahead() -> None:
    cfg = load_config({"pipeline": str(REPO / "pipelines" / "grpo_sync.yaml")})
    spec = load_pipeline(cfg)
    assert [s.name for s in spec.stages] == ["source", "train"]
    train = spec.stage("train")
    assert class_says(TrainStage, "generates", train)  # the pre-run checks fit prompt + completion
    assert class_says(TrainStage, "claims_one_step", train)
    assert source_runs_ahead(cfg, spec)  # a step's prompts wait in the dock while the step before trains
    chain = rollout_spec(train)
    assert chain is not None
    assert chain.reads == ["prompt_ids", "step", "sample_key", "prompt", "answer"]
    assert chain.writes == ["response_ids", "rollout_logprobs", "reward", "advantage"]
    assert chain.whole_groups and chain.micro_batch == train.micro_batch
    # the other pipelines' train stage generates nothing
    plain = load_pipeline(load_config({"pipeline": str(REPO / "pipelines" / "grpo_rollout.yaml")})).stage("train")
    assert rollout_spec(plain) is None and not class_says(TrainStage, "generates", plain)


def _set(key: str, value: Any) -> Any:
    def mutate(p: dict[str, Any]) -> None:
        _train(p)[key] = value
    return mutate


def _link(k: int, key: str, value: Any) -> Any:
    def mutate(p: dict[str, Any]) -> None:
        _train(p)["options"]["rollout"]["links"][k][key] = value
    return mutate


class NoteStage:
    """A stage that writes a note per prompt: something to colocate with the train stage."""

    async def setup(self, ctx: Any) -> None: ...

    async def process(self, batch: Any) -> dict[str, list[Any]]:
        return {"note": [None] * len(batch.samples)}

    async def close(self) -> None: ...


def _colocated(p: dict[str, Any]) -> None:
    p["placement"] = "colocated"
    p["stages"].insert(1, {"name": "note", "class": f"{__name__}:NoteStage", "colocate_with": "train",
                           "reads": ["prompt"], "writes": ["note"]})


def _drop_advantage(p: dict[str, Any]) -> None:
    _train(p)["options"]["rollout"]["links"].pop()


def _second_generator(p: dict[str, Any]) -> None:
    _train(p)["options"]["rollout"]["links"].insert(1, {
        "name": "again", "class": "streamrl.stages.generate:GenerateStage", "reads": ["prompt_ids", "step"],
        "writes": ["more_ids", "more_logprobs"]})


@pytest.mark.parametrize(("mutate", "overrides", "expected"), [
    (_set("workers", 2), [], "options.rollout: trains and generates in one process: workers must be 1"),
    (None, ["algo.max_staleness=1"], "synchronous only: algo.max_staleness must be 0 (it is 1)"),
    # the pipeline's own rule first: no filter between generation and training
    (None, ["algo.dynamic_sampling.enabled=true"], "algo.dynamic_sampling.enabled needs a stage that drops"),
    (_link(0, "options", {"engine": "vllm"}), [], "options.rollout.links[0].options.engine: the link generates on "
                                                  "the module this stage trains, with the built-in engine"),
    (_colocated, [], "the pipeline's placement must be separate (it says 'colocated')"),
    (_second_generator, [], "options.rollout.links: exactly one link must generate"),
    # the stage's reads are dock columns: what its links write is not one
    (_set("reads", ["prompt_ids", "step", "sample_key", "prompt", "answer", "reward"]), [],
     "stage 'train' reads 'reward' but no stage writes it"),
    (_drop_advantage, [], "training needs 'advantage', which neither the stage reads nor a link writes"),
    (_set("whole_groups", False), [], "the advantage stage normalises rewards within a group"),
    (_link(1, "class", "streamrl.stages.nope:Score"), [], "options.links[1] ('score').class: class "),
])
def test_a_train_stage_with_a_rollout_is_checked_before_anything_starts(
        tmp_path: Path, mutate: Any, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, mutate, overrides)
    message = str(info.value)
    pipeline_rule = "dynamic_sampling" in expected or "no stage writes" in expected  # checked before the stages
    at = "pipe.yaml: " if pipeline_rule else "pipe.yaml: stage 'train' options.rollout"
    assert at in message, message
    assert expected in message, message


def test_a_run_config_sets_a_rollout_links_options_by_its_name(tmp_path: Path) -> None:
    """``stages.score.options`` reaches the score link of the train stage's rollout, as it would the
    score stage of pipelines/grpo.yaml; its other settings are the train stage's."""
    spec = _load(tmp_path, overrides=["stages.score.options={on_sample_error: default, default_score: 0.5}"])
    links = spec.stage("train").options["rollout"]["links"]
    assert links[1]["name"] == "score"
    assert links[1]["options"] == {"on_sample_error": "default", "default_score": 0.5}
    assert "options" not in links[0] and "options" not in links[2]
    with pytest.raises(ConfigError, match=r"stages.score sets \['workers'\] of link 'score', which runs inside the "
                                          r"rollout of stage 'train'"):
        _load(tmp_path, overrides=["stages.score.workers=2"])
    with pytest.raises(ConfigError, match=r"options.links\[1\] \('score'\) options: score stage: unknown options"):
        _load(tmp_path, _link(1, "options", {"bakend": "zmq"}))


@pytest.mark.timeout(300)
def test_a_bfloat16_sync_run_takes_the_steps_of_the_default_pipeline(tmp_path: Path) -> None:
    """model.dtype bfloat16: the train stage trains unwrapped on its float32 weights cast per forward
    and generates on a bfloat16 copy installed after each step, the cast the default pipeline's
    generator installs; every step's reward and loss are the default pipeline's."""
    runs = [streamrl.run(REPO / "configs" / "grpo_digits.yaml", [
        f"output.run_dir={tmp_path / pipeline}", "output.progress=none", "output.tensorboard=false",
        "output.plot=false", "algo.steps=4", "algo.stop_reward=null", "model.dtype=bfloat16",
        f"pipeline={REPO / 'pipelines' / pipeline}"]) for pipeline in ("grpo_rollout.yaml", "grpo_sync.yaml")]
    default, sync = runs
    assert default.steps == sync.steps == 4
    for a, b in zip(default.metrics, sync.metrics, strict=True):
        assert (a["step"], a["reward_mean"], a["loss"]) == (b["step"], b["reward_mean"], b["loss"])
    for run in runs:
        assert "one rank in bfloat16 over float32 weights, the module unwrapped" in (
            run.run_dir / "logs" / "train-0.log").read_text()


def test_the_weights_are_published_only_where_a_stage_fetches_them() -> None:
    """A train stage that generates publishes version numbers only, unless another stage of the
    pipeline fetches the weights (the eval stage that eval.every adds; a generator of its own)."""
    from streamrl.stages.handover import policy_fetched

    sync = REPO / "pipelines" / "grpo_sync.yaml"
    assert not policy_fetched(load_pipeline(load_config({"pipeline": str(sync)})))
    assert policy_fetched(load_pipeline(load_config({"pipeline": str(sync), "eval": {"every": 5}})))
    assert policy_fetched(load_pipeline(load_config({"pipeline": str(REPO / "pipelines" / "grpo_rollout.yaml")})))
    assert policy_fetched(load_pipeline(load_config({"pipeline": str(REPO / "pipelines" / "grpo.yaml")})))
    assert policy_fetched(None)  # a stage driven by hand: assume one does
