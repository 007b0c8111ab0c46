"""The trainer's learning-rate schedules (transformers' schedulers over torch's AdamW)."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from streamrl.config import AlgoConfig, ConfigError, load_config
from streamrl.engines.schedule import lr_scheduler
from streamrl.runtime.prerun import resolve_run_length


def lrs(algo: AlgoConfig, steps: int) -> list[float]:
    """The lr each of ``steps`` optimizer steps runs at."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=algo.lr)
    schedule = lr_scheduler(optimizer, algo)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def test_constant_without_warmup_is_the_configured_lr() -> None:
    assert lrs(AlgoConfig(lr=3e-4, steps=5), 5) == pytest.approx([3e-4] * 5)


def test_warmup_ramps_linearly_from_zero_then_holds() -> None:
    assert lrs(AlgoConfig(lr=1.0, steps=6, warmup_steps=4), 6) == pytest.approx([0, 0.25, 0.5, 0.75, 1, 1])


def test_linear_decays_to_zero_at_total_steps() -> None:
    seen = lrs(AlgoConfig(lr=1.0, steps=6, lr_schedule="linear", warmup_steps=2), 7)
    assert seen == pytest.approx([0, 0.5, 1, 0.75, 0.5, 0.25, 0])


def test_cosine_reaches_its_floor_at_total_steps() -> None:
    algo = AlgoConfig(lr=2.0, steps=10, lr_schedule="cosine", warmup_steps=0, min_lr_ratio=0.1, total_steps=8)
    seen = lrs(algo, 9)
    floor = 0.2
    expected = [floor + (2.0 - floor) * 0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(9)]
    assert seen == pytest.approx(expected)
    assert seen[8] == pytest.approx(floor)
    assert all(a > b for a, b in itertools.pairwise(seen))  # monotone down to the floor


def test_bad_schedule_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match=re.escape("algo.min_lr_ratio")):
        load_config({"algo": {"min_lr_ratio": 1.5}})
    with pytest.raises(ConfigError, match=re.escape("algo.warmup_steps")):
        load_config({"algo": {"warmup_steps": -1}})
    with pytest.raises(ConfigError, match=re.escape("algo.lr_schedule")):
        load_config({"algo": {"lr_schedule": "step"}})
    with pytest.raises(ConfigError, match=re.escape("algo.total_steps=5 is shorter than the run's 10 steps")):
        resolve_run_length(load_config({"algo": {"steps": 10, "total_steps": 5}}))
    with pytest.raises(ConfigError, match=re.escape("algo.warmup_steps=20 is longer than the run's 10 steps")):
        resolve_run_length(load_config({"algo": {"steps": 10, "warmup_steps": 20}}))


def test_epochs_and_steps_exclude_each_other_and_need_a_dataset() -> None:
    with pytest.raises(ConfigError, match=re.escape("algo.epochs and algo.steps both set")):
        load_config({"algo": {"steps": 10, "epochs": 1}})
    with pytest.raises(ConfigError, match=re.escape("algo.epochs must be > 0")):
        load_config({"algo": {"epochs": 0}})
    with pytest.raises(ConfigError, match=re.escape("makes prompts without end: set algo.steps")):
        resolve_run_length(load_config({"algo": {"epochs": 1}}))  # digits-max: an endless prompt stream
