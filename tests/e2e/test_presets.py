"""End to end, real processes: a preset and a user's advantage function named in the config reach
the advantage stage and the trainer in their own processes, by name.

configs/grpo_digits.yaml with ``preset=cispo`` and ``algo.advantage`` a user function giving every
sample +1 (or -1; that run also names a user's policy loss, plain REINFORCE). With a constant
advantage A, CISPO's per-token loss is -w·A·logprob with w ≈ 1 on-policy, REINFORCE's -A·logprob,
so a step's loss is about -A times the mean sampled-token logprob: clearly positive for A = +1 and
negative for A = -1 (GRPO's group-centred advantages would give about 0). That shows the user's
estimator produced what the trainer trained on, and that the trainer ran the loss named.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

import streamrl
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"
STEPS = 3


@pytest.mark.timeout(180)
def test_a_preset_and_a_user_estimator_run_in_the_stage_processes(tmp_path: Path) -> None:
    before = ipc_dirs()
    losses = {}
    for value in (1.0, -1.0):
        overrides = ["preset=cispo", "algo.advantage=tests.algos.user_algos:constant",
                     f"algo.advantage_options={{value: {value}}}", f"algo.steps={STEPS}", "algo.stop_reward=null",
                     f"output.run_dir={tmp_path / str(value)}", "output.progress=none", "output.tensorboard=false",
                     "output.plot=false", "output.checkpoint=false"]
        loss = "cispo" if value > 0 else "tests.algos.user_algos:reinforce"
        result = streamrl.run(str(DIGITS), [*overrides, f"algo.loss.policy_loss={loss}"])
        assert result.steps == STEPS
        losses[value] = [row["loss"] for row in result.metrics]
        written = yaml.safe_load((result.run_dir / "config.yaml").read_text())
        assert written["preset"] == "cispo" and written["algo"]["loss"]["policy_loss"] == loss
        assert written["algo"]["loss"]["clip_low"] == 1.0 and written["algo"]["advantage_options"] == {"value": value}
        assert_run_cleaned(result.run_dir, os.getpid(), before)
    # -logprob of a sampled token of a random-init tiny model is ~ln(vocab): well above 0.5
    assert all(loss > 0.5 for loss in losses[1.0]), losses
    assert all(loss < -0.5 for loss in losses[-1.0]), losses


@pytest.mark.timeout(180)
def test_kl_in_the_reward_is_taken_by_the_advantage_stage(tmp_path: Path) -> None:
    """algo.loss.kl_in: reward with pipelines/grpo_kl_reward.yaml: the advantage stage reports the
    penalty it took from the rewards; it grows from 0 (the policy is the reference at step 1)."""
    before = ipc_dirs()
    overrides = [f"pipeline={REPO / 'pipelines' / 'grpo_kl_reward.yaml'}", "algo.loss.kl_coef=0.5",
                 "algo.loss.kl_in=reward", "algo.steps=6", "algo.stop_reward=null", "algo.lr=0.01",
                 f"output.run_dir={tmp_path}", "output.progress=none", "output.tensorboard=false",
                 "output.plot=false", "output.checkpoint=false"]
    result = streamrl.run(str(DIGITS), overrides)
    penalties = [row.get("advantage/kl_penalty_mean") for row in result.metrics]
    assert all(p is not None and p >= 0 for p in penalties), penalties  # k3 >= 0
    assert penalties[-1] > 1e-4 and result.metrics[-1]["kl"] > 0, (penalties, result.metrics[-1]["kl"])
    assert_run_cleaned(result.run_dir, os.getpid(), before)
