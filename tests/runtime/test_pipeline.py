"""Pipeline graph checks: every error names the pipeline file, the stage and the field at fault."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrl.config import ConfigError, load_config
from streamrl.runtime.pipeline import PipelineSpec, StageSpec
from streamrl.runtime.prerun import choose_pipeline, load_pipeline, pipeline_from_path

REPO = Path(__file__).resolve().parents[2]
GRPO = yaml.safe_load((REPO / "pipelines" / "grpo.yaml").read_text())

Mutation = Callable[[dict[str, Any]], None]


def _stage(p: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in p["stages"] if s["name"] == name)


def _write(tmp_path: Path, mutate: Mutation | None = None, name: str = "pipe.yaml") -> Path:
    p = copy.deepcopy(GRPO)
    if mutate is not None:
        mutate(p)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def _load(path: Path, overrides: list[str] | None = None) -> PipelineSpec:
    return load_pipeline(load_config({"pipeline": str(path)}, overrides))


def _error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        _load(path, overrides)
    return str(info.value)


def test_the_shipped_pipelines_are_valid() -> None:
    grpo = _load(REPO / "pipelines" / "grpo.yaml")
    assert [s.name for s in grpo.stages] == ["source", "generate", "score", "advantage", "train"]
    assert grpo.consumers == ["generate", "score", "advantage", "train"]
    assert grpo.stage("advantage").whole_groups
    kl = _load(REPO / "pipelines" / "grpo_kl.yaml", ["algo.loss.kl_coef=0.1"])
    assert "reference" in [s.name for s in kl.stages]


def test_stage_overrides_from_the_run_config_apply(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda p: _stage(p, "score").__setitem__("options", {"on_sample_error": "default",
                                                                                "score_key": "a"}))
    spec = _load(path, ["stages.score.workers=2", "stages.score.micro_batch=8", "stages.score.options={score_key: b}",
                        "stages.train.threads=1"])
    score = spec.stage("score")
    assert (score.workers, score.micro_batch, score.options) == (2, 8, {"on_sample_error": "default",
                                                                        "score_key": "b"})
    assert spec.stage("train").threads == 1
    assert spec.stage("generate").micro_batch == _stage(GRPO, "generate")["micro_batch"]  # untouched: the file's


@pytest.mark.parametrize(
    ("mutate", "stage", "needles"),
    [
        pytest.param(lambda p: _stage(p, "score")["reads"].append("bonus"), "score", ["reads", "'bonus'",
                     "no stage writes it"], id="read-without-writer"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("name", "generate"), "generate",
                     ["name is not unique"], id="duplicate-name"),
        pytest.param(lambda p: _stage(p, "score")["writes"].append("response_ids"), "score",
                     ["writes 'response_ids'", "'generate' already writes"], id="column-written-twice"),
        pytest.param(lambda p: _stage(p, "generate")["reads"].append("advantage"), "generate",
                     ["cycle", "generate -> advantage -> score -> generate"], id="cycle"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("class", "tests.runtime.no_such_module:Score"),
                     "score", ["class", "cannot import module 'tests.runtime.no_such_module'"], id="no-module"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("class", "streamrl.stages.score:NoSuchStage"),
                     "score", ["class", "has no 'NoSuchStage'"], id="no-such-class"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("class", "streamrl.stages.score.ScoreStage"),
                     "score", ["class", "'package.module:Name'"], id="class-without-colon"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("class", "streamrl.stages.common:build_task"),
                     "score", ["class", "is not a class"], id="not-a-class"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("class", "tests.runtime.user_stages:CountingSource"),
                     "score", ["class", "lacks ['process']"], id="stage-without-process"),
        pytest.param(lambda p: _stage(p, "source").__setitem__("class", "tests.runtime.user_stages:Recorder"),
                     "source", ["class", "lacks ['produce']"], id="source-without-produce"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("workers", 0), "score",
                     ["workers must be >= 1, got 0"], id="workers-0"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("micro_batch", 0), "score",
                     ["micro_batch must be >= 1, got 0"], id="micro-batch-0"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("threads", 0), "score",
                     ["threads must be >= 1"], id="threads-0"),
        pytest.param(lambda p: _stage(p, "source").__setitem__("workers", 2), "source",
                     ["source stage", "exactly one worker"], id="source-workers-2"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("device", "tpu"), "score",
                     ["device", "'tpu'"], id="unknown-device"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("device", "cuda:99"), "score",
                     ["device", "'cuda:99'"], id="unavailable-device"),
        pytest.param(lambda p: _stage(p, "score").__setitem__("name", "sc ore"), "sc ore",
                     ["name", "letters, digits"], id="bad-name"),
    ],
)
def test_graph_errors_name_the_file_the_stage_and_the_field(tmp_path: Path, mutate: Mutation, stage: str,
                                                            needles: list[str]) -> None:
    path = _write(tmp_path, mutate)
    msg = _error(path)
    assert str(path) in msg
    assert repr(stage) in msg or f"{stage} -> " in msg  # a cycle lists its stages as a path
    for needle in needles:
        assert needle in msg


def test_two_sources_or_none(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, lambda p: _stage(p, "score").__setitem__("reads", [])))
    assert "exactly one stage must have no reads" in msg and "'source'" in msg and "'score'" in msg


def test_an_empty_pipeline(tmp_path: Path) -> None:
    assert "no stages" in _error(_write(tmp_path, lambda p: p.__setitem__("stages", [])))


def test_kl_without_a_reference_writer(tmp_path: Path) -> None:
    path = _write(tmp_path)
    msg = _error(path, ["algo.loss.kl_coef=0.1"])
    assert str(path) in msg and "algo.loss.kl_coef" in msg and "'ref_logprobs'" in msg and "grpo_kl.yaml" in msg
    # with the reference stage it is fine
    _load(REPO / "pipelines" / "grpo_kl.yaml", ["algo.loss.kl_coef=0.1"])


def test_an_override_for_an_unknown_stage(tmp_path: Path) -> None:
    path = _write(tmp_path)
    msg = _error(path, ["stages.scorer.workers=2"])
    assert "stages.scorer" in msg and str(path) in msg and "'score'" in msg  # lists the real stages


def test_a_bad_override_value_is_checked_like_the_file(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path), ["stages.score.micro_batch=0"])
    assert "'score'" in msg and "micro_batch must be >= 1" in msg


def test_the_run_device_is_checked(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path), ["resources.device=tpu"])
    assert "resources.device" in msg and "'tpu'" in msg


def test_missing_and_malformed_pipeline_files(tmp_path: Path) -> None:
    assert "no such file" in _error(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nstages: [\n")
    msg = _error(broken)
    assert str(broken) in msg and "not valid YAML" in msg


def test_an_unknown_stage_field_names_the_field(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda p: _stage(p, "score").__setitem__("worker", 2))
    msg = _error(path)
    assert str(path) in msg and "worker" in msg and "stages[2]" in msg


@pytest.mark.parametrize(("field", "value"), [("micro_batch", "many"), ("worker", 2)])
def test_type_errors_in_a_stage_name_the_stage(tmp_path: Path, field: str, value: object) -> None:
    path = _write(tmp_path, lambda p: _stage(p, "score").__setitem__(field, value))
    msg = _error(path)
    assert "'score'" in msg and field in msg


def test_a_user_stage_class_passes_the_same_checks(tmp_path: Path) -> None:
    def add_user_stage(p: dict[str, Any]) -> None:
        p["stages"].append({"name": "length", "class": "tests.runtime.user_stages:ResponseLength",
                            "reads": ["response_ids"], "writes": ["response_len"]})
        p["stages"].append({"name": "check", "class": "tests.runtime.user_stages:Recorder",
                            "reads": ["response_len", "reward"]})

    spec = _load(_write(tmp_path, add_user_stage))
    assert spec.stage("length").cls == "tests.runtime.user_stages:ResponseLength"
    assert "check" in spec.consumers


def test_validate_without_importing_classes(tmp_path: Path) -> None:
    """``import_classes=False`` checks the graph only (a class that does not import is fine)."""
    from streamrl.runtime.pipeline import validate_pipeline

    cfg = load_config({})
    spec = PipelineSpec(name="p", stages=[
        StageSpec(name="a", cls="nowhere:A", writes=["x"]),
        StageSpec(name="b", cls="nowhere:B", reads=["x"], writes=["y"]),
    ])
    validate_pipeline(spec, cfg, import_classes=False)
    with pytest.raises(ConfigError, match="cannot import module 'nowhere'"):
        validate_pipeline(spec, cfg)
    assert pipeline_from_path(REPO / "pipelines" / "grpo.yaml", cfg).name == "grpo"


@pytest.mark.parametrize(("overrides", "chosen", "why"), [
    ([], "grpo_sync", None),
    (["algo.max_staleness=1"], "grpo_rollout", "algo.max_staleness 1"),
    (["stages.rollout.micro_batch=32"], "grpo_rollout", "stages.rollout overrides a stage"),
    (["stages.train.workers=2"], "grpo_rollout", "workers must be 1"),
    (["stages.generate.options={engine: vllm}"], "grpo_rollout", "not 'vllm'"),
    (["resources.launch=ray"], "grpo_rollout", "resources.launch ray"),
])
def test_pipeline_auto_is_one_process_a_step_where_that_fits(
        overrides: list[str], chosen: str, why: str | None, caplog: pytest.LogCaptureFixture) -> None:
    """``pipeline: auto`` (the default): the synchronous one-process pipeline at max_staleness 0 on a
    CPU host wherever its checks pass, else the streaming one, the log saying why."""
    cfg = load_config({"algo": {"steps": 2}}, overrides)
    assert cfg.pipeline == "auto"
    with caplog.at_level("INFO", logger="streamrl.pipeline"):
        picked = choose_pipeline(cfg)
    assert picked.pipeline == f"pipelines/{chosen}.yaml"
    assert choose_pipeline(picked) is picked  # a file stays as it is
    said = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("pipeline auto"))
    assert f"pipelines/{chosen}.yaml" in said
    if why is not None:
        assert why in said
    if not any("ray" in o or "vllm" in o for o in overrides):  # (their checks need Ray or vLLM installed)
        assert load_pipeline(cfg).name == chosen  # load_pipeline resolves auto the same way


def test_pipeline_auto_on_an_accelerator_streams() -> None:
    cfg = load_config({"resources": {"device": "cuda"}})
    assert choose_pipeline(cfg).pipeline == "pipelines/grpo_rollout.yaml"
