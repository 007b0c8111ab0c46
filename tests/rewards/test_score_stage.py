"""The score stage's reward-server side: its options, the named-scores rule, and what it sends.

The end-to-end runs use the real runtime (launch: inprocess) with a rule-based generator
(tests/runtime/user_stages.py: even samples answer right and end with EOS) and, for backend zmq, a
real ``streamrl reward-server`` process on 127.0.0.1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

import streamrl
from streamrl.config import ConfigError
from streamrl.runtime.stage import StageError
from streamrl.stages.score import ScoreOptions, ScoreOptionsError, ScoreStage, reward_of
from tests.rewards.conftest import Servers

pytestmark = pytest.mark.timeout(120)


# -- options --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rewrd": "x"}, "unknown options ['rewrd']"),
        ({"backend": "grpc"}, "`options.backend`"),
        ({"backend": "zmq", "endpoints": ["tcp://127.0.0.1:1"], "timeout_s": "30"}, "`options.timeout_s`"),
        ({"backend": "zmq"}, "backend zmq needs options.endpoints"),
        ({"backend": "zmq", "endpoints": ["tcp://h:1"], "reward": "m:f"}, "Remove options.reward"),
        ({"timeout_s": 5}, "options ['timeout_s'] only apply to backend: zmq"),
        ({"endpoints": ["tcp://h:1"]}, "only apply to backend: zmq"),
        ({"score_key": "a", "score_weights": {"a": 1.0}}, "not both"),
        ({"score_key": ""}, "options.score_key is empty"),
        ({"score_weights": {}}, "options.score_weights is empty"),
        ({"score_weights": {"a": math.inf}}, "not finite"),
        ({"score_weights": {"a": "heavy"}}, "`options.score_weights[...]`"),
        ({"on_sample_error": "keep"}, "`options.on_sample_error`"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ScoreOptionsError) as caught:
        ScoreStage.check_options(options)
    assert message in str(caught.value)


def test_good_options_are_typed() -> None:
    opts = ScoreStage.check_options(
        {"backend": "zmq", "endpoints": ["tcp://h:1"], "timeout_s": 5, "score_weights": {"a": 1, "b": 0.5}}
    )
    assert opts.timeout_s == 5.0 and opts.score_weights == {"a": 1.0, "b": 0.5}


# -- named scores -----------------------------------------------------------------------------------------


def reward(score: float | dict[str, float], **options: Any) -> float:
    return reward_of(score, ScoreOptions(**options), sample_id=7, source="tcp://h:1")


def test_a_number_is_the_reward_whatever_the_options() -> None:
    assert reward(0.5) == 0.5
    assert reward(0.5, score_key="x") == 0.5
    assert reward(0.5, score_weights={"x": 2.0}) == 0.5


def test_without_options_a_single_entry_or_the_reward_entry_is_the_reward() -> None:
    assert reward({"correct": 1.0}) == 1.0
    assert reward({"reward": 0.25, "format": 1.0}) == 0.25


def test_an_ambiguous_map_fails_saying_which_option_to_set() -> None:
    with pytest.raises(ScoreOptionsError) as caught:
        reward({"correct": 1.0, "format": 0.5})
    text = str(caught.value)
    assert "sample 7" in text and "tcp://h:1" in text
    assert "set options.score_key to one of ['correct', 'format']" in text
    assert "options.score_weights: {correct: 1.0, format: 1.0}" in text


def test_score_key_and_weights() -> None:
    assert reward({"correct": 1.0, "format": 0.5}, score_key="format") == 0.5
    assert (
        reward({"correct": 1.0, "format": 0.5, "len": 9.0}, score_weights={"correct": 1.0, "format": 0.4})
        == 1.2
    )
    with pytest.raises(
        ScoreOptionsError,
        match=r"without options.score_key='reward'; set options.score_key to one of \['a', 'b'\]",
    ):
        reward({"a": 1.0, "b": 2.0}, score_key="reward")
    with pytest.raises(ScoreOptionsError, match=r"without \['b'\], which options.score_weights weights"):
        reward({"a": 1.0}, score_weights={"a": 1.0, "b": 1.0})


# -- end to end -------------------------------------------------------------------------------------------

PIPELINE = """
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
    options: OPTIONS
  - name: check
    class: tests.runtime.user_stages:Recorder
    reads: [answer, response_ids, reward]
"""


def run(tmp_path: Path, options: dict[str, Any]) -> list[dict[str, Any]]:
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.replace("OPTIONS", json.dumps(options)))
    result = streamrl.run(
        {
            "pipeline": str(path),
            "resources": {"launch": "inprocess"},
            "algo": {"steps": 1, "prompts_per_step": 4, "group_size": 2},
            "output": {
                "run_dir": str(tmp_path / "runs"),
                "progress": "none",
                "checkpoint": False,
                "tensorboard": False,
                "plot": False,
            },
        }
    )
    rows = [json.loads(line) for line in (result.run_dir / "check.jsonl").read_text().splitlines()]
    return sorted(rows, key=lambda r: r["index"])


def assert_exact_rewards(rows: list[dict[str, Any]]) -> None:
    """Even samples answered right *with* EOS in their ids: reward 1.0 only if the response text the
    reward saw had no "<eos>" in it; odd ones answered wrong."""
    assert len(rows) == 8
    assert all(r["response_ids"][-1] == 1 for r in rows if r["index"] % 2 == 0)  # EOS (id 1) was sampled
    assert [r["reward"] for r in rows] == [1.0, 0.0] * 4


def test_backend_zmq_with_score_key_sends_text_without_special_tokens(
    servers: Servers, tmp_path: Path
) -> None:
    server = servers.reward_server("tests.rewards.reward_test_functions:exact_named")
    rows = run(tmp_path, {"backend": "zmq", "endpoints": [server.endpoint], "score_key": "exact"})
    assert_exact_rewards(rows)


def test_inprocess_with_score_weights_sees_the_same_text(tmp_path: Path) -> None:
    weights = {"exact": 1.0, "eos_in_text": 100.0}  # any leaked EOS text would show as >= 100
    rows = run(
        tmp_path, {"reward": "tests.rewards.reward_test_functions:exact_named", "score_weights": weights}
    )
    assert_exact_rewards(rows)


def test_ambiguous_named_scores_fail_the_run_naming_score_key(servers: Servers, tmp_path: Path) -> None:
    server = servers.reward_server("tests.rewards.reward_test_functions:exact_named")
    with pytest.raises(StageError) as caught:
        run(tmp_path, {"backend": "zmq", "endpoints": [server.endpoint]})
    assert caught.value.stage == "score"
    assert "set options.score_key to one of ['eos_in_text', 'exact']" in str(caught.value)


def test_bad_options_fail_before_anything_starts(tmp_path: Path) -> None:
    """The pipeline check calls ScoreStage.check_options when it loads the pipeline."""
    with pytest.raises(ConfigError) as caught:
        run(tmp_path, {"timeout_s": 3})
    assert "stage 'score' options" in str(caught.value) and "only apply to backend: zmq" in str(caught.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("check.jsonl"))
