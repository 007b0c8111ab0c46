"""The eval stage, end to end in real processes: eval rows in metrics.jsonl at the configured
versions and at the end, without holding training back."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.runtime.prerun import load_pipeline
from tests.metrics.documented import undocumented
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"


@pytest.mark.timeout(240)
def test_eval_rows_at_every_and_at_the_end(tmp_path: Path) -> None:
    before = ipc_dirs()
    overrides = ["algo.steps=5", "algo.stop_reward=null", "eval.every=2", "eval.max_prompts=16",
                 f"output.run_dir={tmp_path}", "output.progress=none"]
    result = streamrl.run(str(DIGITS), overrides)
    assert result.steps == 5
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/mean@1" in r]
    train = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    # versions 2 and 4 while training, and the final version 5 (from the exported checkpoint when
    # the run's stop raced the fetch): each exactly once
    assert sorted(r["step"] for r in evals) == [2, 4, 5], evals
    for r in evals:
        assert 0.0 <= r["eval/mean@1"] <= 1.0 and r["eval/pass@1"] == r["eval/mean@1"]  # 0/1 rewards, k = 1
        assert r["eval/prompts"] == 16 and r["eval/response_len_mean"] >= 1 and r["eval/eval_s"] > 0
        assert not any(k.startswith("busy/") or k == "reward_mean" for k in r)  # eval rows stay apart
    assert result.eval_metrics == evals and result.metrics == train
    assert result.final_reward == train[-1]["reward_mean"]
    assert not undocumented(k for r in rows for k in r)  # docs/observability.md's metrics table has them all
    assert_run_cleaned(result.run_dir, os.getpid(), before)


@pytest.mark.timeout(240)
def test_sampled_eval_reports_mean_and_pass_at_k(tmp_path: Path) -> None:
    overrides = ["algo.steps=2", "algo.stop_reward=null", "eval.every=2", "eval.max_prompts=8", "eval.samples=4",
                 "eval.temperature=1.0", f"output.run_dir={tmp_path}", "output.progress=none",
                 "resources.launch=inprocess"]
    result = streamrl.run(str(DIGITS), overrides)
    (row,) = result.eval_metrics
    assert row["step"] == 2
    assert 0.0 <= row["eval/mean@4"] <= row["eval/pass@4"] <= 1.0  # pass@k >= mean@k for 0/1 rewards
    assert row["eval/prompts"] == 8


def test_eval_stage_is_added_only_when_asked_and_only_where_snapshots_are_published() -> None:
    plain = load_pipeline(load_config(DIGITS))
    assert "eval" not in [s.name for s in plain.stages]
    spec = load_pipeline(load_config(DIGITS, ["eval.every=10", "stages.eval.device=cpu"]))
    (stage,) = [s for s in spec.stages if s.name == "eval"]
    assert stage.is_side and not stage.is_source and "eval" not in spec.consumers and stage.device == "cpu"
    with pytest.raises(ConfigError, match=re.escape("placement: separate")):
        load_pipeline(load_config(REPO / "configs" / "grpo_digits_colocated.yaml", ["eval.every=10"]))
    with pytest.raises(ConfigError, match=re.escape("eval.samples=4 with eval.temperature 0")):
        load_config(DIGITS, ["eval.every=10", "eval.samples=4"])
    with pytest.raises(ConfigError, match=re.escape("stages.eval overrides a stage")):
        load_pipeline(load_config(DIGITS, ["stages.eval.device=cpu"]))  # no eval.every: no eval stage
