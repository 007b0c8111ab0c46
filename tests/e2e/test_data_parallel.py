"""End to end, real processes: the FSDP2 trainer with several workers, other architectures, bfloat16.

configs/grpo_digits.yaml (digits-max from a random-init tiny Qwen2; chance ~0.1, stop_reward 0.9).
Seen on this machine (2 cores): one trainer reaches 0.9 at step 47-61, two trainers at the same
steps (their update is the one trainer's up to float rounding, and the generators draw from the
same seeds), bfloat16 at step 68.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import streamrl
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"
DISAGGREGATED = REPO / "configs" / "grpo_digits_disaggregated.yaml"
COLOCATED = REPO / "configs" / "grpo_digits_colocated.yaml"
BUDGET = 200


def _overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"output.run_dir={run_dir}", "output.progress=none", "output.tensorboard=false", "output.plot=false",
            f"algo.steps={BUDGET}", *extra]


def _rows(result: streamrl.RunResult) -> list[dict[str, float]]:
    return [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_two_trainers_take_the_steps_of_one(tmp_path: Path, single_trainer_digits: streamrl.RunResult) -> None:
    """stages.train.workers=2 in the default (separate) placement: each rank claims half of every step and
    FSDP2 sums the gradients; the step is normalised by the token count summed over the ranks. One
    trainer: the session's single_trainer_digits run (tests/conftest.py), the same config and budget."""
    before = ipc_dirs()
    one = single_trainer_digits
    two = streamrl.run(DIGITS, _overrides(tmp_path / "two", "stages.train.workers=2", "stages.train.micro_batch=32"))
    for result in (one, two):
        assert result.stop_reason.startswith("reward ") and result.steps < BUDGET
    rows1, rows2 = _rows(one), _rows(two)
    # Version 0 is the same everywhere and the generators draw from the same seeds, so the first
    # step is the same samples: its loss and gradient norm agree to float rounding.
    assert rows2[0]["reward_mean"] == rows1[0]["reward_mean"]
    assert rows2[0]["loss"] == pytest.approx(rows1[0]["loss"], abs=1e-6)
    assert rows2[0]["grad_norm"] == pytest.approx(rows1[0]["grad_norm"], rel=1e-5)
    assert all(r["micro_batches"] == 2 for r in rows2)  # one claim of 32 per rank per step
    assert two.steps <= 1.5 * one.steps + 20  # about as fast in steps
    assert (two.run_dir / "checkpoint" / "model.safetensors").is_file()
    assert not (two.run_dir / "rendezvous").exists()
    assert_run_cleaned(two.run_dir, os.getpid(), before)


@pytest.mark.timeout(300)
def test_tensor_parallel_trainers_take_the_steps_of_one(tmp_path: Path,
                                                        single_trainer_digits: streamrl.RunResult) -> None:
    """stages.train.options.tensor_parallel=2 with 2 workers: one model replica split over two ranks
    (DTensor column/row-parallel projections under FSDP2). Only its TP rank 0 claims; it hands each
    micro-batch to rank 1 (streamrl/stages/replica.py), so both compute the same samples. Step 1 is
    compared with the session's one-trainer run (tests/conftest.py): the same samples there too."""
    before = ipc_dirs()
    one = single_trainer_digits
    tp = streamrl.run(DIGITS, _overrides(tmp_path / "tp", "algo.steps=3", "algo.stop_reward=null",
                                         "stages.train.workers=2", "stages.train.options={tensor_parallel: 2}"))
    rows1, rows2 = _rows(one), _rows(tp)
    assert len(rows2) == 3
    # same samples at step 1 (version 0 everywhere, same generator seeds): the same update
    assert rows2[0]["reward_mean"] == rows1[0]["reward_mean"]
    assert rows2[0]["loss"] == pytest.approx(rows1[0]["loss"], abs=1e-6)
    assert rows2[0]["grad_norm"] == pytest.approx(rows1[0]["grad_norm"], rel=1e-5)
    assert rows2[0]["response_tokens"] == rows1[0]["response_tokens"]  # each sample counted once
    logs = (tp.run_dir / "logs" / "train-1.log").read_text()
    assert "stage loop ended" in logs  # the follower ran and ended with the run
    assert (tp.run_dir / "checkpoint" / "model.safetensors").is_file()
    assert_run_cleaned(tp.run_dir, os.getpid(), before)


@pytest.mark.timeout(300)
def test_colocated_tensor_parallel_trainers_reshard_from_their_slices(tmp_path: Path) -> None:
    """Colocated, 2 processes: one train replica of TP 2 hands each version to 2 whole-model generators
    through the allgather-swap, reading FSDP2 x TP shards (layout from the DTensor placements)."""
    result = streamrl.run(COLOCATED, _overrides(tmp_path, "algo.steps=3", "algo.stop_reward=null",
                                                "stages.train.options={tensor_parallel: 2, bucket_bytes: 262144}"))
    rows = _rows(result)
    assert len(rows) == 3 and all(r["reshard_buckets"] > 1 for r in rows)
    assert all(0 < r["reshard_peak_extra_bytes"] <= 262144 for r in rows)


def _float32_export(result: streamrl.RunResult) -> set[torch.dtype]:
    from safetensors.torch import load_file

    return {t.dtype for t in load_file(result.run_dir / "checkpoint" / "model.safetensors").values()}


@pytest.mark.timeout(300)
def test_bfloat16_trains_and_exports_its_float32_masters(tmp_path: Path) -> None:
    """model.dtype=bfloat16 for 3 steps: the trainer's packed forward and every step run, and the export
    keeps the float32 master weights. The default run's sibling of the learning run below."""
    result = streamrl.run(DIGITS, _overrides(tmp_path, "model.dtype=bfloat16", "algo.steps=3",
                                             "algo.stop_reward=null"))
    rows = _rows(result)
    assert result.steps == 3 and len(rows) == 3
    assert all(r["response_tokens"] > 0 and math.isfinite(r["loss"]) for r in rows), rows
    assert "train forward: packed" in (result.run_dir / "logs" / "train-0.log").read_text()
    assert _float32_export(result) == {torch.float32}


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the 3-step run above
@pytest.mark.timeout(300)
def test_bfloat16_learns_digits(tmp_path: Path) -> None:
    """model.dtype=bfloat16: FSDP2 computes in bf16 over float32 masters, generation runs in bf16 (its attention in float32 on a CPU)."""
    result = streamrl.run(DIGITS, _overrides(tmp_path, "model.dtype=bfloat16"))
    assert result.stop_reason.startswith("reward ") and result.steps < BUDGET, result.stop_reason
    assert _rows(result)[0]["reward_mean"] < 0.5  # it learned from near chance
    logs = (result.run_dir / "logs" / "train-0.log").read_text()
    assert "train forward: packed" in logs
    # the export keeps the float32 master weights
    assert _float32_export(result) == {torch.float32}


@pytest.mark.timeout(300)
# disaggregated in the slow tier: GPT-2's own parts (learned positions, Conv1D) are the same in both
@pytest.mark.parametrize("config", [DIGITS, pytest.param(DISAGGREGATED, marks=pytest.mark.slow)],
                         ids=["separate", "disaggregated"])
def test_gpt2_trains_and_generates_end_to_end(tmp_path: Path, config: Path) -> None:
    """An architecture outside the Llama family (learned positions, LayerNorm, Conv1D, tied lm_head):
    the rollout runs the module's own forward with a KV cache, the trainer its FSDP2-sharded module;
    disaggregated, the reshard moves whole parameters (a generic sharding spec, T = 1)."""
    before = ipc_dirs()
    result = streamrl.run(config, _overrides(tmp_path, "algo.steps=4", "algo.stop_reward=null",
                                             "model.tiny={arch: gpt2, hidden: 64, layers: 2, heads: 4, "
                                             "intermediate: 128, max_positions: 64}"))
    assert result.steps == 4
    rows = _rows(result)
    assert all(r["response_tokens"] > 0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # a step whose rewards all agree has no gradient
    logs = "".join(p.read_text() for p in (result.run_dir / "logs").glob("*.log"))
    assert "rollout forward: Hugging Face module with KV cache (gpt2" in logs
    assert "train forward: " in logs
    config_json = json.loads((result.run_dir / "checkpoint" / "config.json").read_text())
    assert config_json["model_type"] == "gpt2"
    assert_run_cleaned(result.run_dir, os.getpid(), before)
