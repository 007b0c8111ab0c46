"""Inference tensor parallelism in the pipeline: T = 2 generation ranks share one inference replica.

Real runs: R = 2 train ranks, and the generate stage's two workers forming one TP group (rank 0 claims,
rank 1 follows its command stream) that samples with ``TensorParallelRolloutEngine`` over the slices
the reshard put on each rank: in the same processes (colocated) or in two more (disaggregated).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.runtime.prerun import load_pipeline
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
COLOCATED = REPO / "configs" / "grpo_digits_colocated.yaml"
DISAGGREGATED = REPO / "configs" / "grpo_digits_disaggregated.yaml"
TP2 = ["stages.generate.options={tensor_parallel: 2}", "stages.generate.micro_batch=64"]


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    return [f"output.run_dir={tmp_path / 'runs'}", "output.progress=none", "output.tensorboard=false",
            "output.plot=false", *TP2, *extra]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(240)
def test_both_placements_generate_with_a_two_rank_tp_group_and_agree(tmp_path: Path) -> None:
    """The two placements hand the same weights to the same TP engine through different paths (a
    collective reshard in place, point-to-point buckets to other processes). With one TP group there
    is one sampling stream (rank 0's seed) and with max_staleness 0 the same samples in the same
    order, so the runs must agree step for step, up to float rounding in the gradient sums."""
    before = ipc_dirs()
    steps = "algo.steps=12"
    colocated = streamrl.run(COLOCATED, _overrides(tmp_path / "col", steps, "algo.stop_reward=null"))
    disaggregated = streamrl.run(DISAGGREGATED, _overrides(tmp_path / "dis", steps, "algo.stop_reward=null"))
    col, dis = _rows(colocated.run_dir), _rows(disaggregated.run_dir)
    assert len(col) == len(dis) == 12
    for a, b in zip(col, dis, strict=True):
        # the rollout logprobs (TP engine, T = 2) equal the trainer's recomputation (sharded HF forward):
        # generation used exactly the weights being trained, in both placements
        assert a["kl"] < 1e-9 and b["kl"] < 1e-9 and a["clip_fraction"] == b["clip_fraction"] == 0.0
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9)
        assert a["response_tokens"] == b["response_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-7)
    for row in dis:  # each train rank sends its TP rank half the model (T = 1: the whole 1.33 MB)
        assert 0.6e6 < row["reshard_sent_bytes"] < 0.7e6
    for row in col:
        assert row["reshard_peak_extra_bytes"] <= row["reshard_bucket_bytes_limit"]
    for result in (colocated, disaggregated):
        assert (result.run_dir / "checkpoint" / "model.safetensors").is_file()  # gathered from the shards
        assert_run_cleaned(result.run_dir, os.getpid(), before)


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the 12-step run above
@pytest.mark.timeout(180)
def test_a_two_rank_tp_group_learns_digits(tmp_path: Path) -> None:
    result = streamrl.run(DISAGGREGATED, _overrides(tmp_path, "algo.steps=120"))
    rewards = [r["reward_mean"] for r in _rows(result.run_dir)]
    assert rewards[0] < 0.5  # chance is ~0.1
    assert result.stop_reason.startswith("reward ") and result.final_reward is not None  # observed: step 68
    assert result.final_reward >= 0.9


@pytest.mark.parametrize(("config", "extra", "expected"), [
    (DISAGGREGATED, ["stages.generate.options={tensor_parallel: 2}", "stages.generate.workers=3"],
     "has workers=3, which options.tensor_parallel=2 does not divide"),
    (COLOCATED, ["stages.generate.options={tensor_parallel: 2}", "algo.max_staleness=1"],
     "options.tensor_parallel=2 (colocated) needs algo.max_staleness: 0, got 1"),
    (COLOCATED, ["stages.generate.options={tensor_parallel: 0}"], "options.tensor_parallel must be an int >= 1"),
])
def test_bad_tensor_parallel_settings_are_refused_before_anything_starts(config: Path, extra: list[str],
                                                                          expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_pipeline(load_config(config, extra))
    assert expected in str(info.value) and "stage 'generate'" in str(info.value)


@pytest.mark.timeout(60)
def test_a_tensor_parallel_degree_the_model_cannot_split_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """T = 3 divides the 3 workers but none of the model's head counts (4 heads, 2 kv heads): validation
    builds the model's sharding spec from its config (no weights) and refuses it, naming what T must
    divide, before any process or run dir exists."""
    overrides = [f"output.run_dir={tmp_path / 'runs'}", "output.progress=none",
                 "stages.generate.options={tensor_parallel: 3}", "stages.generate.workers=3"]
    with pytest.raises(ConfigError) as info:
        streamrl.run(DISAGGREGATED, overrides)
    assert "inference tensor_parallel T=3 does not fit this qwen2 model" in str(info.value)
    assert "stage 'generate'" in str(info.value)
    assert not (tmp_path / "runs").exists()
