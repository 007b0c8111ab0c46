"""DAPO's dynamic sampling end to end, real processes (pipelines/dapo.yaml, preset dapo).

The filter stage drops every group whose rewards are all equal through the dock's discard; the
source makes more groups until each step has its quota. One synchronous run carries most checks
(every step trains exactly batch_size samples, none of a uniform group, the filter really dropped
some, generation stays under the cap), then a resume from its middle checkpoint must reproduce
it exactly. With max_staleness 1 a resume neither repeats nor loses a sample; a cap too small
for the task fails the run saying which field to change.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from streamrl.runtime.launcher import run
from streamrl.runtime.stage import StageError
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
STEPS, EVERY, P, G = 8, 4, 4, 4
EXACT = ["reward_mean", "reward_std", "loss", "kl", "clip_fraction", "entropy", "grad_norm", "lr",
         "response_len_mean", "response_tokens", "samples", "dropped_samples"]


def _config(tmp: Path, **algo: Any) -> Path:
    cfg = {
        "preset": "dapo",
        "pipeline": str(REPO / "pipelines" / "dapo.yaml"),
        "seed": 5,
        "model": {"tiny": {"arch": "qwen2", "hidden": 32, "layers": 1, "heads": 2, "intermediate": 64,
                           "max_positions": 32, "seed": 0}},
        "task": {"name": "digits-max", "options": {"n_digits": 3}},
        "algo": {"steps": STEPS, "prompts_per_step": P, "group_size": G, "max_new_tokens": 3, "lr": 3e-3,
                 "max_staleness": 0, **algo},
        "output": {"name": "dapo", "checkpoint_every": EVERY, "keep_checkpoints": 3, "progress": "none",
                   "tensorboard": False, "plot": False, "checkpoint": False},
        "stages": {s: {"micro_batch": 16} for s in ("generate", "score", "filter", "advantage", "train")},
    }
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rerun_from_middle(config: Path, run_dir: Path) -> list[dict[str, Any]]:
    """Resume the finished run from its checkpoint at step EVERY (as if it died after that)."""
    for later in range(EVERY + 1, STEPS + 1):
        shutil.rmtree(run_dir / "checkpoints" / f"step-{later:08d}", ignore_errors=True)
    again = run(config, resume=run_dir)
    assert again.resumed_from == EVERY and [r["step"] for r in again.metrics] == list(range(1, STEPS + 1))
    return again.metrics


@pytest.mark.timeout(300)
def test_every_step_is_full_of_informative_groups_and_a_resume_repeats_it_exactly(tmp_path: Path) -> None:
    before = ipc_dirs()
    config = _config(tmp_path)
    first = run(config, run_dir=tmp_path / "run")
    rows = first.metrics
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["samples"] == P * G for r in rows), [r["samples"] for r in rows]  # the quota, every step
    assert all(r["uniform_groups"] == 0 for r in rows), [r["uniform_groups"] for r in rows]
    assert all(r["repeated_samples"] == 0 for r in rows)
    dropped = sum(r["dropped_samples"] for r in rows)
    assert dropped > 0, "the filter dropped nothing: this run did not exercise dynamic sampling"
    made = rows[-1]["source/groups_made"]
    # the source made what was trained and dropped (and at most one more step's first wave), within the cap
    assert (STEPS * P * G + dropped) / G <= made <= (STEPS * P * G + dropped) / G + P + 1, (made, dropped)
    assert made <= 10 * P * (STEPS + 1)
    assert rows[-1]["source/stale_samples"] == 0  # synchronous: nothing made that the step could not take
    assert 0 < rows[-1]["filter/kept_fraction"] < 1
    final = json.loads((first.run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
    assert final["trained_extra"] == [] and final["trained_below"] == STEPS * P * G + int(dropped)
    assert_run_cleaned(first.run_dir, os.getpid(), before)

    resumed = _rerun_from_middle(config, first.run_dir)
    for got, want in zip(resumed, rows, strict=True):
        assert {k: got[k] for k in EXACT} == {k: want[k] for k in EXACT}, f"step {got['step']}"


@pytest.mark.slow  # second tier (pyproject.toml); its cheaper sibling in the default run: the synchronous run and resume above
@pytest.mark.timeout(300)
def test_async_resume_neither_repeats_nor_loses_a_sample(tmp_path: Path) -> None:
    config = _config(tmp_path, max_staleness=1)
    first = run(config, run_dir=tmp_path / "run")
    assert all(r["samples"] == P * G and r["uniform_groups"] == 0 for r in first.metrics)
    rows = _rerun_from_middle(config, first.run_dir)
    assert all(r["samples"] == P * G and r["repeated_samples"] == 0 for r in rows)
    # none dropped for staleness: every sample made was trained, dropped by the filter, or in flight at the end
    assert rows[-1]["source/stale_samples"] == 0 and first.metrics[-1]["source/stale_samples"] == 0


@pytest.mark.timeout(180)
def test_a_cap_too_small_for_the_task_fails_the_run_naming_the_field(tmp_path: Path) -> None:
    before = ipc_dirs()
    config = _config(tmp_path, dynamic_sampling={"enabled": True, "max_rounds": 1})
    with pytest.raises(StageError, match=r"stage 'source'.*algo\.dynamic_sampling\.max_rounds=1 rounds"):
        run(config, ["output.checkpoint_every=0"], run_dir=tmp_path / "run")
    assert_run_cleaned(tmp_path / "run", os.getpid(), before)


@pytest.mark.timeout(240)
def test_dynamic_sampling_in_the_colocated_placement(tmp_path: Path) -> None:
    """pipelines/dapo_colocated.yaml: the generate workers live in the train ranks' processes and
    generate only while the trainer waits, yet the source's waves still fill every step."""
    before = ipc_dirs()
    config = REPO / "configs" / "grpo_digits_colocated.yaml"
    result = run(config, ["preset=dapo", f"pipeline={REPO / 'pipelines' / 'dapo_colocated.yaml'}", "algo.steps=6",
                          "algo.stop_reward=null", "output.progress=none", "output.tensorboard=false",
                          "output.plot=false", "output.checkpoint=false"], run_dir=tmp_path / "run")
    rows = result.metrics
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["samples"] == 64 and r["uniform_groups"] == 0 for r in rows), rows
    assert sum(r["dropped_samples"] for r in rows) > 0
    assert_run_cleaned(result.run_dir, os.getpid(), before)


@pytest.mark.timeout(300)
def test_a_token_budget_makes_steps_of_varying_size_split_evenly_over_two_ranks(tmp_path: Path) -> None:
    """algo.dynamic_sampling.token_budget with 2 train ranks: each rank claims micro-batches of one
    group, so a step is rounds of 2 groups, ending at the first round whose response tokens reach the
    budget; the samples left over train in the next step (max_staleness 1). Every sample made is
    trained once, dropped by the filter, dropped as too stale (counted, and made again), or still in
    flight at the end; resumed from the middle, still none is trained twice."""
    budget, max_tokens = 40, 3
    round_samples = 2 * G
    before = ipc_dirs()
    config = _config(tmp_path, max_staleness=1, max_new_tokens=max_tokens,
                     dynamic_sampling={"enabled": True, "token_budget": budget})
    cfg = yaml.safe_load(config.read_text())
    # digits-reverse: responses of 1 to 3 tokens, so what a budget buys varies
    cfg["task"] = {"name": "digits-reverse", "options": {"min_digits": 2, "max_digits": 2}}
    cfg["stages"]["train"] = {"micro_batch": G, "workers": 2}
    config.write_text(yaml.safe_dump(cfg))
    first = run(config, run_dir=tmp_path / "run")
    rows = first.metrics
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert r["samples"] % round_samples == 0, r["samples"]  # whole rounds: the ranks' shares are equal
        # the step ended at the first round that reached the budget
        assert budget <= r["response_tokens"] < budget + round_samples * max_tokens, (r["step"], r["response_tokens"])
        assert r["uniform_groups"] == 0 and r["repeated_samples"] == 0
    trained = sum(r["samples"] for r in rows)
    final = json.loads((first.run_dir / "checkpoints" / f"step-{STEPS:08d}" / "state.json").read_text())
    # the ledger holds every sample trained, each once (the keys below trained_below, and the extra ones)
    assert final["trained_below"] + len(final["trained_extra"]) == trained
    last = rows[-1]
    in_flight = last["source/groups_made"] * G - trained - last["source/discarded_samples"] - last["source/stale_samples"]
    # what the source keeps ahead: the rest of a step and max_staleness more (about a step each here,
    # a step being P * G samples or a few rounds more), a round, and one wave
    assert 0 <= in_flight <= 3 * P * G + round_samples + P * G, in_flight
    assert_run_cleaned(first.run_dir, os.getpid(), before)

    resumed = _rerun_from_middle(config, first.run_dir)
    assert all(r["repeated_samples"] == 0 and budget <= r["response_tokens"] for r in resumed)
