"""Run checkpoints (streamrl/runtime/checkpoints.py): the trained-sample ledger, atomic commit,
pruning, what --resume picks, the metrics a resume keeps, RNG round trips."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from streamrl.runtime.checkpoints import (
    CheckpointMissing,
    ResumeMismatch,
    RunState,
    TrainedKeys,
    commit,
    complete_checkpoints,
    latest_checkpoint,
    resume_from,
    rng_state,
    set_rng_state,
    start_partial,
)
from streamrl.runtime.launcher import truncate_metrics


def _state(version: int) -> RunState:
    return RunState(version=version, batch_size=16, group_size=4, trained_below=16 * version)


def test_trained_keys_keep_a_watermark_and_only_the_keys_above_it() -> None:
    keys = TrainedKeys()
    keys.add([0, 1, 3, 5])
    assert keys.below == 2 and keys.sorted_extra() == [3, 5]
    keys.add([2, 4])
    assert keys.below == 6 and keys.sorted_extra() == []
    keys.add_range(6, 22)  # a synchronous step
    assert keys.below == 22 and 21 in keys and 22 not in keys
    keys.add_range(30, 32)  # out of order: kept as extras until the gap fills
    assert keys.sorted_extra() == [30, 31]
    keys.add_range(22, 30)
    assert keys.below == 32 and not keys.extra
    again = TrainedKeys(10, [9, 10, 12])  # keys below the watermark are dropped, the watermark advances
    assert again.below == 11 and again.sorted_extra() == [12]


def test_commit_is_atomic_and_prunes_to_the_newest(tmp_path: Path) -> None:
    for v in (2, 4, 6):
        partial = start_partial(tmp_path, v)
        (partial / "train").mkdir()
        (partial / "train" / "shard").write_bytes(b"x" * 10)
        assert latest_checkpoint(tmp_path) != partial  # not visible before its commit
        commit(tmp_path, v, _state(v), keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000004", "step-00000006"]
    # a save that crashed before its commit: ignored by resume, removed by the next save
    crashed = start_partial(tmp_path, 8)
    (crashed / "state.json").write_text("{")  # even a state written: not complete without the rename
    assert latest_checkpoint(tmp_path).name == "step-00000006"  # type: ignore[union-attr]
    found = resume_from(tmp_path, 16, 4)
    assert found.state.version == 6 and found.path.endswith("step-00000006")
    start_partial(tmp_path, 8)  # the next save of that step starts clean
    commit(tmp_path, 8, _state(8), keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000006", "step-00000008"]


def test_resume_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CheckpointMissing, match=r"no complete checkpoint.*checkpoint_every"):
        resume_from(tmp_path, 16, 4)
    start_partial(tmp_path, 2)
    commit(tmp_path, 2, _state(2), keep=1)
    with pytest.raises(ResumeMismatch, match=r"16 samples per step in groups of 4.*prompts_per_step"):
        resume_from(tmp_path, 32, 4)
    bad = tmp_path / "checkpoints" / "step-00000003"
    bad.mkdir()
    (bad / "state.json").write_text('{"version": "x"}')
    with pytest.raises(CheckpointMissing, match=r"delete .*step-00000003"):
        resume_from(tmp_path, 16, 4)


def test_truncate_metrics_keeps_rows_up_to_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.2}, {"step": 2, "eval/mean@1": 0.5},
            {"step": 3, "reward_mean": 0.3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew')  # cut short by a crash
    train, evals = truncate_metrics(path, 2)
    assert [r["step"] for r in train] == [1, 2] and evals == [rows[2]]
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]


def test_rng_state_round_trips_through_json() -> None:
    state = json.loads(json.dumps(rng_state()))
    a = (torch.rand(3), random.random())
    set_rng_state(state)
    b = (torch.rand(3), random.random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
