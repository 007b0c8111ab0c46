"""Worker supervision with real processes: a SIGKILLed generate, score or reference worker is
restarted and every sample still reaches every stage exactly once; a dead trainer stops the run
saying how to resume (or resumes it, with resources.auto_resume); a stalled stage is reported
with its Python stack and the run stops; a dead dock server stops the run within seconds."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from streamrl.runtime.launcher import RunFailed, run
from tests.runtime.hygiene import processes_with_files_under, wait_gone
from tests.runtime.user_stages import grpo_with_stage

REPO = Path(__file__).resolve().parents[2]
B = 16  # samples per step


def _config(tmp: Path, pipeline: str = "grpo.yaml", steps: int = 20, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "pipeline": str(REPO / "pipelines" / pipeline) if "/" not in pipeline else pipeline,
        "model": {"tiny": {"arch": "qwen2", "hidden": 32, "layers": 1, "heads": 2, "intermediate": 64,
                           "max_positions": 32, "seed": 0}},
        "task": {"name": "digits-max", "options": {"n_digits": 3}},
        "algo": {"steps": steps, "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 3, "lr": 1e-3},
        "resources": {"dock": {"lease_ttl_s": 1.0}, "max_restarts": 2},
        "output": {"name": "sup", "progress": "none", "tensorboard": False, "plot": False, "checkpoint": False},
        "stages": {s: {"micro_batch": 16} for s in ("generate", "score", "advantage", "train")},
    }
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return path.read_text().count('"reward_mean"') if path.exists() else 0


def _pid_of(run_dir: Path, name: str) -> int:
    return int(json.loads((run_dir / "logs" / "pids.json").read_text())[name])


def _kill_in_turn(run_dir: Path, plan: list[tuple[int, Callable[[], int]]], done: list[int],
                  timeout_s: float = 120) -> threading.Thread:
    """In the background: once ``step`` steps are done, SIGKILL the process ``pid()`` names."""
    def killer() -> None:
        deadline = time.monotonic() + timeout_s
        for step, pid in plan:
            while _steps_done(run_dir) < step and time.monotonic() < deadline:
                time.sleep(0.02)
            if time.monotonic() >= deadline:
                return
            victim = pid()
            os.kill(victim, signal.SIGKILL)
            done.append(victim)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(240)
def test_killed_generate_score_and_reference_workers_are_restarted_and_nothing_is_lost(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = _config(tmp_path, "grpo_kl.yaml", steps=20, algo={"loss": {"kl_coef": 0.01}},
                  stages={"reference": {"micro_batch": 16}})
    killed: list[int] = []
    plan = [(2, lambda: _pid_of(run_dir, "generate-0")), (6, lambda: _pid_of(run_dir, "score-0")),
            (10, lambda: _pid_of(run_dir, "reference-0"))]
    killer = _kill_in_turn(run_dir, plan, killed)
    result = run(cfg, run_dir=run_dir)
    killer.join(5)
    assert len(killed) == 3, killed
    assert result.steps == 20 and result.restarts == {"generate-0": 1, "score-0": 1, "reference-0": 1}
    # the dock's accounting: every consumer acked every sample once (an ack of a lease that
    # expired with its dead worker is refused, so nothing counts twice)
    stats = result.dock_statistics
    assert stats["reserved_total"] == 20 * B
    assert {name: c["done"] for name, c in stats["consumers"].items()} == dict.fromkeys(
        ["generate", "reference", "score", "advantage", "train"], 20 * B)
    assert stats["leases_expired"] >= 1  # the dead workers' leases came back through their TTL
    # and the trainer's: each step trained B distinct samples, none twice
    assert all(r["repeated_samples"] == 0 for r in result.metrics)
    assert result.metrics[-1]["restarts/reference-0"] == 1
    assert not wait_gone(processes_with_files_under(run_dir), 10)


@pytest.mark.timeout(240)
def test_a_dead_trainer_stops_the_run_saying_how_to_resume_or_resumes_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    killed: list[int] = []
    killer = _kill_in_turn(run_dir, [(3, lambda: _pid_of(run_dir, "train-0"))], killed)
    with pytest.raises(RunFailed, match=r"stage 'train' worker 0 was killed by signal 9.*--resume") as failed:
        run(_config(tmp_path, output={"checkpoint_every": 2}), run_dir=run_dir)
    killer.join(5)
    assert failed.value.resumable
    assert not wait_gone(processes_with_files_under(run_dir), 10)

    # resources.auto_resume: the same death, and the run resumes from its checkpoint by itself
    auto_dir = tmp_path / "auto"
    killer = _kill_in_turn(auto_dir, [(5, lambda: _pid_of(auto_dir, "train-0"))], killed)
    result = run(_config(tmp_path, output={"checkpoint_every": 2}, resources={"auto_resume": 1}), run_dir=auto_dir)
    killer.join(5)
    assert result.resumed_from is not None and result.resumed_from >= 2
    assert [r["step"] for r in result.metrics] == list(range(1, 21))


@pytest.mark.timeout(240)
def test_a_stalled_stage_is_reported_with_its_stack_and_the_run_stops(tmp_path: Path) -> None:
    path = grpo_with_stage(tmp_path, "advantage", "tests.runtime.stalling_stages:HangsOnThirdBatch")
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    # the stage says when its batch begins, then blocks its event loop: past SILENT_WORKER_S (5 s) of
    # silence, while the other workers still send heartbeats, the launcher names it as blocked. The
    # blocked worker cannot exit by itself: exit_grace_s (30 s by default) of waiting for it is cut to 3 s,
    # then the launcher's SIGTERM and SIGKILL stop it
    with pytest.raises(RunFailed) as failed:
        run(_config(tmp_path, str(path), resources={"stall_timeout_s": 6.0, "exit_grace_s": 3.0}), run_dir=run_dir)
    message = str(failed.value)
    assert "no optimizer step for" in message and "resources.stall_timeout_s=6" in message
    assert "stage 'advantage' worker 0 sent nothing for" in message  # its event loop is blocked
    assert re.search(r"stalling_stages\.py\", line \d+ in process", message), message  # faulthandler's stack
    assert time.monotonic() - t0 < 100  # stopped by the launcher, not by the sleep ending
    assert not wait_gone(processes_with_files_under(run_dir), 30)


@pytest.mark.timeout(240)
def test_a_dead_dock_server_stops_the_run_within_seconds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    killed: list[int] = []
    t_kill: list[float] = []

    def controller() -> int:
        t_kill.append(time.monotonic())
        return int(json.loads((run_dir / "logs" / "pids.json").read_text())["dock"][0])

    killer = _kill_in_turn(run_dir, [(2, controller)], killed)
    with pytest.raises(RunFailed, match=r"dock server process died.*saved no checkpoint"):
        run(_config(tmp_path, steps=1000), run_dir=run_dir)
    killer.join(5)
    assert time.monotonic() - t_kill[0] < 30
    assert not wait_gone(processes_with_files_under(run_dir), 10)
