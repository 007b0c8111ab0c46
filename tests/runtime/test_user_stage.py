"""A user's own stage classes plug into a pipeline exactly like the built-in ones, in real processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import streamrl
from streamrl.models.tokenizer import build_char_tokenizer
from streamrl.runtime.forkserver import start_forkserver
from streamrl.tasks.registry import get_task
from tests.runtime.hygiene import assert_run_cleaned, ipc_dirs

# Built-in source and score stages around two user stages: the user's generator writes the
# built-in column response_ids, the user's length stage writes a new column, response_len,
# and a user sink checks everything per sample.
PIPELINE = """
name: mixed
stages:
  - name: source
    class: streamrl.stages.source:SourceStage
    writes: [prompt_ids, prompt, answer, step]
    options: {gate_on_policy: false}  # no trainer publishes versions here
  - name: oracle
    class: tests.runtime.user_stages:OracleGenerator
    reads: [prompt_ids, answer]
    writes: [response_ids]
    micro_batch: 3
  - name: length
    class: tests.runtime.user_stages:ResponseLength
    reads: [response_ids]
    writes: [response_len]
    workers: 2
    micro_batch: 2
  - name: score
    class: streamrl.stages.score:ScoreStage
    reads: [prompt, answer, response_ids]
    writes: [reward]
  - name: check
    class: tests.runtime.user_stages:Recorder
    reads: [prompt, answer, response_ids, response_len, reward, step]
    micro_batch: 5
    options: {environ: STREAMRL_TEST_LAUNCHER_ENV}
"""


@pytest.mark.timeout(90)
def test_user_stages_run_like_built_in_ones_in_processes(tmp_path: Path, importable_tests: None,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # a variable set after the workers' forkserver started (as by a notebook between two runs)
    start_forkserver()
    monkeypatch.setenv("STREAMRL_TEST_LAUNCHER_ENV", str(tmp_path))
    pipeline = tmp_path / "mixed.yaml"
    pipeline.write_text(PIPELINE)
    steps, prompts, group = 2, 3, 4
    n = steps * prompts * group
    before = ipc_dirs()
    result = streamrl.run({
        "pipeline": str(pipeline),
        "algo": {"steps": steps, "prompts_per_step": prompts, "group_size": group},
        "task": {"name": "digits-max", "seed": 5},
        "resources": {"launch": "processes", "dock": {"capacity": n}},
        "output": {"run_dir": str(tmp_path / "runs"), "progress": "none", "name": "mixed"},
    })
    assert result.stop_reason == "all stages finished"
    assert result.steps == 0 and result.metrics == []  # no trainer, no optimizer steps
    rows = [json.loads(line) for line in (result.run_dir / "check.jsonl").read_text().splitlines()]

    # every sample reached the user's sink exactly once, with the user's new column
    assert sorted(r["index"] for r in rows) == list(range(n))
    tok = build_char_tokenizer()
    task = get_task("digits-max", tokenizer=tok)
    for r in rows:
        assert r["response_len"] == len(r["response_ids"]), r
        assert r["step"] == r["index"] // (prompts * group)
        # the built-in score stage scored the user's generations with the task's rule
        right = r["index"] % 2 == 0
        assert r["reward"] == (1.0 if right else 0.0), r
        assert r["reward"] == task.reward(r["prompt"], "", r["response_ids"], r["answer"])
    assert {r["response_len"] for r in rows} >= {2, 1, 3}  # lengths really vary
    # the sink ran in its own worker process, not in the test's, with the launcher's environment
    assert {r["pid"] for r in rows} != {os.getpid()}
    assert {r["environ"] for r in rows} == {str(tmp_path)}
    # both workers of the user's length stage exist and were set up from the same class
    assert set(result.worker_logs) == {"source-0", "oracle-0", "length-0", "length-1", "score-0", "check-0"}
    assert (result.run_dir / "check.closed.jsonl").exists()  # close() ran
    assert (result.run_dir / "config.yaml").exists() and (result.run_dir / "pipeline.yaml").read_text() == PIPELINE
    assert_run_cleaned(result.run_dir, os.getpid(), before)
