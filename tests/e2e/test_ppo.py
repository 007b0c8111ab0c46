"""PPO with a critic end to end, in real processes: configs/ppo_digits.yaml (pipelines/ppo.yaml,
preset ppo) learns digits-max from a random-init tiny Qwen2. The value stage computes per-token
values in the critic's process, the advantage stage GAE, the train stage the policy and the
critic stage the value model on its own FSDP2 engine; every process stops at the end."""

from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import pytest

import streamrl
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
PPO_DIGITS = REPO / "configs" / "ppo_digits.yaml"
QUIET = ["output.progress=none", "output.tensorboard=false", "output.plot=false", "output.checkpoint=false"]
MAX_STEPS = 150  # seeds 0 reach 0.9 in about 85 steps (docs/benchmarks.md); a random policy is near 0.25


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the critic's checkpoint-and-resume run below (same pipeline)
@pytest.mark.timeout(240)
def test_ppo_learns_digits_max(tmp_path: Path) -> None:
    before = ipc_dirs()
    result = streamrl.run(str(PPO_DIGITS), [f"algo.steps={MAX_STEPS}", f"output.run_dir={tmp_path}", *QUIET])
    rewards = [row["reward_mean"] for row in result.metrics]
    first5 = sum(rewards[:5]) / 5
    best5 = max(sum(rewards[i:i + 5]) / 5 for i in range(len(rewards) - 4))
    # a clear improvement over the random policy; the run stops once a step reaches 0.9
    assert best5 > 0.6 and best5 > first5 + 0.3, (first5, best5, rewards)
    last = result.metrics[-1]
    # the critic trained once per policy step (its rows may lag the policy's by one) and learned
    # values above the random policy's reward level
    assert last["critic/version"] >= len(rewards) - 2, last
    assert max(row["advantage/value_mean"] for row in result.metrics) > 0.4
    assert all(row["kl"] == row["kl"] for row in result.metrics)  # no NaN reached the policy
    assert_run_cleaned(result.run_dir, os.getpid(), before)


EXACT = ["reward_mean", "loss", "grad_norm", "clip_fraction", "advantage/value_mean", "advantage/advantage_abs_mean"]


@pytest.mark.timeout(240)
def test_the_critic_is_checkpointed_and_a_resume_continues_it_exactly(tmp_path: Path) -> None:
    """A 6-step run saving every 3 steps; its directory without the step-6 checkpoints resumes
    from step 3 and computes steps 4-6 as the uninterrupted run did: the values (from the
    critic's checkpoint) and everything computed from them match bitwise."""
    before = ipc_dirs()
    small = [f"output.run_dir={tmp_path / 'runs'}", "output.checkpoint_every=3", "algo.steps=6",
             "algo.stop_reward=null", "algo.prompts_per_step=4", "algo.group_size=4", *QUIET]
    whole = streamrl.run(str(PPO_DIGITS), small)
    critic = whole.run_dir / "critic"
    assert sorted(p.name for p in critic.iterdir()) == ["step-00000003", "step-00000006"]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(whole.run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "step-00000006")
    shutil.rmtree(resumed_dir / "critic" / "step-00000006")
    resumed = streamrl.run(resume=str(resumed_dir))
    rows = {row["step"]: row for row in resumed.metrics}
    for row in whole.metrics[3:]:
        again = rows[row["step"]]
        assert {k: again[k] for k in EXACT} == {k: row[k] for k in EXACT}, row["step"]
    assert_run_cleaned(resumed.run_dir, os.getpid(), before)


@pytest.mark.timeout(240)
# disaggregated in the slow tier: the critic's path is the same as colocated's; the placement's is GRPO's
@pytest.mark.parametrize("placement", ["colocated", pytest.param("disaggregated", marks=pytest.mark.slow)])
def test_ppo_in_the_reshard_placements(tmp_path: Path, placement: str) -> None:
    """pipelines/ppo_<placement>.yaml: the policy trains on 2 ranks and hands each version to
    generation through the reshard (colocated: in place; disaggregated: to 2 generate workers)
    while the critic and its value stage share a process of their own."""
    before = ipc_dirs()
    config = REPO / "configs" / f"grpo_digits_{placement}.yaml"
    result = streamrl.run(str(config), ["preset=ppo", f"pipeline={REPO / 'pipelines' / f'ppo_{placement}.yaml'}",
                                        "algo.steps=4", "algo.stop_reward=null", "algo.lr_schedule=linear",
                                        f"output.run_dir={tmp_path}", *QUIET])
    assert [row["step"] for row in result.metrics] == [1, 2, 3, 4]
    # the critic's lr follows the policy's schedule from its own peak (linear to 0 at step 4)
    critic_lrs = [row["critic/lr"] for row in result.metrics if "critic/lr" in row]
    # (a row may repeat the critic's previous step)
    assert all(b <= a for a, b in itertools.pairwise(critic_lrs)) and critic_lrs[-1] < critic_lrs[0] <= 1e-3, \
        critic_lrs
    assert all(row["samples"] == 64 for row in result.metrics)
    assert result.metrics[-1]["critic/version"] >= 3  # the critic trained alongside (its row may lag by one)
    assert all("advantage/value_mean" in row for row in result.metrics)
    assert_run_cleaned(result.run_dir, os.getpid(), before)
