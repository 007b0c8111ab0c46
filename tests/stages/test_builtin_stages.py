"""The built-in stages, each checked through a small real pipeline run in this process.

A user's Recorder stage (tests/runtime/user_stages.py) reads the columns of interest and writes
them to the run dir, so each check compares a built-in stage's output with the rule it implements.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import streamrl
from streamrl.config import ConfigError
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.runtime.launcher import RunResult
from streamrl.tasks.registry import get_task

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[2]


def _rows(run_dir: Path, name: str = "check") -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / f"{name}.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: r["index"])


def _run(tmp_path: Path, pipeline: str, **sections: Any) -> RunResult:
    path = tmp_path / "pipeline.yaml"
    path.write_text(pipeline)
    cfg: dict[str, Any] = {
        "pipeline": str(path),
        "resources": {"launch": "inprocess"},
        "output": {"run_dir": str(tmp_path / "runs"), "progress": "none", "checkpoint": False,
                   "tensorboard": False, "plot": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return streamrl.run(cfg)


# ---------------------------------------------------------------- the whole GRPO chain, one sample at a time


def _with_recorder(pipeline: str, reads: str) -> str:
    return (REPO / "pipelines" / pipeline).read_text() + f"""
  - name: check
    class: tests.runtime.user_stages:Recorder
    reads: {reads}
"""


def test_source_generate_score_advantage_train(tmp_path: Path) -> None:
    steps, prompts, group, new_tokens = 2, 3, 4, 4
    pipeline = _with_recorder("grpo.yaml", "[prompt, answer, step, prompt_ids, response_ids, rollout_logprobs, "
                                           "reward, advantage]")
    result = _run(tmp_path, pipeline, algo={"steps": steps, "prompts_per_step": prompts, "group_size": group,
                                            "max_new_tokens": new_tokens})
    rows = _rows(result.run_dir)
    n = steps * prompts * group
    assert [r["index"] for r in rows] == list(range(n))
    tok = build_char_tokenizer()
    task = get_task("digits-max", tokenizer=tok)

    # source: `group` consecutive samples per prompt, digits-max prompts, step numbers
    for r in rows:
        assert r["step"] == r["index"] // (prompts * group)
        digits = [int(d) for d in r["prompt"].rstrip("=").split("+")]
        assert len(digits) == 3 and r["answer"] == str(max(digits))
        assert r["prompt_ids"] == tok.encode(r["prompt"], add_special_tokens=False)
    for g in range(n // group):
        members = rows[g * group:(g + 1) * group]
        assert len({m["prompt"] for m in members}) == 1 and len({m["group"] for m in members}) == 1

    # generate: at most max_new_tokens tokens, one logprob per token, tagged with the policy version
    for r in rows:
        assert 1 <= len(r["response_ids"]) <= new_tokens
        assert len(r["rollout_logprobs"]) == len(r["response_ids"])
        assert all(lp <= 0 and math.isfinite(lp) for lp in r["rollout_logprobs"])
        assert r["version"] == r["step"]  # max_staleness 0: step s is generated with version s

    # score: the task's rule (first generated token is the answer digit)
    for r in rows:
        text = tok.decode(r["response_ids"])
        assert r["reward"] == task.reward(r["prompt"], text, r["response_ids"], r["answer"])

    # advantage: group-normalised (reward - group mean) / (unbiased group std + 1e-6)
    for g in range(n // group):
        rewards = torch.tensor([m["reward"] for m in rows[g * group:(g + 1) * group]])
        expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        got = torch.tensor([m["advantage"] for m in rows[g * group:(g + 1) * group]])
        assert torch.allclose(got, expected, atol=1e-5), (g, rewards, got)

    # train: one report per optimizer step, over exactly that step's samples
    assert [m["step"] for m in result.metrics] == [1, 2]
    for s, m in enumerate(result.metrics):
        assert math.isfinite(m["loss"])
        step_rewards = [r["reward"] for r in rows if r["step"] == s]
        assert m["reward_mean"] == pytest.approx(sum(step_rewards) / len(step_rewards))


def test_reference_logprobs_are_the_initial_policy(tmp_path: Path) -> None:
    """The reference stage (pipelines/grpo_kl.yaml) scores responses under the frozen initial policy.

    Step 0 is sampled from that very policy, so its reference and behaviour logprobs agree; step 1
    is sampled after an optimizer step, so they differ. Bug found: ReferenceStage.setup freezes the
    model (requires_grad_(False)) and then built a train engine (since deleted), whose AdamW got an empty
    parameter list and raised, so every grpo_kl run failed at set-up."""
    pipeline = _with_recorder("grpo_kl.yaml", "[step, response_ids, rollout_logprobs, ref_logprobs]")
    # 64 samples a step: enough for some group to have mixed rewards, so the policy moves at step 1
    result = _run(tmp_path, pipeline, algo={"steps": 2, "prompts_per_step": 8, "group_size": 8,
                                            "loss": {"kl_coef": 0.05}})
    rows = _rows(result.run_dir)
    assert len(rows) == 128
    for r in rows:
        assert len(r["ref_logprobs"]) == len(r["response_ids"])
    for r in (r for r in rows if r["step"] == 0):
        assert torch.allclose(torch.tensor(r["ref_logprobs"]), torch.tensor(r["rollout_logprobs"]), atol=1e-4), r
    diff = max(abs(a - b) for r in rows if r["step"] == 1
               for a, b in zip(r["ref_logprobs"], r["rollout_logprobs"], strict=True))
    assert diff > 1e-4
    assert all(math.isfinite(m["kl"]) for m in result.metrics)
    assert result.metrics[-1]["kl"] != 0.0  # the policy moved away from the reference


# ---------------------------------------------------------------- the advantage stage on rewards we choose

ADVANTAGE = """
name: adv
stages:
  - name: source
    class: tests.runtime.user_stages:CountingSource
    writes: [x, tag, reward]
  - name: advantage
    class: streamrl.stages.advantage:AdvantageStage
    reads: [reward]
    writes: [advantage]
    whole_groups: true
    micro_batch: 8
  - name: check
    class: tests.runtime.user_stages:Recorder
    reads: [x, reward, advantage]
"""

REWARDS = [1, 0, 0, 0,  0.5, 0.5, 0.5, 0.5,  1, 1, 0, 0,  0.2, 0.9, 0.4, 0.7,  3, -1, 2, 0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo"])
def test_advantage_normalises_within_groups(tmp_path: Path, estimator: str) -> None:
    normalize_std = estimator == "grpo"  # the stage calls the config's estimator by name
    pipeline = ADVANTAGE.replace("writes: [x, tag, reward]",
                                f"writes: [x, tag, reward]\n    options: {{n: 20, group_size: 4, rewards: {REWARDS}}}")
    result = _run(tmp_path, pipeline, algo={"advantage": estimator})
    rows = _rows(result.run_dir)
    assert [r["reward"] for r in rows] == [float(v) for v in REWARDS]
    for g in range(5):
        rewards = torch.tensor(REWARDS[4 * g:4 * g + 4], dtype=torch.float32)
        centred = rewards - rewards.mean()
        expected = centred / (rewards.std() + 1e-6) if normalize_std else centred
        got = torch.tensor([r["advantage"] for r in rows[4 * g:4 * g + 4]])
        assert torch.allclose(got, expected, atol=1e-5), (g, got, expected)
    # a group whose rewards are all equal carries no signal
    assert [r["advantage"] for r in rows[4:8]] == [0.0] * 4


def test_advantage_without_whole_groups_is_refused_before_anything_starts(tmp_path: Path) -> None:
    pipeline = ADVANTAGE.replace("whole_groups: true", "whole_groups: false").replace(
        "writes: [x, tag, reward]", f"writes: [x, tag, reward]\n    options: {{n: 4, rewards: {REWARDS[:4]}}}")
    with pytest.raises(ConfigError) as info:  # validation (AdvantageStage.check_spec), not the stage's set-up
        _run(tmp_path, pipeline)
    assert "stage 'advantage'" in str(info.value) and "set whole_groups: true" in str(info.value)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- the score stage with a user's reward function

SCORE = """
name: score
stages:
  - name: source
    class: streamrl.stages.source:SourceStage
    writes: [prompt_ids, prompt, answer, step]
  - name: oracle
    class: tests.runtime.user_stages:OracleGenerator
    reads: [prompt_ids, answer]
    writes: [response_ids]
  - name: score
    class: streamrl.stages.score:ScoreStage
    reads: [prompt, answer, response_ids]
    writes: [reward]
    options: {reward: "tests.stages.user_rewards:closeness"}
  - name: check
    class: tests.runtime.user_stages:Recorder
    reads: [answer, response_ids, reward]
"""


@pytest.mark.parametrize("overlong_buffer", [0, 3])
def test_score_with_a_user_reward_function(tmp_path: Path, overlong_buffer: int) -> None:
    """The user's reward per sample; with algo.overlong_buffer, DAPO's length shaping added to it."""
    result = _run(tmp_path, SCORE, algo={"steps": 1, "prompts_per_step": 4, "group_size": 2,
                                         "max_new_tokens": 4, "overlong_buffer": overlong_buffer})
    rows = _rows(result.run_dir)
    assert len(rows) == 8
    tok = build_char_tokenizer()
    shaped = []
    for r in rows:
        first = int(tok.convert_ids_to_tokens(r["response_ids"][0]))
        # 4 tokens allowed, the last 3 of them penalised: -(n - 1) / 3 for n >= 1 response tokens
        shaping = -max(len(r["response_ids"]) - 1, 0) / 3 if overlong_buffer else 0.0
        shaped.append(shaping)
        assert r["reward"] == pytest.approx(1 - abs(first - int(r["answer"])) / 9 + shaping)
    if overlong_buffer:
        assert any(s < 0 for s in shaped)
        return
    assert {r["reward"] for r in rows if r["index"] % 2 == 0} == {1.0}  # the oracle's right answers
    assert all(r["reward"] < 1 for r in rows if r["index"] % 2 == 1)


def test_score_rejects_unknown_options(tmp_path: Path) -> None:
    # caught by validation before any stage starts (ScoreStage.check_options in validate_pipeline)
    with pytest.raises(ConfigError) as info:
        _run(tmp_path, SCORE.replace('{reward: "tests.stages.user_rewards:closeness"}', "{rewrd: x}"),
             algo={"steps": 1, "prompts_per_step": 1, "group_size": 2})
    assert "stage 'score' options" in str(info.value) and "unknown options ['rewrd']" in str(info.value)
    assert not (tmp_path / "runs").exists()
