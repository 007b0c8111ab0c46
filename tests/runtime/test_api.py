"""The Python API: ``streamrl.run`` / ``streamrl.arun`` with a dict, a path or a RunConfig -> RunResult."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

import streamrl
from streamrl.config import ConfigError, load_config
from streamrl.runtime.launcher import RunResult
from streamrl.runtime.prerun import choose_pipeline
from tests.runtime.hygiene import ipc_dirs, leftover_ipc_dirs

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "grpo_digits.yaml"
QUICK = ["resources.launch=inprocess", "algo.stop_reward=null", "output.progress=none"]
METRIC_KEYS = {"step", "reward_mean", "reward_std", "loss", "kl", "clip_fraction", "entropy", "tokens_per_s",
               "samples_per_s", "staleness_mean", "elapsed_s"}


def _digits_dict(tmp_path: Path, **algo: Any) -> dict[str, Any]:
    cfg = yaml.safe_load(DIGITS.read_text())
    cfg["pipeline"] = str(REPO / "pipelines" / "grpo.yaml")  # a dict has no file to be relative to
    cfg["algo"].update({"stop_reward": None, **algo})
    cfg["resources"] = {"launch": "inprocess"}
    cfg["output"] = {"run_dir": str(tmp_path), "progress": "none", "name": "api"}
    return cfg


def test_run_a_dict_returns_a_result_with_metrics(tmp_path: Path) -> None:
    before = ipc_dirs()
    result = streamrl.run(_digits_dict(tmp_path, steps=3))
    assert isinstance(result, RunResult)
    assert result.steps == 3 and [m["step"] for m in result.metrics] == [1, 2, 3]
    for m in result.metrics:
        assert set(m) >= METRIC_KEYS, METRIC_KEYS - set(m)
        assert 0.0 <= m["reward_mean"] <= 1.0
    assert result.final_reward == result.metrics[-1]["reward_mean"]
    assert result.stop_reason == "completed 3 steps"
    assert result.run_dir.parent == tmp_path and result.run_dir.name.startswith("api-")
    assert result.checkpoint == result.run_dir / "checkpoint" and result.checkpoint.is_dir()
    assert result.setup_s > 0 and result.train_s > 0 and result.total_s >= result.train_s
    assert result.time_to_target_s is None  # no stop_reward
    assert result.worker_logs == {}  # in-process: no worker processes, no logs
    # nothing left running in this process either: the dock's server threads stopped, ipc dir removed
    assert not [t.name for t in threading.enumerate() if t.name.startswith("dock-")]
    assert not leftover_ipc_dirs(before)


def test_run_a_path_with_overrides_stops_at_the_target(tmp_path: Path) -> None:
    result = streamrl.run(str(DIGITS), [*QUICK, f"output.run_dir={tmp_path}", "algo.stop_reward=0.0",
                                        "output.checkpoint=false"])
    assert result.steps == 1  # any reward >= 0.0
    assert "stop_reward" in result.stop_reason
    assert result.time_to_target_s is not None and 0 < result.time_to_target_s <= result.train_s + 1e-6
    assert result.checkpoint is None


def test_arun_with_a_runconfig_and_a_chosen_run_dir(tmp_path: Path) -> None:
    cfg = load_config(DIGITS, [*QUICK, "algo.steps=2", "output.tensorboard=false", "output.plot=false"])
    target = tmp_path / "exactly-here"

    async def main() -> RunResult:
        return await streamrl.arun(cfg, run_dir=target)

    result = anyio.run(main)
    assert result.run_dir == target and result.steps == 2
    assert (target / "metrics.jsonl").read_text().count("\n") == 2
    saved = load_config(yaml.safe_load((target / "config.yaml").read_text()))
    assert saved == choose_pipeline(cfg) and saved.pipeline == "pipelines/grpo_sync.yaml"  # what `auto` picked
    assert not (target / "tensorboard").exists() and not (target / "reward_curve.png").exists()


def test_run_refuses_a_bad_config_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        streamrl.run(_digits_dict(tmp_path) | {"algo": {"stepz": 3}})
    assert list(tmp_path.iterdir()) == []


UNGUARDED_SCRIPT = """
import streamrl

# no `if __name__ == "__main__":` guard, as in a notebook export or a quick script
result = streamrl.run({{
    "pipeline": {pipeline!r},
    "algo": {{"steps": 1, "prompts_per_step": 2, "group_size": 2}},
    "resources": {{"launch": "processes"}},
    "output": {{"run_dir": {runs!r}, "progress": "none"}},
}})
print("RESULT", result.stop_reason)
"""


@pytest.mark.timeout(150)
def test_a_script_without_a_main_guard_runs_once(tmp_path: Path) -> None:
    """Bug found: the launcher forks workers from a multiprocessing forkserver, which imports the
    user's script (``__main__``) again: a top-level ``streamrl.run(...)`` then starts nested runs
    inside the forkserver (several run dirs) and the real run fails ('worker ... exited with code 1').
    Either it runs once, or it is refused with a message that says to add the guard."""
    pipeline = tmp_path / "pipe.yaml"
    pipeline.write_text("""
name: tiny
stages:
  - name: source
    class: tests.runtime.user_stages:CountingSource
    writes: [x, tag]
    options: {n: 4, group_size: 2}
  - name: sink
    class: tests.runtime.user_stages:Recorder
    reads: [x]
""")
    script = tmp_path / "train_it.py"
    script.write_text(UNGUARDED_SCRIPT.format(pipeline=str(pipeline), runs=str(tmp_path / "runs")))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=140, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir()) if (tmp_path / "runs").exists() else []
    if proc.returncode == 0:
        assert "RESULT all stages finished" in proc.stdout
        assert len(runs) == 1, runs
    else:
        assert "__main__" in proc.stderr, proc.stderr[-2000:]
        assert len(runs) <= 1, runs
