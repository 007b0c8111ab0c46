"""Colocated placement: R processes alternate generate and train through the allgather-swap reshard.

The run tests are real: worker processes from the forkserver, a real gloo world of R = 2 ranks
joined through a FileStore in the run dir, the sharded train engine, the reshard and the swap.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.runtime.prerun import load_pipeline
from streamrl.runtime.stage import StageError
from tests.metrics.documented import undocumented
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs, only_run_dir

REPO = Path(__file__).resolve().parents[2]
COLOCATED = yaml.safe_load((REPO / "pipelines" / "grpo_colocated.yaml").read_text())
GRPO = yaml.safe_load((REPO / "pipelines" / "grpo.yaml").read_text())


def _stage(p: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in p["stages"] if s["name"] == name)


def _write(tmp_path: Path, base: dict[str, Any], **changes: Any) -> Path:
    p = copy.deepcopy(base)
    for key, value in changes.items():
        if "." in key:
            stage, field = key.split(".", 1)
            _stage(p, stage)[field] = value
        else:
            p[key] = value
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    return path


def _error(path: Path, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_pipeline(load_config({"pipeline": str(path)}, overrides))
    return str(info.value)


def test_the_shipped_colocated_pipeline_groups_generate_into_the_train_processes() -> None:
    spec = load_pipeline(load_config(REPO / "configs" / "grpo_digits_colocated.yaml"))
    assert spec.placement == "colocated"
    groups = [[(s.name, k) for s, k in g] for g in spec.process_groups()]
    assert groups == [[("source", 0)], [("score", 0)], [("advantage", 0)],
                      [("train", 0), ("generate", 0)], [("train", 1), ("generate", 1)]]


def test_separate_placement_is_the_default_and_unchanged() -> None:
    spec = load_pipeline(load_config(REPO / "configs" / "grpo_digits.yaml"))
    assert spec.placement == "separate"
    assert all(len(g) == 1 for g in spec.process_groups())


@pytest.mark.parametrize(("changes", "expected"), [
    ({"generate.colocate_with": "trainer"}, "colocate_with: no stage named 'trainer'"),
    ({"generate.colocate_with": "generate"}, "cannot be colocated with itself"),
    ({"generate.workers": 1}, "'generate' has workers=1 but 'train' has workers=2"),
    ({"generate.colocate_with": "source"}, "the source stage cannot be colocated"),
    ({"placement": "disaggregated"}, "placement 'disaggregated' needs exactly one stage with weights_from"),
    ({"placement": "nearby"}, "placement 'nearby' is not one of"),
    ({"placement": "separate"}, "works only with `placement: colocated`"),
    ({"generate.colocate_with": None}, "placement 'colocated' needs a stage with colocate_with"),
])
def test_bad_colocation_is_refused_naming_the_field(tmp_path: Path, changes: dict[str, Any], expected: str) -> None:
    msg = _error(_write(tmp_path, COLOCATED, **changes))
    assert expected in msg and str(tmp_path / "pipe.yaml") in msg


def test_a_chain_of_colocations_is_refused(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, COLOCATED, **{"score.colocate_with": "generate", "score.workers": 2}))
    assert "'generate' is itself colocated with 'train'; name the host stage 'train' instead" in msg


def test_colocated_needs_worker_processes(tmp_path: Path) -> None:
    msg = _error(_write(tmp_path, COLOCATED), ["resources.launch=inprocess"])
    assert "needs resources.launch: processes or ray" in msg


def _run_config(tmp_path: Path, *overrides: str) -> list[str]:
    return [f"output.run_dir={tmp_path / 'runs'}", "output.progress=none", "output.tensorboard=false",
            "output.plot=false", *overrides]


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: tests/e2e/test_resume.py's exact resume
# in the colocated placement (and the colocated runs of test_dynamic_sampling, test_data_parallel, test_ppo)
@pytest.mark.timeout(240)
def test_colocated_grpo_with_two_ranks_learns_digits_like_the_single_process_run(
        tmp_path: Path, single_trainer_digits: streamrl.RunResult) -> None:
    """R = 2 colocated vs the single-process trainer on the same task, model, batch and optimizer:
    both must reach the config's stop_reward (0.9; chance is ~0.1) within the same step budget. The
    single-process run is the session's (tests/conftest.py: configs/grpo_digits.yaml, 200 steps)."""
    before = ipc_dirs()
    budget = "algo.steps=200"
    colocated = streamrl.run(REPO / "configs" / "grpo_digits_colocated.yaml",
                             _run_config(tmp_path / "colocated", budget))
    single = single_trainer_digits
    for result in (colocated, single):
        assert result.stop_reason.startswith("reward ") and result.final_reward is not None
        assert result.final_reward >= 0.9 and result.steps < 200
    first = colocated.metrics[0]["reward_mean"]
    assert first < 0.5  # it really learned: the random-init policy starts near chance
    # same order of steps as the single-process trainer (observed: 83 vs 68)
    assert colocated.steps <= 2.5 * single.steps + 20

    rows = [json.loads(line) for line in (colocated.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == colocated.steps and [r["step"] for r in rows] == list(range(1, colocated.steps + 1))
    for row in rows:
        # the reshard's report: peak extra memory is one bucket, never the model
        assert 0 < row["reshard_peak_extra_bytes"] <= row["reshard_bucket_bytes_limit"] == 262144
        assert row["reshard_buckets"] > 1 and row["reshard_ms"] > 0
        # on a CPU the training state already lives in host memory: the swap moves nothing (0 bytes)
        assert row["swap_bytes"] == 0 and row["swap_out_ms"] >= 0 and row["swap_in_ms"] >= 0
        assert row["micro_batches"] == 2 and row["response_tokens"] > 0 and row["staleness_max"] == 0
        assert all(0 <= row[f"busy/{s}"] <= 1 for s in ("generate", "train"))
    assert not undocumented(k for row in rows for k in row)  # docs/observability.md's metrics table
    # rank 0's checkpoint is the last version, loadable as a Hugging Face directory
    assert (colocated.run_dir / "checkpoint" / "config.json").is_file()
    assert not (colocated.run_dir / "rendezvous").exists()
    logs = sorted(p.name for p in (colocated.run_dir / "logs").glob("*.log"))
    assert "generate-0+train-0.log" in logs and "generate-1+train-1.log" in logs
    assert_run_cleaned(colocated.run_dir, os.getpid(), before)


@pytest.mark.timeout(120)
def test_a_colocated_setup_error_fails_the_run_and_stops_every_process(tmp_path: Path) -> None:
    """A train stage fails in set-up (a failure validation cannot foresee: tests/runtime/failing_stages.py),
    the colocated generate stage in the same process stops with it, and nothing is left running."""
    before = ipc_dirs()
    pipe = _write(tmp_path, COLOCATED, **{"train.class": "tests.runtime.failing_stages:SetupFailsTrain"})
    with pytest.raises(StageError) as info:
        streamrl.run(REPO / "configs" / "grpo_digits_colocated.yaml",
                     _run_config(tmp_path, f"pipeline={pipe}", "resources.start_timeout_s=60"))
    assert info.value.stage in ("train", "generate")
    assert "set-up failed on purpose before joining the world" in str(info.value)
    assert_run_cleaned(only_run_dir(tmp_path / "runs"), os.getpid(), before)
