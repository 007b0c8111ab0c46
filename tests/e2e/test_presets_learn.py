"""Every algorithm preset learns digits-max end to end, in real processes, in the separate placement
(configs/grpo_digits.yaml) and in a reshard placement, colocated (configs/grpo_digits_colocated.yaml:
2 processes alternate generation and training, allgather-swap).

The presets are those of streamrl/algos/presets/ (``streamrl.config.preset_names``), so a new one is
covered here without a change. Each run is ops/bench/presets.py's (``run_args``): the preset on the
config's model, batch and optimizer, digits-max with 3 digits, ``algo.max_new_tokens=4``,
``algo.stop_reward=0.9``, at most CAP steps (dapo and ppo on the pipeline their stages need for the
placement). A run passes when it stopped because a step's mean reward reached 0.9, before the cap.

Seed 1 (the model's init, the prompts and the sampling; a random policy is near 0.25): every preset
but dapo reaches 0.9 at step 46 in both placements, dapo at step 60 colocated; dapo in the separate
placement runs seed 4 (67 steps; see SEEDS). 3-15 s of training each (2-core machine, load 1.5-3).
The runs are synchronous (max_staleness 0), so the steps are the same every time.
docs/benchmarks.md §13 has seeds 0 and 1 of every preset.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import streamrl
from ops.bench.presets import CONFIG, ROOT, TASKS, run_args
from streamrl.config import preset_names
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

pytestmark = pytest.mark.slow  # 16 runs, about 3 minutes together

CONFIGS = {"separate": CONFIG, "colocated": ROOT / "configs" / "grpo_digits_colocated.yaml"}
TASK = "max"
SEED = 1
CAP = 200  # steps; these seeds need at most 67 (seed 0 up to 112: colocated ppo)
# Dynamic sampling makes a synchronous dapo step generate wave after wave once the policy answers most
# prompts the same way, and how long that lasts depends on the seed. Separate placement, seeds 0-5:
# 68, 110, - (seed 2: OverGenerationCapReached at step 86), 69, 67, 77 steps; 17, 62, -, 19, 15, 24 s
# of training. algo.max_staleness=1 (the next step's waves generated while this one trains) did not
# fix that: seed 1 took 54-112 steps and 8-29 s over 5 runs (load 2.5-4.5), and the steps change from run to run,
# so dapo stays synchronous on seed 4. Colocated, seed 1: 60 steps, 15-17 s (max_staleness 1 is
# allowed there but was slower: 76 steps, 23 s).
SEEDS: dict[tuple[str, str], int] = {("separate", "dapo"): 4}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("preset", preset_names())
@pytest.mark.parametrize("placement", list(CONFIGS))
def test_the_preset_learns_digits_max(tmp_path: Path, placement: str, preset: str) -> None:
    before = ipc_dirs()
    seed = SEEDS.get((placement, preset), SEED)
    result = streamrl.run(*run_args(CONFIGS[placement], TASK, preset, seed, CAP, tmp_path))
    target = TASKS[TASK][2]
    rewards = [row["reward_mean"] for row in result.metrics]
    reached = result.stop_reason.startswith("reward ") and bool(rewards) and rewards[-1] >= target
    assert reached and result.steps < CAP, (
        f"{preset} ({placement}, seed {seed}): {result.steps} of at most {CAP} steps, stopped by "
        f"{result.stop_reason!r}; the last rewards {[round(r, 3) for r in rewards[-10:]]} (target {target})")
    assert_run_cleaned(result.run_dir, os.getpid(), before)
